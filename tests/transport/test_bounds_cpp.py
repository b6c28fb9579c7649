"""Overflow-checked sums of peers' sizes and the COO scratch layout built on them
(tests/cpp/bounds_test.cc; issue #40, finding 3)."""
import os

import cpp_build


def test_checked_sums_and_coo_layout():
    cpp_build.run_test_program(os.path.join(cpp_build.ROOT, "tests", "cpp", "bounds_test.cc"))
