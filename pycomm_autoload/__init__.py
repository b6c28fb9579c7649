"""Registers the "pycomm" torch.distributed backend at ``import torch``, so
``dist.init_process_group("pycomm")`` works in a process that never imports pycomm
(a Ray worker, a launcher, a framework that creates the group itself).

torch calls every ``torch.backends`` entry point at the end of ``import torch``
(device-backend autoload; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns all of them off).
pycomm's (setup.py) is ``register`` below, kept outside the ``pycomm`` package because
importing a submodule of it would run the whole ``pycomm/__init__.py``. It loads only
the compiled core, ``pycomm._C`` (a few milliseconds: it checks the build loads against
this torch and says which devices the backend takes), and registers a creator that
imports the rest of pycomm when the first pycomm group is made.

torch turns an exception from an entry point into a failed ``import torch``: here any
failure (no build, a build against another torch) is a warning instead, and the
backend stays unregistered; ``import pycomm`` then raises the real error.
``PYCOMM_AUTOLOAD=0`` skips this hook alone.
"""
import os
import sys
import warnings

__all__ = ["register"]

BACKEND_NAME = "pycomm"


def register() -> None:
    """torch's entry point: registers the backend; never raises."""
    if os.environ.get("PYCOMM_AUTOLOAD", "1").strip() == "0":
        return
    try:
        _register()
    except Exception as err:
        warnings.warn(
            f'pycomm: the "{BACKEND_NAME}" torch.distributed backend was not registered at '
            f"import torch: {type(err).__name__}: {err}. Rebuild pycomm against this torch "
            f"(pip install --no-build-isolation -e <pycomm checkout>), or set PYCOMM_AUTOLOAD=0 "
            f"to skip this step.",
            RuntimeWarning,
            stacklevel=2,
        )


def _register() -> None:
    import torch.distributed as dist  # torch's own __init__ has imported it already

    if not dist.is_available() or BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    core = _load_core()
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                  devices=core._devices())


def _load_core():
    """pycomm._C, loaded on its own: the package it would be imported from, found
    as ``import pycomm`` would find it, is not run. ``import pycomm`` later takes this
    module from sys.modules (an extension module cannot be loaded twice)."""
    import importlib.machinery
    import importlib.util

    loaded = sys.modules.get("pycomm._C")
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("pycomm")
    if package is None or not package.submodule_search_locations:
        raise ImportError("the pycomm package is not importable from this interpreter")
    locations = list(package.submodule_search_locations)
    spec = importlib.machinery.PathFinder.find_spec("pycomm._C", locations)
    if spec is None:
        raise ImportError(f"pycomm._C is not built (no compiled module in {', '.join(locations)})")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pycomm._C"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["pycomm._C"]
        raise
    return module


def _create_backend(dist_opts, backend_options=None):
    # The first pycomm group of the process imports the rest of pycomm.
    from pycomm import _backend

    return _backend._create_backend(dist_opts, backend_options)
