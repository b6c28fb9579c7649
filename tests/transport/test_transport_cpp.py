"""The TCP transport's own tests (tests/cpp/transport_test.cc), built with the
system C++ compiler against the torch-free layers only (tests/cpp_build.py)."""
import os

import cpp_build


def test_tcp_transport():
    cpp_build.run_test_program(os.path.join(cpp_build.ROOT, "tests", "cpp", "transport_test.cc"))
