"""``python -m pycomm.train`` is ``pycomm-train``."""
import sys

from .cli import main

__all__: list = []

sys.exit(main())
