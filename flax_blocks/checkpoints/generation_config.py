"""The old home of a checkpoint's generation settings: now `flax_blocks.checkpoints.checkpoint`,
which a load reads in one module (`write_generation_config`: `flax_blocks.checkpoints.save_hf`).
These names keep working from here; nothing in the library imports this module."""

from .checkpoint import (  # noqa: F401
    GENERATION_CONFIG,
    model_generation_config,
    read_generation_config,
)
from .save_hf import write_generation_config  # noqa: F401
