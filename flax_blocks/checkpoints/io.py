"""Reading checkpoints, and the error every loader raises: shared by the converter, the
checkpoint dialects and the Hugging Face loaders (which is why it sits apart from them).

    read_state_dict(source)   a mapping, a module with .state_dict() or a .safetensors /
                              .pt / .pth / .bin path -> {name: numpy array} (lazy=True:
                              {name: stream.Lazy}, nothing read but the headers)
    ConversionError           every problem found, one per line; nothing was modified
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from . import stream
from .io_errors import torch_load_state_dict
from .stream import to_numpy


class ConversionError(ValueError):
    """Raised with every problem found, one per line; the module was not modified."""

    def __init__(self, problems: list[str], header: str = "cannot load state dict"):
        self.problems = list(problems)
        super().__init__(f"{header}: {len(problems)} problem(s)\n  " + "\n  ".join(problems))


def read_state_dict(source: Any, *, lazy: bool = False) -> dict[str, Any]:
    """A mapping of arrays/tensors, a module with .state_dict(), or a path to a
    .safetensors / .pt / .pth / .bin file -> {name: numpy array}.

    lazy: files are not read, only described: {name: `flax_blocks.checkpoints.stream.Lazy`} whose shapes
    and dtypes come from the file's header (safetensors) or a memory map (torch.load's
    mmap=True), and whose values are read, a tensor or a slice at a time, when placed. A
    mapping's Lazy values are kept as they are (read here when lazy is False)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint not found: {path}")
        if path.endswith(".safetensors"):
            tensors = stream.read_safetensors(path)
            return dict(tensors) if lazy else {k: t.read() for k, t in tensors.items()}
        if path.endswith((".pt", ".pth", ".bin")):
            if importlib.util.find_spec("torch") is None:
                raise ImportError(f"reading {path} needs PyTorch: install the 'torch' extra "
                                  "(pip install 'twin-blocks[torch]'), or convert it to .safetensors")
            obj = torch_load_state_dict(path, mmap=lazy)  # one-line CheckpointReadError for a pickled module
            if not isinstance(obj, Mapping):
                raise ConversionError([f"{path} holds a {type(obj).__name__}, expected a state dict (name -> tensor)"])
            return {k: stream.TorchTensor(v) if lazy else to_numpy(v) for k, v in obj.items()}
        raise ValueError(f"unknown checkpoint format {path!r}: expected .safetensors, .pt, .pth or .bin")
    if hasattr(source, "state_dict") and callable(source.state_dict):
        source = source.state_dict()
    if not isinstance(source, Mapping):
        raise TypeError(f"source must be a mapping of name -> array, a module or a path, got {type(source).__name__}")
    return {str(k): v if lazy and isinstance(v, stream.Lazy) else to_numpy(v) for k, v in source.items()}


def natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def ranges(xs: Iterable[int]) -> str:
    """Integers as runs: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"; none -> ""."""
    xs = sorted(xs)
    if not xs:
        return ""
    parts: list[str] = []
    start: int | None = xs[0]  # the current run's first number (None past the last)
    for a, b in zip(xs, [*xs[1:], None], strict=True):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
