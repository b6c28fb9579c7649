"""A group's bootstrap without torch (tests/cpp/bootstrap_test.cc): TCP mesh,
host keys, the shared-memory vote and the arena, ranks as threads over
memory_store.h."""
import os

import cpp_build


def test_bootstrap():
    cpp_build.run_test_program(os.path.join(cpp_build.ROOT, "tests", "cpp", "bootstrap_test.cc"))
