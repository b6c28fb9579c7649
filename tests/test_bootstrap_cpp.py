"""A group's bootstrap without torch (tests/cpp/bootstrap_test.cc): TCP mesh,
host keys, the shared-memory vote and the arena, ranks as threads over
memory_store.h."""
import os
import subprocess

import cpp_build


def test_bootstrap():
    binary = cpp_build.binary(os.path.join(cpp_build.ROOT, "tests", "cpp", "bootstrap_test.cc"))
    proc = subprocess.run([binary], capture_output=True, text=True, timeout=120)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all passed" in proc.stdout
