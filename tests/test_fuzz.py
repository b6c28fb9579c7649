"""Fuzzes the TCP wire parsing and the handshake checks (tests/fuzz/fuzz_wire.cc): libFuzzer with
ASan/UBSan when clang is installed, else a seeded random-mutation driver built
with g++. The number of executions is printed (run pytest with -s to see it)."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "tests", "fuzz", "fuzz_wire.cc")
WIRE = [os.path.join(ROOT, "csrc", "transport", name) for name in ("wire.cc", "hmac.cc")]
RUNS = int(os.environ.get("PYCOMM_FUZZ_RUNS", "300000"))


def test_fuzz_wire_parser(tmp_path):
    binary = str(tmp_path / "fuzz_wire")
    clang = shutil.which("clang++")
    flags = ["-std=c++17", "-g", "-O1", "-I", os.path.join(ROOT, "csrc")]
    if clang:
        cmd = [clang, *flags, "-fsanitize=fuzzer,address,undefined", HARNESS, *WIRE, "-o", binary]
        run = [binary, f"-runs={RUNS}", "-max_len=4096", str(tmp_path / "corpus")]
        os.makedirs(tmp_path / "corpus")
    else:
        gxx = shutil.which("g++")
        if gxx is None:
            pytest.skip("neither clang++ nor g++ is installed")
        cmd = [gxx, *flags, "-DPYCOMM_FUZZ_STANDALONE", "-fsanitize=address,undefined", HARNESS, *WIRE,
               "-o", binary]
        run = [binary, str(RUNS)]
    subprocess.run(cmd, check=True, timeout=300)
    proc = subprocess.run(run, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    done = re.search(r"Done (\d+) runs", output)
    assert done and int(done.group(1)) >= RUNS, output[-2000:]
    print(f"\nfuzz_wire: {done.group(0)} ({'libFuzzer' if clang else 'standalone'})")


def test_fuzz_sparse_decoder(tmp_path):
    """The sparse all-reduce's message decoder (tests/fuzz/fuzz_sparse.cc) on what
    a peer could send, under ASan/UBSan; every encoded message must decode back."""
    harness = os.path.join(ROOT, "tests", "fuzz", "fuzz_sparse.cc")
    source = os.path.join(ROOT, "csrc", "algorithms", "sparse_wire.cc")
    binary = str(tmp_path / "fuzz_sparse")
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    flags = ["-std=c++17", "-g", "-O1", "-I", os.path.join(ROOT, "csrc"), "-DPYCOMM_FUZZ_STANDALONE",
             "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    subprocess.run([gxx, *flags, harness, source, "-o", binary], check=True, timeout=300)
    runs = max(RUNS // 3, 1)  # each run decodes and round-trips a message: slower than fuzz_wire's
    proc = subprocess.run([binary, str(runs)], capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    done = re.search(r"Done (\d+) runs", output)
    assert done and int(done.group(1)) >= runs, output[-2000:]
    print(f"\nfuzz_sparse: {done.group(0)}")


def test_fuzz_coo_decoder(tmp_path):
    """The COO all-reduce's header check and row decoder (tests/fuzz/fuzz_coo.cc) on
    what a peer could send, under ASan/UBSan; every encoded payload must decode back."""
    harness = os.path.join(ROOT, "tests", "fuzz", "fuzz_coo.cc")
    source = os.path.join(ROOT, "csrc", "algorithms", "sparse_wire.cc")
    binary = str(tmp_path / "fuzz_coo")
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    flags = ["-std=c++17", "-g", "-O1", "-I", os.path.join(ROOT, "csrc"), "-DPYCOMM_FUZZ_STANDALONE",
             "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    subprocess.run([gxx, *flags, harness, source, "-o", binary], check=True, timeout=300)
    runs = max(RUNS // 3, 1)
    proc = subprocess.run([binary, str(runs)], capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    done = re.search(r"Done (\d+) runs", output)
    assert done and int(done.group(1)) >= runs, output[-2000:]
    print(f"\nfuzz_coo: {done.group(0)}")
