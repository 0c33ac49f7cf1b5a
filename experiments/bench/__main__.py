"""`python -m experiments.bench`: the twins' speed, side by side (experiments/bench/blocks.py)."""

from .blocks import main

main()
