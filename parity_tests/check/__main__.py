"""`python -m parity_tests.check CHECKPOINT ...`: the check itself is `parity_tests.check.main`."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
