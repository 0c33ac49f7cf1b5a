"""Hugging Face checkpoints in and out of the torch twin, without JAX.

    model = tb.from_hf("my-llama", part="causal-lm")   # a folder, a Hub id or a transformers model
    tb.load_report(model)                              # what the load read and ignored
    tb.to_hf(model)                                    # {HF name: numpy array}
    tb.save_hf(model, "out")                           # a folder from_pretrained reads

The source is read once by the framework-free reading both twins share
(`flax_blocks.checkpoints.checkpoint.read_checkpoint`: config, family, every refusal, the
tensors in transformers' file order, named as the twins name them); only the placing is the
torch twin's own: the module is built on the meta device (no random initialisation) and each
tensor is read from the file, cast and assigned once. The refusals are the Flax twin's, word for
word, since they come from the same reading.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch
from torch import nn

from flax_blocks.checkpoints.checkpoint import Checkpoint, check_shapes, load_report, mark, read_checkpoint
from flax_blocks.checkpoints.hf import to_hf
from flax_blocks.checkpoints.save_hf import save_hf
from flax_blocks.checkpoints.stream import to_numpy

from . import stacks
from .layers import DTYPES
from .lm import LanguageModel

__all__ = ["from_hf", "place", "to_hf", "save_hf", "load_report"]


def from_hf(source: Any, *, part: str = "stack", dtype: Any = None, ignore_keys: tuple[str, ...] = (),
            revision: str | None = None) -> nn.Module:
    """The torch twin of `fb.from_hf`: a Hugging Face model (a save_pretrained folder, a Hub
    id at `revision`, or a transformers model object) as a `tb.Encoder` (part="stack", the
    default; "encoder" / "decoder" of Whisper: a `tb.Decoder` for its decoder) or a whole
    `tb.LanguageModel` (part="model": token ids -> last hidden state; "causal-lm": -> logits).
    dtype: the parameters' dtype ("float32", "bfloat16", torch.float64, ...; None keeps the
    checkpoint's); ignore_keys: config keys read as absent. Returns the model in eval mode,
    as from_pretrained does, marked with its load report (`tb.load_report(model)`). A source
    the blocks cannot compute, or a tensor missing, unexpected or of another shape, raises
    `ConversionError` before any tensor is read."""
    ckpt = read_checkpoint(source, part=part, dtype=_dtype_name(dtype), ignore_keys=ignore_keys, revision=revision)
    return place(ckpt)


def _dtype_name(dtype: Any) -> Any:
    """torch.float64 -> "float64" (the reading takes names and numpy / JAX dtypes)."""
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


def _build(ckpt: Checkpoint) -> nn.Module:
    if ckpt.lm is not None:
        return LanguageModel(ckpt.cfg, ckpt.lm)
    return getattr(stacks, ckpt.stack)(ckpt.cfg, num_layers=ckpt.num_layers, final_norm=ckpt.final_norm)


def _tensor(value: Any, dtype: str) -> torch.Tensor:
    """A checkpoint's tensor (stream.Lazy or array) read once and cast to `dtype`, as a torch
    tensor that owns its memory."""
    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    a = np.ascontiguousarray(to_numpy(value.read() if hasattr(value, "read") else value).astype(target, copy=False))
    if not a.flags.writeable or not a.flags.owndata:
        a = a.copy()
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def place(ckpt: Checkpoint) -> nn.Module:
    """A torch model holding a read Checkpoint's tensors: built on the meta device, its
    names and shapes checked against the checkpoint's (one ConversionError naming every
    difference, nothing read), then each tensor read, cast to cfg.param_dtype and assigned."""
    with torch.device("meta"):
        model = _build(ckpt)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_shapes(ckpt, expected)
    dtype = ckpt.cfg.param_dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    model.load_state_dict({k: _tensor(ckpt.tensors[k], dtype) for k in expected}, strict=True, assign=True)
    return mark(model.eval(), ckpt)
