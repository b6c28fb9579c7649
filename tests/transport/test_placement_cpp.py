"""Blocks a peer sends early land in a receive already posted, not in the TCP
transport's unexpected-message buffer (tests/cpp/placement_test.cc): the sharded
all-reduce on 2-4 TCP ranks as threads, one rank's sends held back; and the tree
reduce on 4 and 5 ranks with every parent late, where a child may run only a window
of segments ahead of its parent's receives; and the ring all-reduce on 2-4 ranks
(and the ring all-gather with uneven chunks, one empty) started one after another,
where a rank sends a large step only on its receiver's credit."""
import os

import cpp_build


def test_early_blocks_land_in_place():
    cpp_build.run_test_program(os.path.join(cpp_build.ROOT, "tests", "cpp", "placement_test.cc"))
