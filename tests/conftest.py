"""Shared pytest configuration.

Markers (registered in pyproject.toml):
  slow    end-to-end tests; CI runs them, `make test-fast` skips them.
  serial  run after the others, alone (not on xdist's parallel workers): SERIAL_* below.
  gpu     needs a CUDA device; skipped cleanly where torch sees none.

Sanitizer runs (`make test-asan`): PYCOMM_SANITIZER_LOGS names the folder where
ASan/UBSan write their reports (ASAN_OPTIONS/UBSAN_OPTIONS log_path), from any
process: pytest, spawned ranks, C++ test programs. A test during which a report
appears fails with it, even when the process that wrote it had already
reported its result (a report at interpreter exit, a rank whose exit code no
harness looks at).

PYCOMM_COST_MODEL defaults to "default" here (below).
"""
import os
import sys

import pytest
import torch

# Test modules share helpers across the layer folders (`from test_hooks import _Bucket`):
# every folder goes on the path, whichever of them a run collects. Basenames are unique
# (tests/test_suite_marks.py), so a name means one file.
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _name in sorted(os.listdir(_TESTS)):
    _folder = os.path.join(_TESTS, _name)
    if os.path.isdir(_folder) and _name not in ("cpp", "fuzz", "integrations") and not _name.startswith((".", "_")):
        if _folder not in sys.path:
            sys.path.append(_folder)

SANITIZER_LOGS = os.environ.get("PYCOMM_SANITIZER_LOGS")
# Under pytest-xdist each worker sends the reports of the processes it starts to a folder
# of its own (the log_path of ASAN_OPTIONS/UBSAN_OPTIONS, which those processes inherit),
# so that a report fails the test that made it, not whichever worker looked first. The
# worker's own python keeps the path it started with: reports in the shared folder are
# judged by every worker.
_SHARED_SANITIZER_LOGS = SANITIZER_LOGS
if SANITIZER_LOGS and os.environ.get("PYTEST_XDIST_WORKER") and \
        os.path.basename(SANITIZER_LOGS) != os.environ["PYTEST_XDIST_WORKER"]:  # not twice (a child pytest)
    SANITIZER_LOGS = os.path.join(_SHARED_SANITIZER_LOGS, os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(SANITIZER_LOGS, exist_ok=True)
    os.environ["PYCOMM_SANITIZER_LOGS"] = SANITIZER_LOGS
    for _var in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):
        os.environ[_var] = ":".join(
            f"log_path={os.path.join(SANITIZER_LOGS, os.path.basename(o.partition('=')[2]))}"
            if o.startswith("log_path=") else o for o in os.environ.get(_var, "").split(":"))

# tests/integrations run the frameworks users launch from (Accelerate, Lightning, Ray,
# ...), which the main environment does not have: `make test-integrations` installs them
# in a venv of its own and sets PYCOMM_INTEGRATIONS=1.
collect_ignore = [] if os.environ.get("PYCOMM_INTEGRATIONS") == "1" else ["integrations"]

# The built-in cost-model constants, whatever this host has cached (python -m
# pycomm.plan --calibrate): tests that check auto's choices expect them. Tests of the
# cache pass their own environment (test_plan.py).
os.environ.setdefault("PYCOMM_COST_MODEL", "default")


def _sanitizer_reports():
    """Report files (paths) in this process's folder and, under xdist, the shared one."""
    found = set()
    for folder in {SANITIZER_LOGS, _SHARED_SANITIZER_LOGS} - {None}:
        if os.path.isdir(folder):
            found.update(os.path.join(folder, name) for name in os.listdir(folder)
                         if os.path.isfile(os.path.join(folder, name)))
    return found


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
        for path in new:
            with open(path, errors="replace") as f:
                texts.append(f"--- {path}:\n{f.read()[:6000]}")
        pytest.fail(f"sanitizer report(s) in {SANITIZER_LOGS}:\n" + "\n".join(texts), pytrace=False)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


# The end-to-end tests `make test-fast` leaves out (`-m "not slow"`); `make test` and CI run
# them all. Whole modules whose every test starts ranks across namespaces, kills them,
# builds C++ or runs a command-line tool end to end, and single tests of that kind from
# the other modules ("module::function", every parameter). Chosen from the suite's
# --durations; a test marked @pytest.mark.slow in its file counts too.
SLOW_MODULES = frozenset({
    "test_failures", "test_multihost", "test_cuda_build", "test_hooks_unused", "test_hooks_checkpoint",
    "test_engines", "test_ddp_sparse", "test_lowrank", "test_bench_hosts", "test_compression_benchmark",
    "test_mp_util", "test_fuzz", "test_soak", "test_chaos", "test_restart", "test_train_cli", "test_launch",
    "test_large", "test_placement_cpp", "test_failure_cpp", "test_streams", "test_observability",
    "test_torch_hooks", "test_dtype_parity", "test_hooks_schedule", "test_hooks_hosts", "test_ddp",
    "test_make_install",
})
SLOW_TESTS = frozenset({
    "test_plan::test_calibrate_and_cache", "test_plan::test_validate_across_namespaces",
    "test_plan::test_cli_predicts_without_a_calibration",
    "test_bench::test_cli_usage_error_through_python_m", "test_bench::test_demo", "test_bench::test_call_cost_script_reports_every_rank",
    "test_bench::test_cli_tcp_reference_line", "test_bench::test_latency_floor_script_prints_each_kind",
    "test_bench::test_call_cost_threads_names_pycomm_threads", "test_bench::test_cli_pycomm_vs_gloo",
    "test_bench::test_cli_harness_on_gloo", "test_bench::test_cli_compressed_columns",
    "test_bench::test_cli_auto_int32_max", "test_bench::test_cli_tcp_reference_uses_the_groups_streams",
    "test_hooks::test_hooks_on_gloo", "test_kernels::test_cuda_kernels_compile_with_nvcc",
    "test_kernels::test_cpu_kernels_build_without_torch", "test_train_async::test_cli_runs_both",
    "test_sparse_allreduce::test_sparse_shape_mismatch_fails_naming_ranks", "test_shm::test_arena_that_cannot_be_made",
    "test_launch_local::test_a_changed_load_time_variable_spawns_the_ranks",
    "test_launch_local::test_without_a_fork_server_ranks_are_spawned",
})


# `make test` runs the suite on pytest-xdist workers (PYTEST_WORKERS in the Makefile) (`-m "not serial"`), then these
# alone (`-m serial`): tests that count what the scheduler or the clock did (where ranks
# ran, whether a wait slept, measured against modelled times) and the check that
# /dev/shm holds no segment, which another worker's run may hold for a moment.
SERIAL_MODULES = frozenset({"test_shm_neighbour_load"})
SERIAL_TESTS = frozenset({
    "test_plan::test_validate_across_namespaces", "test_shm::test_waiting_ranks_sleep_when_oversubscribed",
    "test_shm::test_crowded_ranks_spread_over_their_cpus", "test_shm::test_no_segment_left_in_dev_shm",
})

# The modules that take longest (per-file sums of `--durations=0`, tools/suite_durations.py),
# longest first: collected first, so xdist's workers start on them and the short modules
# fill in at the end (`--dist loadfile --no-loadscope-reorder`). Order only; the rest keep
# their collection order.
LONGEST_FIRST = (
    "test_collectives", "test_bench", "test_multihost", "test_failures", "test_plan", "test_hooks",
    "test_train_async", "test_fuzz", "test_train_cli", "test_bench_hosts", "test_restart", "test_autoload",
    "test_compression_benchmark", "test_soak", "test_chaos", "test_observability", "test_make_install",
    "test_launch", "test_train", "test_transport_cpp", "test_cuda_build", "test_mp_pool",
)


def _module_name(item) -> str:
    return item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""


def _is_slow(item) -> bool:
    module = _module_name(item)
    return module in SLOW_MODULES or f"{module}::{item.originalname}" in SLOW_TESTS


def _is_serial(item) -> bool:
    module = _module_name(item)
    return module in SERIAL_MODULES or f"{module}::{item.originalname}" in SERIAL_TESTS


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module_name(item), len(rank)))  # stable: a module stays whole
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
        if _is_serial(item):
            item.add_marker(pytest.mark.serial)
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


def _xdist_worker(config) -> bool:
    """This process is one of pytest-xdist's workers (`make test` runs the suite on several)."""
    return hasattr(config, "workerinput")


def pytest_sessionfinish(session, exitstatus):
    """/dev/shm must be clean after the suite: pycomm unlinks its segments as soon as
    every local rank mapped them, so none may outlive its creator. Under pytest-xdist
    each worker closes its own pool and reports its counts; the controller judges
    /dev/shm once every worker is gone (while one runs, another's rank may have left a
    segment its peers have yet to map and unlink)."""
    if "mp_util" in sys.modules:
        sys.modules["mp_util"].close_pool()  # its ranks' segments are judged once they are gone
    late = sorted(_sanitizer_reports() - _seen_reports)
    if late:
        print(f"\nsanitizer report(s) written after the last test in {SANITIZER_LOGS}: {late}")
        session.exitstatus = 1
    if _xdist_worker(session.config):
        if "mp_util" in sys.modules:
            session.config.workeroutput["pool_stats"] = sys.modules["mp_util"].POOL_STATS
        return
    left = _dev_shm_leftovers()
    if left:
        print(f"\npycomm segments left in /dev/shm by exited processes: {left}")
        session.exitstatus = 1


# Pool counts the xdist workers reported as they finished (pytest_testnodedown).
_WORKER_POOL_STATS = []


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist runs too
def pytest_testnodedown(node, error):
    stats = getattr(node, "workeroutput", {}).get("pool_stats")
    if stats:
        _WORKER_POOL_STATS.append(stats)


def pytest_terminal_summary(terminalreporter):
    """How the multi-process runs used tests/mp_util.py's pool of ranks (when any did),
    summed over the xdist workers."""
    mp_util = sys.modules.get("mp_util")
    stats = {"runs": 0, "reused": 0, "retired": {}}
    for part in _WORKER_POOL_STATS + ([mp_util.POOL_STATS] if mp_util else []):
        stats["runs"] += part["runs"]
        stats["reused"] += part["reused"]
        for why, count in part["retired"].items():
            stats["retired"][why] = stats["retired"].get(why, 0) + count
    if not stats["runs"]:
        return
    terminalreporter.write_line(f"mp_util pool: {stats['runs']} runs on pooled ranks, {stats['reused']} of them on "
                                f"ranks that had run one before; sets ended after a run: {stats['retired']}")
