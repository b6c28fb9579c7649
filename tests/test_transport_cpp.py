"""The TCP transport's own tests (tests/cpp/transport_test.cc), built with the
system C++ compiler against the torch-free layers only."""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(tmp_path, main_source, extra_flags=()):
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++) on PATH")
    sources = [main_source] + sorted(
        glob.glob(os.path.join(ROOT, "csrc", "transport", "*.cc"))
        + glob.glob(os.path.join(ROOT, "csrc", "algorithms", "*.cc"))
        + glob.glob(os.path.join(ROOT, "csrc", "kernels", "cpu", "*.cc"))
    )
    binary = str(tmp_path / "test_binary")
    cmd = [compiler, "-std=c++17", "-O1", "-g", "-pthread", "-I", os.path.join(ROOT, "csrc"),
           *extra_flags, *sources, "-o", binary]
    subprocess.run(cmd, check=True, timeout=300)
    return binary


def test_tcp_transport(tmp_path):
    binary = build(tmp_path, os.path.join(ROOT, "tests", "cpp", "transport_test.cc"))
    proc = subprocess.run([binary], capture_output=True, text=True, timeout=120)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all passed" in proc.stdout
