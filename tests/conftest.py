"""Shared pytest configuration.

Markers (registered in pyproject.toml):
  slow  end-to-end tests; CI runs them, `make test-fast` skips them.
  gpu   needs a CUDA device; skipped cleanly where torch sees none.

Sanitizer runs (`make test-asan`): PYCOMM_SANITIZER_LOGS names the folder where
ASan/UBSan write their reports (ASAN_OPTIONS/UBSAN_OPTIONS log_path), from any
process: pytest, spawned ranks, C++ test programs. A test during which a report
appears fails with it, even when the process that wrote it had already
reported its result (a report at interpreter exit, a rank whose exit code no
harness looks at).

PYCOMM_COST_MODEL defaults to "default" here (below).
"""
import os

import pytest
import torch

SANITIZER_LOGS = os.environ.get("PYCOMM_SANITIZER_LOGS")

# tests/integrations run the frameworks users launch from (Accelerate, Lightning, Ray,
# ...), which the main environment does not have: `make test-integrations` installs them
# in a venv of its own and sets PYCOMM_INTEGRATIONS=1.
collect_ignore = [] if os.environ.get("PYCOMM_INTEGRATIONS") == "1" else ["integrations"]

# The built-in cost-model constants, whatever this host has cached (python -m
# pycomm.plan --calibrate): tests that check auto's choices expect them. Tests of the
# cache pass their own environment (test_plan.py).
os.environ.setdefault("PYCOMM_COST_MODEL", "default")


def _sanitizer_reports():
    if not SANITIZER_LOGS or not os.path.isdir(SANITIZER_LOGS):
        return set()
    return set(os.listdir(SANITIZER_LOGS))


# Reports already charged to a test (or there before the session). Compared after
# each test, not before it: module-scoped fixtures run their processes before a
# function-scoped fixture could take a snapshot.
_seen_reports = _sanitizer_reports()


@pytest.fixture(autouse=True)
def _no_sanitizer_report():
    yield
    if not SANITIZER_LOGS:
        return
    new = sorted(_sanitizer_reports() - _seen_reports)
    _seen_reports.update(new)
    if new:
        texts = []
        for name in new:
            with open(os.path.join(SANITIZER_LOGS, name), errors="replace") as f:
                texts.append(f"--- {name}:\n{f.read()[:6000]}")
        pytest.fail(f"sanitizer report(s) in {SANITIZER_LOGS}:\n" + "\n".join(texts), pytrace=False)


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
    late = sorted(_sanitizer_reports() - _seen_reports)
    if late:
        print(f"\nsanitizer report(s) written after the last test in {SANITIZER_LOGS}: {late}")
        session.exitstatus = 1
    left = _dev_shm_leftovers()
    if left:
        print(f"\npycomm segments left in /dev/shm by exited processes: {left}")
        session.exitstatus = 1
