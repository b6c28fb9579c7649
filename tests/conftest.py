"""Shared pytest configuration.

Markers (registered in pyproject.toml):
  slow  end-to-end tests; CI runs them, `make test-fast` skips them.
  gpu   needs a CUDA device; skipped cleanly where torch sees none.
"""
import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _dev_shm_leftovers():
    """pycomm segments in /dev/shm whose creating process is gone (names are
    pycomm-<pid namespace inode>-<pid>-<hex>; only this PID namespace's are judged)."""
    import os

    found = []
    if not os.path.isdir("/dev/shm"):
        return found
    own_ns = str(os.stat("/proc/self/ns/pid").st_ino)
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if parts[0] != "pycomm" or len(parts) != 4 or parts[1] != own_ns:
            continue
        try:
            os.kill(int(parts[2]), 0)
        except (ProcessLookupError, ValueError):
            found.append(name)
    return found


def pytest_sessionfinish(session, exitstatus):
    """/dev/shm must be clean after the suite: pycomm unlinks its segments as soon as
    every local rank mapped them, so none may outlive its creator."""
    left = _dev_shm_leftovers()
    if left:
        print(f"\npycomm segments left in /dev/shm by exited processes: {left}")
        session.exitstatus = 1
