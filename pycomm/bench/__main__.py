"""``python -m pycomm.bench``."""
import sys

from .cli import main

sys.exit(main())
