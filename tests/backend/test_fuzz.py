"""Fuzz targets (tests/fuzz/*.cc): the TCP wire parsing and handshake checks
(fuzz_wire.cc), the all-to-all split-size check (fuzz_alltoall_splits.cc) and
the sparse all-reduce's message decoder (fuzz_sparse.cc). libFuzzer with ASan/UBSan
when clang is installed, else a seeded random-mutation driver built with g++ and
the same sanitizers; a sanitizer report (UBSan included: no recovery) fails the
test. The number of executions is printed (run pytest with -s to see it)."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = int(os.environ.get("PYCOMM_FUZZ_RUNS", "300000"))


def _fuzz(tmp_path, harness, sources, max_len, runs=RUNS):
    name = os.path.splitext(os.path.basename(harness))[0]
    binary = str(tmp_path / name)
    clang = shutil.which("clang++")
    flags = ["-std=c++17", "-g", "-O1", "-I", os.path.join(ROOT, "csrc"), "-fno-sanitize-recover=all"]
    harness = os.path.join(ROOT, "tests", "fuzz", harness)
    sources = [os.path.join(ROOT, "csrc", s) for s in sources]
    if clang:
        cmd = [clang, *flags, "-fsanitize=fuzzer,address,undefined", harness, *sources, "-lcrypto", "-o", binary]
        run = [binary, f"-runs={runs}", f"-max_len={max_len}", str(tmp_path / "corpus")]
        os.makedirs(tmp_path / "corpus")
    else:
        gxx = shutil.which("g++")
        if gxx is None:
            pytest.skip("neither clang++ nor g++ is installed")
        cmd = [gxx, *flags, "-DPYCOMM_FUZZ_STANDALONE", "-fsanitize=address,undefined", harness, *sources,
               "-lcrypto", "-o", binary]
        run = [binary, str(runs)]
    # The binary links its own sanitizer runtime: the one `make test-asan` preloads for
    # python (g++'s libasan) must not be loaded into it as well (clang's and gcc's clash).
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run(cmd, check=True, timeout=300, env=env)
    proc = subprocess.run(run, capture_output=True, text=True, timeout=600, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "runtime error" not in output, output[-4000:]
    done = re.search(r"Done (\d+) runs", output)
    assert done and int(done.group(1)) >= runs, output[-2000:]
    print(f"\n{name}: {done.group(0)} ({'libFuzzer' if clang else 'standalone'})")


def test_fuzz_wire_parser(tmp_path):
    _fuzz(tmp_path, "fuzz_wire.cc", [os.path.join("transport", name) for name in ("wire.cc", "hmac.cc")],
          max_len=4096)


def test_fuzz_alltoall_splits(tmp_path):
    _fuzz(tmp_path, "fuzz_alltoall_splits.cc", [os.path.join("algorithms", "alltoall_splits.cc")], max_len=256)


def test_fuzz_sparse_decoder(tmp_path):
    # Each run decodes and round-trips a message: slower than the others' runs.
    _fuzz(tmp_path, "fuzz_sparse.cc", [os.path.join("algorithms", "sparse_wire.cc")], max_len=1024,
          runs=max(RUNS // 3, 1))


def test_fuzz_coo_decoder(tmp_path):
    # The COO all-reduce's header check and row decoder; every encoded payload decodes back.
    _fuzz(tmp_path, "fuzz_coo.cc", [os.path.join("algorithms", "sparse_wire.cc")], max_len=1024,
          runs=max(RUNS // 3, 1))
