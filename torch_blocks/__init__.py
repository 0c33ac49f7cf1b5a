"""Residual transformer blocks for PyTorch, twins of `flax_blocks`, named like torch's own layers."""

from flax_blocks.config import BlockConfig, invert_mask

from .attention import Attention, build_mask
from .blocks import Encoder, FeedForward, ResidualMHA, TransformerBlock
from .convert import to_tensor, to_tensors

__all__ = ["BlockConfig", "invert_mask", "Attention", "ResidualMHA", "FeedForward", "TransformerBlock", "Encoder",
           "build_mask", "to_tensor", "to_tensors"]
