"""Residual transformer blocks for Flax NNX, twins of `torch_blocks`.

`from flax_blocks import BlockConfig` imports no framework; the blocks load JAX and
Flax on first use (so `torch_blocks` can share the config without importing JAX).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from .core.config import BlockConfig, FullyMaskedWarning, invert_mask

try:
    __version__ = version("twin-blocks")  # pyproject.toml's, as installed
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

_LAZY = {
    "ResidualMHA": "blocks",
    "FeedForward": "blocks",
    "TransformerBlock": "blocks",
    "Encoder": "stacks",
    "DecoderBlock": "blocks",
    "Decoder": "stacks",
    "Transformer": "stacks",
    "Attention": "attention",
    "build_mask": "attention",
    "from_torch": "checkpoints.convert",
    "load_torch_state_dict": "checkpoints.convert",
    "torch_state_dict": "checkpoints.convert",
    "flax_state_dict": "checkpoints.convert",
    "load_flax_state_dict": "checkpoints.convert",
    "infer_config": "checkpoints.convert",
    "ConversionError": "checkpoints.convert",
    "detect_dialect": "checkpoints.dialects",
    "from_hf": "checkpoints.hf",
    "to_hf": "checkpoints.hf",
    "load_report": "checkpoints.checkpoint",
    "save_hf": "checkpoints.save_hf",
    "RopeScaling": "core.rope",
    "LanguageModel": "lm",
    "LMConfig": "core.lm_config",
    "generate": "generation",
}

# Written out (each lazy name also in _LAZY and below), so that static tools read it.
__all__ = [
    "__version__", "BlockConfig", "FullyMaskedWarning", "invert_mask",
    "ResidualMHA", "FeedForward", "TransformerBlock", "Encoder", "DecoderBlock", "Decoder", "Transformer",
    "Attention", "build_mask",
    "from_torch", "load_torch_state_dict", "torch_state_dict", "flax_state_dict", "load_flax_state_dict",
    "infer_config", "ConversionError",
    "detect_dialect", "from_hf", "to_hf", "save_hf", "load_report", "RopeScaling", "LanguageModel", "LMConfig",
    "generate",
]

if TYPE_CHECKING:  # the lazy names, for type checkers and IDEs (at run time: imported on first use, above)
    from .attention import Attention, build_mask
    from .blocks import DecoderBlock, FeedForward, ResidualMHA, TransformerBlock
    from .checkpoints.checkpoint import load_report
    from .checkpoints.convert import (
        ConversionError,
        flax_state_dict,
        from_torch,
        infer_config,
        load_flax_state_dict,
        load_torch_state_dict,
        torch_state_dict,
    )
    from .checkpoints.dialects import detect_dialect
    from .checkpoints.hf import from_hf, to_hf
    from .checkpoints.save_hf import save_hf
    from .core.lm_config import LMConfig
    from .core.rope import RopeScaling
    from .generation import generate
    from .lm import LanguageModel
    from .stacks import Decoder, Encoder, Transformer


def __getattr__(name: str) -> Any:
    """A lazy name's object, imported on first use and kept in the module's globals, so that
    later uses find it there without calling this again."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flax_blocks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
