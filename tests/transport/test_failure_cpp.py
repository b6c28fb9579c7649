"""A failed collective leaves nothing posted into memory it frees
(tests/cpp/failure_test.cc): every collective on 3 TCP ranks as threads, one
rank absent, the others time out, and no request of theirs is still pending."""
import os

import cpp_build


def test_failed_collectives_leave_nothing_pending():
    cpp_build.run_test_program(os.path.join(cpp_build.ROOT, "tests", "cpp", "failure_test.cc"))
