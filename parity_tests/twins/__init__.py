"""Twin against twin: flax_blocks against torch_blocks (and stock torch, and a numpy reference)
on the option matrix: outputs, gradients, trajectories, the wrong twins that fail each
tolerance, and the report that writes docs/parity.md's table."""
