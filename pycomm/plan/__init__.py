"""The all-reduce cost model (pycomm/plan/calibration.py holds it while the package is split)."""
from .calibration import *  # noqa: F401,F403
from .calibration import __all__  # noqa: F401
