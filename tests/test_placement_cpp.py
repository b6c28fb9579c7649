"""Blocks a peer sends early land in a receive already posted, not in the TCP
transport's unexpected-message buffer (tests/cpp/placement_test.cc): the sharded
all-reduce on 2 TCP ranks as threads, one rank's sends held back."""
import os

import cpp_build


def test_sharded_reduced_block_lands_in_place():
    cpp_build.run_test_program(os.path.join(cpp_build.ROOT, "tests", "cpp", "placement_test.cc"))
