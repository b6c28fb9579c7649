"""SHA-256 and HMAC-SHA256 of the connection handshake (csrc/transport/hmac.h)
against the NIST and RFC 4231 test vectors (tests/cpp/hmac_test.cc)."""
import os

import cpp_build


def test_sha256_and_hmac_vectors():
    cpp_build.run_test_program(os.path.join(cpp_build.ROOT, "tests", "cpp", "hmac_test.cc"))
