"""Residual transformer blocks for PyTorch, twins of `flax_blocks`, named like torch's own layers."""

from flax_blocks import __version__
from flax_blocks.core.config import BlockConfig, invert_mask

from .attention import Attention, build_mask
from .blocks import DecoderBlock, FeedForward, ResidualMHA, TransformerBlock
from .convert import to_tensor, to_tensors
from .hf import from_hf, load_report, save_hf, to_hf
from .lm import LanguageModel, generate
from .stacks import Decoder, Encoder, Transformer

__all__ = ["__version__", "BlockConfig", "invert_mask", "Attention", "ResidualMHA", "FeedForward", "TransformerBlock",
           "Encoder", "DecoderBlock", "Decoder", "Transformer",
           "build_mask", "to_tensor", "to_tensors", "LanguageModel", "generate",
           "from_hf", "to_hf", "save_hf", "load_report"]
