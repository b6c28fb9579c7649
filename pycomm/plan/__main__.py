import sys

from .calibration import main

if __name__ == "__main__":
    sys.exit(main())
