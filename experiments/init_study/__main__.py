"""`python -m experiments.init_study`: the initialisation study (experiments/init_study/study.py)."""

import sys

from .study import main

sys.exit(main())
