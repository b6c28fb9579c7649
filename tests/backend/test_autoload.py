"""The "pycomm" backend without `import pycomm`: torch's device-backend autoload runs
pycomm's ``torch.backends`` entry point (setup.py, pycomm_autoload) at `import torch`.

Every check runs in fresh interpreters that never import pycomm themselves. The entry
point comes from the installed metadata (`make install` / `pip install -e .` writes
it); the module it names is this checkout's (PYTHONPATH below)."""
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest
from mp_util import communicate_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def _env(pythonpath=ROOT, **extra):
    env = dict(os.environ)
    env.pop("PYCOMM_AUTOLOAD", None)
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    env["PYTHONPATH"] = os.pathsep.join([pythonpath] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def _run_ranks(script, world, tmp_path, env=None, timeout_s=120):
    """Runs `script` in `world` fresh interpreters (RANK, WORLD_SIZE, RDZV set); kills
    them all at the deadline. Returns [(returncode, stdout, stderr)] by rank."""
    procs = []
    for rank in range(world):
        e = dict(env or _env(), RANK=str(rank), WORLD_SIZE=str(world), RDZV=f"file://{tmp_path}/rdzv")
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=e, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return communicate_all(procs, timeout_s)


def _entry_point_installed():
    out = subprocess.run(
        [sys.executable, "-c", "from importlib.metadata import entry_points as e;"
         "print([x.value for x in e(group='torch.backends', name='pycomm')])"],
        env=_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"), cwd="/", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture(scope="module", autouse=True)
def _installed():
    found = _entry_point_installed()
    assert found == "['pycomm_autoload:register']", (
        f"no torch.backends entry point for pycomm in the installed metadata ({found}): "
        f"install this checkout (make install, or pip install --no-build-isolation -e .)")


ALLREDUCE = """
    import os, sys, datetime
    import torch
    import torch.distributed as dist
    import pycomm_autoload
    assert os.path.dirname(pycomm_autoload.__file__).startswith(os.environ["PYCOMM_ROOT"]), pycomm_autoload.__file__
    # registered, and cheaply: the compiled core is loaded, the package has not run
    assert "PYCOMM" in dist.Backend._plugins
    assert "pycomm" not in sys.modules and "pycomm._C" in sys.modules, sorted(m for m in sys.modules if "pycomm" in m)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("pycomm", init_method=os.environ["RDZV"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    x = torch.arange(4, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x)
    import pycomm  # already imported by the first group; the same compiled core
    assert pycomm._C is sys.modules["pycomm._C"]
    print("BACKEND", type(backend).__name__, dist.get_backend())
    print("RESULT", x.tolist())
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("world", [1, 2])
def test_init_process_group_without_import_pycomm(tmp_path, world):
    results = _run_ranks(ALLREDUCE, world, tmp_path, env=_env(PYCOMM_ROOT=ROOT))
    factor = sum(range(1, world + 1))
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}: {err[-3000:]}"
        assert "BACKEND ProcessGroupPycomm pycomm" in out, out
        assert f"RESULT {[float(i * factor) for i in range(4)]}" in out, out
        assert "RuntimeWarning" not in err, err


STATE = """
    import sys, warnings
    warnings.simplefilter("always")
    import torch
    import torch.distributed as dist
    print("REGISTERED", "PYCOMM" in dist.Backend._plugins, "pycomm._C" in sys.modules)
    try:
        dist.init_process_group("pycomm", init_method="file://" + sys.argv[1] if len(sys.argv) > 1 else None,
                                rank=0, world_size=1)
    except Exception as e:
        print("INIT", type(e).__name__, e)
"""


def _state(env, tmp_path):
    # cwd: `python -c` puts the current folder first on the module path
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(STATE), f"{tmp_path}/rdzv"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"import torch failed:\n{out.stderr[-3000:]}"
    return out.stdout, out.stderr


def _package_copy(tmp_path, core):
    """A copy of this checkout's Python packages whose pycomm._C is `core` (bytes, or
    None for no compiled module)."""
    root = tmp_path / "pkg"
    for name in ("pycomm", "pycomm_autoload"):
        shutil.copytree(os.path.join(ROOT, name), root / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    if core is not None:
        (root / "pycomm" / f"_C{EXT_SUFFIX}").write_bytes(core)
    return str(root)


def _mismatched_core(tmp_path):
    """A loadable-looking extension that needs a torch symbol this torch lacks, as a
    build against another torch does: dlopen fails with "undefined symbol"."""
    src = tmp_path / "core.c"
    src.write_text("extern void _ZN3c1018pycomm_not_in_torchEv(void);\n"
                   "void *PyInit__C(void) { _ZN3c1018pycomm_not_in_torchEv(); return 0; }\n")
    lib = tmp_path / "core.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a mismatched pycomm._C")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=120)
    return lib.read_bytes()


@pytest.mark.parametrize("case", ["corrupt", "mismatched", "missing"])
def test_broken_build_is_a_warning_not_a_failed_import_torch(tmp_path, case):
    core = {"corrupt": lambda: b"\x7fELF not a shared object" * 64,
            "mismatched": lambda: _mismatched_core(tmp_path),
            "missing": lambda: None}[case]()
    out, err = _state(_env(pythonpath=_package_copy(tmp_path, core)), tmp_path)
    assert "REGISTERED False False" in out, (out, err)
    assert "RuntimeWarning" in err and 'the "pycomm" torch.distributed backend was not registered' in err, err
    expected = {"corrupt": "ImportError", "mismatched": "undefined symbol", "missing": "is not built"}[case]
    assert expected in err, err
    assert "INIT AssertionError Unknown backend type pycomm" in out, out  # torch's words


def test_autoload_off(tmp_path):
    """PYCOMM_AUTOLOAD=0 skips the hook (a broken build then says nothing at import
    torch); `import pycomm` still registers the backend."""
    out, err = _state(_env(pythonpath=_package_copy(tmp_path, b"corrupt"), PYCOMM_AUTOLOAD="0"), tmp_path)
    assert "REGISTERED False False" in out and "RuntimeWarning" not in err, (out, err)
    out, err = _state(_env(PYCOMM_AUTOLOAD="0"), tmp_path)
    assert "REGISTERED False False" in out, (out, err)
    run = subprocess.run([sys.executable, "-c", "import torch.distributed as dist, pycomm;"
                          "print('PYCOMM' in dist.Backend._plugins)"],
                         env=_env(PYCOMM_AUTOLOAD="0"), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr
