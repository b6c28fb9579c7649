"""The TCP transport's own tests (tests/cpp/transport_test.cc), built with the
system C++ compiler against the torch-free layers only (tests/cpp_build.py)."""
import os
import subprocess

import cpp_build


def test_tcp_transport():
    binary = cpp_build.binary(os.path.join(cpp_build.ROOT, "tests", "cpp", "transport_test.cc"))
    proc = subprocess.run([binary], capture_output=True, text=True, timeout=120)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all passed" in proc.stdout
