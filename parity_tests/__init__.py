"""Parity between flax_blocks and torch_blocks: outputs, gradients and training trajectories.

`parity_tests.harness` holds the machinery (also used by `python -m parity_tests.check`
and `python -m parity_tests.report`); the `test_*.py` files are the pytest suite.
"""
