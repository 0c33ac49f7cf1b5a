"""The old home of whole models: their reading (`lm_config`, `read_whole`) is now
`flax_blocks.checkpoints.checkpoint`'s, their writing (`to_hf_model`, `twin_state_dict`,
`causal_lm_class`) `flax_blocks.checkpoints.hf`'s. These names keep working from here;
nothing in the library imports this module."""

from .checkpoint import lm_config, read_whole  # noqa: F401
from .hf import causal_lm_class, to_hf_model, twin_state_dict  # noqa: F401
