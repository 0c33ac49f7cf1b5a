"""`python -m experiments.stability`: the lab's sweep (experiments/stability/sweep.py)."""

import gc
import sys

from .sweep import main

status = main()
gc.freeze()  # the interpreter's last collection would walk JAX's whole object graph: 0.3 s of every exit
sys.exit(status)
