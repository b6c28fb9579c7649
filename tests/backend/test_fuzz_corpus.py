"""The committed seed and regression inputs of the libFuzzer targets that drive whole
layers (tests/fuzz/corpus/fuzz_frames: a real TcpTransport fed by a scripted peer;
fuzz_coo_allreduce: the COO all-reduce fed by scripted peers), replayed in the test
suite without clang: each harness built with g++ (tests/cpp_build.py, so sanitized
under make test-asan too) with a main that runs every corpus file once. An input that
breaks one of the harness's invariants aborts the program and fails the test; among
them any_source_after_peer_left, the input `make fuzz` found (a receive from any
source that waited for its timeout after the only peer left)."""
import glob
import os
import subprocess

import pytest

import cpp_build

FUZZ = os.path.join(cpp_build.ROOT, "tests", "fuzz")

REPLAY_MAIN = r'''
#include <fstream>
#include <iterator>
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::ifstream file(argv[i], std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    std::printf("ok   %s\n", argv[i]);
  }
  std::printf("replayed %d inputs\n", argc - 1);
  return 0;
}
'''


@pytest.mark.parametrize("target", ["fuzz_frames", "fuzz_coo_allreduce"])
def test_replay_corpus(target, tmp_path):
    inputs = sorted(glob.glob(os.path.join(FUZZ, "corpus", target, "*")))
    assert inputs, f"no corpus for {target}"
    # The harness (with the header it shares with the other targets) and the main in one
    # source, so the build cache keys on all of their text.
    with open(os.path.join(FUZZ, f"{target}.cc")) as f, open(os.path.join(FUZZ, "fuzz_input.h")) as h:
        source = f.read().replace('#include "fuzz_input.h"\n', h.read()) + REPLAY_MAIN
    main = tmp_path / f"replay_{target}.cc"
    main.write_text(source)
    proc = subprocess.run([cpp_build.binary(str(main)), *inputs], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"replayed {len(inputs)} inputs" in proc.stdout, proc.stdout + proc.stderr
