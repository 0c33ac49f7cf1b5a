"""numpy state dicts (from flax_blocks.torch_state_dict) -> torch tensors, bfloat16 included."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def to_tensor(a: np.ndarray) -> torch.Tensor:
    """numpy array (ml_dtypes.bfloat16 too) -> a torch tensor that owns a copy of the data."""
    if str(a.dtype) == "bfloat16":
        return torch.from_numpy(np.array(a, order="C").view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))


def to_tensors(state_dict: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """{name: numpy array} -> {name: tensor}, ready for module.load_state_dict(..., strict=True)."""
    return {k: to_tensor(v) for k, v in state_dict.items()}
