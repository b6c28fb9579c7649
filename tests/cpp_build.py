"""Builds the tests' C++ (torch-free layers only) with the system compiler: the
sources of csrc/{common,kernels/cpu,transport,algorithms} compiled once per
content into a cache (in parallel), then linked into a test binary or into the
loopback harness module (tests/loopback.py).

PYCOMM_TEST_SANITIZE=address,undefined (any -fsanitize= list) builds all of it
with those sanitizers (-O0 -g1, as setup.py builds them; UBSan without recovery), cached apart from the
normal build; a sanitized loopback module needs the sanitizer runtime preloaded
into python (`make test-asan` sets it up)."""
from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
FLAGS = ("-std=c++17", "-O2", "-fPIC", "-pthread")  # not setup.py's -O3: it compiles the kernels 3-4x slower (tests check results, not speed)
LIBS = ("-lcrypto",)  # transport/hmac.cc: OpenSSL's libcrypto


def _sanitize_flags() -> tuple:
    knob = os.environ.get("PYCOMM_TEST_SANITIZE", "").strip().replace(" ", "")
    if not knob:
        return ()
    for name in knob.split(","):
        if not name or not all(c.isalnum() or c in "-_" for c in name):
            raise ValueError(f"PYCOMM_TEST_SANITIZE must be a comma-separated list of sanitizers (got {knob!r})")
    return (f"-fsanitize={knob}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g1", "-O0")


# The flags are part of every cache key, so a sanitized build never meets a normal one.
FLAGS += _sanitize_flags()
LAYERS = ("transport", "algorithms", os.path.join("kernels", "cpu"))


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on PATH")
    return cxx


def cache_dir() -> str:
    path = os.environ.get("PYCOMM_TEST_BUILD_DIR") or os.path.join(
        tempfile.gettempdir(), f"pycomm-test-build-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def includes(source: str) -> list:
    """``source`` and every file it includes with ``#include "..."``, transitively (found
    beside the including file or under csrc/, as -Icsrc finds them): what its object
    depends on besides the compiler, the flags and the system's headers."""
    seen, stack = set(), [os.path.abspath(source)]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen.add(path)
        with open(path, errors="replace") as f:
            text = f.read()
        for name in _INCLUDE.findall(text):
            for base in (os.path.dirname(path), CSRC):
                candidate = os.path.normpath(os.path.join(base, name))
                if os.path.isfile(candidate):
                    stack.append(candidate)
                    break
    return sorted(seen)


def _digest(paths) -> "hashlib._Hash":
    """Of the files' contents and their names: relative to the checkout (a clone elsewhere
    finds what this one built), the base name of a file outside it (a source a test
    writes to its tmp_path is found again by its content)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            path = os.path.abspath(path)
            name = os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else os.path.basename(path)
            digest.update(name.encode() + b"\0" + f.read())
    return digest


def _key(paths, extra=()) -> str:
    """The cache key of what ``paths`` build into: their contents with those of every
    header they include, the compiler and the flags."""
    files = sorted({dep for path in paths for dep in (includes(path) if path.endswith((".cc", ".h", ".cu", ".cuh"))
                                                       else [path])})
    digest = _digest(files)
    digest.update(" ".join((compiler(),) + FLAGS + tuple(extra)).encode())
    return digest.hexdigest()[:20]


@functools.lru_cache(maxsize=None)
def tool_version(tool: str) -> str:
    """``tool --version``'s output (part of a cached check's key)."""
    proc = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60)
    return proc.stdout + proc.stderr


def cached_check(cmd: list, sources: list, tools: list = (), extra_key: str = "",
                 timeout: float = 600) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` (text output captured), or the result it gave before for the
    same command, the same contents of ``sources`` and every header they include, the
    same ``--version`` of each of ``tools`` and the same ``extra_key`` (what else the
    command reads: torch's version and headers' path). Only a clean result (exit code 0)
    is kept: a failure always runs again."""
    import json

    digest = _digest(sorted({dep for source in sources for dep in includes(source)}))
    digest.update(json.dumps([cmd, [tool_version(t) for t in tools], extra_key]).replace(ROOT, "<checkout>").encode())
    path = os.path.join(cache_dir(), "checks", digest.hexdigest()[:24] + ".json")
    if os.path.exists(path):
        with open(path) as f:
            got = json.load(f)
        return subprocess.CompletedProcess(cmd, got["returncode"], got["stdout"], got["stderr"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}, f)
        os.replace(tmp, path)
    return proc


def _build_once(out: str, build) -> str:
    """``out``, made by ``build(tmp)`` (then renamed) unless it is in the cache. One process
    or thread builds it at a time: the suite's xdist workers and a test's ranks ask for the
    same objects at once, and one that finds another building it waits for that build
    (bounded by the compiler's timeout) and reuses it instead of compiling it again."""
    if os.path.exists(out):
        return out
    with open(f"{out}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.exists(out):
                tmp = f"{out}.{os.getpid()}.{threading.get_ident()}.tmp"
                build(tmp)
                os.replace(tmp, out)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def _compile(source: str, extra=()) -> str:
    obj = os.path.join(cache_dir(), f"{os.path.basename(source)}-{_key([source], extra)}.o")
    return _build_once(obj, lambda tmp: subprocess.run(
        [compiler(), *FLAGS, *extra, "-I", CSRC, "-c", source, "-o", tmp], check=True, timeout=600))


def extension_objects_dir():
    """Where setup.py built pycomm._C's objects, for the tests to link the torch-free ones
    instead of compiling them again: PYCOMM_TEST_EXTENSION_OBJECTS, a build folder
    (`make test-asan` names the sanitized build's), or "auto" (`make test`: the normal
    build's, build/temp-<torch>-<cpu|cuda>/). Unset (a plain pytest): none."""
    folder = os.environ.get("PYCOMM_TEST_EXTENSION_OBJECTS", "")
    if folder != "auto":
        return folder or None
    import torch

    for kind in ("cpu", "cuda"):
        candidate = os.path.join(ROOT, "build", f"temp-{torch.__version__}-{kind}")
        if os.path.isdir(candidate):
            return candidate
    return None


def extension_object(source: str):
    """setup.py's object for ``source``, when there is one newer than the source and every
    header it includes; else None (the tests compile their own). Its flags differ from
    FLAGS only where the tests do not care: -O3 (-O0 sanitized) and python's -DNDEBUG
    -fwrapv (csrc's torch-free layers have no assert()); sanitized, it recovers from a
    UBSan report unless UBSAN_OPTIONS=halt_on_error=1, which `make test-asan` sets."""
    folder = extension_objects_dir()
    if folder is None:
        return None
    obj = os.path.join(folder, os.path.splitext(os.path.relpath(os.path.abspath(source), ROOT))[0] + ".o")
    try:
        built = os.path.getmtime(obj)
    except OSError:
        return None
    if any(os.path.getmtime(dep) > built for dep in includes(source)):
        return None  # a source or header changed since pycomm._C was built
    return obj


def library_objects() -> list:
    """The torch-free layers' objects: pycomm._C's own where they are up to date
    (extension_object), the others compiled (or found in the cache) in parallel. Each
    process starts at a different source, so processes that build at once (the xdist
    workers' first C++ tests) share the work out instead of queueing on the same lock."""
    sources = sorted(s for layer in LAYERS for s in glob.glob(os.path.join(CSRC, layer, "*.cc")))
    found = {source: extension_object(source) for source in sources}
    missing = [source for source in sources if found[source] is None]
    if missing:
        start = os.getpid() % len(missing)
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            list(pool.map(_compile, missing[start:] + missing[:start]))
    return [found[source] or _compile(source) for source in sources]  # all cached now, in a stable order


def binary(main_source: str) -> str:
    """A test program: `main_source` linked with the library objects."""
    objects = library_objects()
    out = os.path.join(cache_dir(), f"{os.path.basename(main_source)}-{_key([main_source] + objects)}")
    return _build_once(out, lambda tmp: subprocess.run(
        [compiler(), *FLAGS, _compile(main_source), *objects, *LIBS, "-o", tmp], check=True, timeout=600))


def python_module(name: str, source: str):
    """A pybind11 module `name` from `source` plus the library objects, imported."""
    pybind11 = pytest.importorskip("pybind11")
    include_flags = ["-I", pybind11.get_include(), "-I", sysconfig.get_paths()["include"]]
    objects = library_objects()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = os.path.join(cache_dir(), f"{name}-{_key([source] + objects, include_flags)}{suffix}")
    _build_once(out, lambda tmp: subprocess.run(  # the ranks of one test ask for it at once
        [compiler(), *FLAGS, "-shared", _compile(source, include_flags), *objects, *LIBS, "-o", tmp],
        check=True, timeout=600))
    spec = importlib.util.spec_from_file_location(name, out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def run_test_program(main_source: str, timeout: float = 120) -> str:
    """Builds and runs a C++ test program (tests/cpp/*_test.cc: one line per check);
    the calling test fails unless it exits 0 having printed "all passed"."""
    proc = subprocess.run([binary(main_source)], capture_output=True, text=True, timeout=timeout)
    print(proc.stdout)
    assert proc.returncode == 0 and "all passed" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout
