"""Receives from any source once every peer is lost fail at once, naming a lost peer,
instead of waiting for the caller's timeout (tests/cpp/any_source_test.cc; found by
`make fuzz`, tests/fuzz/fuzz_frames.cc)."""
import os

import cpp_build


def test_any_source_receives_after_peers_are_lost():
    cpp_build.run_test_program(os.path.join(cpp_build.ROOT, "tests", "cpp", "any_source_test.cc"), timeout=120)
