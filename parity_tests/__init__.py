"""Parity between flax_blocks and torch_blocks: outputs, gradients and training trajectories.

`parity_tests.twins.harness` holds the machinery (also used by `python -m parity_tests.check`
and `python -m parity_tests.twins.report`); the `test_*.py` files are the pytest suite.
"""
