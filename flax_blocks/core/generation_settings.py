"""The old home of the generation settings: now `flax_blocks.core.lm_config` (the language
model's config holds them). These names keep working from here; nothing in the library
imports this module."""

from .lm_config import HF_TOP_K, GenerationSettings, Resolved, resolve  # noqa: F401
