"""The transport's cryptography comes from OpenSSL's libcrypto, not from code of
our own (issue #40, finding 5): pycomm._C links libcrypto, and csrc/transport/hmac.cc
holds no SHA-256 compression rounds (its round constants, FIPS 180-4 4.2.2)."""
import os
import shutil
import subprocess

import pytest

import pycomm._C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_extension_links_libcrypto():
    ldd = shutil.which("ldd")
    if ldd is None:
        pytest.skip("no ldd")
    out = subprocess.run([ldd, pycomm._C.__file__], capture_output=True, text=True, check=True).stdout
    assert "libcrypto" in out, out


def test_no_hand_written_sha256():
    with open(os.path.join(ROOT, "csrc", "transport", "hmac.cc")) as f:
        text = f.read().lower()
    # The first and last of SHA-256's 64 round constants, and its initial hash value.
    for constant in ("0x428a2f98", "0xc67178f2", "0x6a09e667"):
        assert constant not in text
