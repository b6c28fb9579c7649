"""tests/cpp_build.py's caches: an object is keyed on its source and the headers it includes
(not on unrelated ones); a compile check's clean verdict is kept per content, a failure
always runs again."""
from __future__ import annotations

import sys

import cpp_build


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_includes_follow_quoted_headers_transitively(tmp_path):
    (tmp_path / "sub").mkdir()
    a = _write(tmp_path / "a.cc", '#include "sub/b.h"\n#include <vector>\nint main() {}\n')
    b = _write(tmp_path / "sub" / "b.h", '#pragma once\n  #  include "c.h"\n#include "common/error.h"\n')
    c = _write(tmp_path / "sub" / "c.h", "#pragma once\n")
    _write(tmp_path / "unrelated.h", "#pragma once\n")
    got = cpp_build.includes(a)
    assert set(got) >= {a, b, c} and str(tmp_path / "unrelated.h") not in got, got
    assert any(p.endswith("csrc/common/error.h") for p in got), got  # found under csrc/ as -Icsrc finds it


def test_object_key_changes_with_an_included_header_only(tmp_path):
    a = _write(tmp_path / "a.cc", '#include "b.h"\n')
    b = tmp_path / "b.h"
    b.write_text("// one\n")
    other = tmp_path / "other.h"
    other.write_text("// one\n")
    key = cpp_build._key([a])
    other.write_text("// two\n")
    assert cpp_build._key([a]) == key
    b.write_text("// two\n")
    assert cpp_build._key([a]) != key
    assert cpp_build._key([a], ("-DX",)) != cpp_build._key([a])


def test_cached_check_keeps_clean_results_per_content(tmp_path, monkeypatch):
    monkeypatch.setenv("PYCOMM_TEST_BUILD_DIR", str(tmp_path / "cache"))
    log = tmp_path / "runs.log"
    src = _write(tmp_path / "a.cc", '#include "b.h"\n')
    header = tmp_path / "b.h"
    header.write_text("// one\n")
    ok = [sys.executable, "-c", f"open({str(log)!r}, 'a').write('run\\n'); print('checked')"]

    def runs():
        return len(log.read_text().splitlines()) if log.exists() else 0

    first = cpp_build.cached_check(ok, [src])
    assert (first.returncode, first.stdout, runs()) == (0, "checked\n", 1)
    again = cpp_build.cached_check(ok, [src])
    assert (again.returncode, again.stdout, runs()) == (0, "checked\n", 1)  # from the cache
    header.write_text("// two\n")
    assert cpp_build.cached_check(ok, [src]).returncode == 0 and runs() == 2  # a header it includes changed
    assert cpp_build.cached_check(ok, [src], extra_key="other torch").returncode == 0 and runs() == 3

    failing = ok[:-1] + [ok[-1] + "; raise SystemExit(3)"]
    assert cpp_build.cached_check(failing, [src]).returncode == 3 and runs() == 4
    assert cpp_build.cached_check(failing, [src]).returncode == 3 and runs() == 5  # never kept


def test_processes_asking_for_one_object_at_once_compile_it_once(tmp_path):
    # The xdist workers' first C++ tests (and a test's ranks) ask for the same objects at
    # once: one compiles each, the others wait for it and reuse it.
    import os
    import subprocess

    log = tmp_path / "compiles.log"
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\necho run >> {log}\nsleep 1\nexec g++ \"$@\"\n")
    cxx.chmod(0o755)
    src = _write(tmp_path / "one.cc", "int one() { return 1; }\n")
    env = dict(os.environ, CXX=str(cxx), PYCOMM_TEST_BUILD_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.path.dirname(cpp_build.__file__))
    code = f"import cpp_build; print(cpp_build._compile({src!r}))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len(set(outs)) == 1 and os.path.exists(outs[0]), outs
    assert log.read_text().splitlines() == ["run"]  # compiled once, not once per process


def test_extension_objects_are_linked_only_when_newer_than_their_sources(tmp_path, monkeypatch):
    # make test links pycomm._C's torch-free objects instead of compiling them again; an
    # object older than its source or a header it includes is not used.
    import os

    source = os.path.join(cpp_build.CSRC, "transport", "tcp.cc")
    obj = tmp_path / "csrc" / "transport" / "tcp.o"
    obj.parent.mkdir(parents=True)
    obj.write_bytes(b"")
    newest = max(os.path.getmtime(dep) for dep in cpp_build.includes(source))
    monkeypatch.delenv("PYCOMM_TEST_EXTENSION_OBJECTS", raising=False)
    assert cpp_build.extension_object(source) is None  # a plain pytest compiles its own
    monkeypatch.setenv("PYCOMM_TEST_EXTENSION_OBJECTS", str(tmp_path))
    os.utime(obj, (newest + 10, newest + 10))
    assert cpp_build.extension_object(source) == str(obj)
    os.utime(obj, (newest - 10, newest - 10))  # a header changed after the build
    assert cpp_build.extension_object(source) is None
    obj.unlink()
    assert cpp_build.extension_object(source) is None
