"""Reading a .pt/.pth file safely, with one-line errors a user can act on.

`torch.load(path, weights_only=True)` refuses anything but tensors and plain containers.
On a whole pickled module (`torch.save(model, path)`) it raises an `UnpicklingError` whose
message is a dozen lines about trusting the source; on a file that is not a torch pickle at
all (e.g. safetensors bytes under a .pt name) one about an "unsupported operand". Both
become a `CheckpointReadError` (a ValueError) with one line naming the fix.
"""

from __future__ import annotations

import os
import pickle
import re
import struct
import zipfile
from typing import Any


class CheckpointReadError(ValueError):
    """A checkpoint file that cannot be read as a state dict; the message is one line."""


def _is_safetensors(path: str) -> bool:
    """True if the file starts like a safetensors file: a little-endian u64 header
    length, then a JSON object."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            if len(head) < 9:
                return False
            (n,) = struct.unpack("<Q", head[:8])
            return head[8:9] == b"{" and 2 <= n <= os.path.getsize(path) - 8
    except OSError:
        return False


def describe_unpickling_error(path: str | os.PathLike, err: BaseException) -> str:
    """One line saying what `path` holds and what to do, for an UnpicklingError that
    `torch.load(path, weights_only=True)` raised."""
    path = os.fspath(path)
    text = str(err)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        what = found.group(1)
        return (f"{path} holds a pickled object ({what}), not a state dict: save module.state_dict() "
                f"instead (torch.save(model.state_dict(), {os.path.basename(path)!r})), "
                "or pass the module object itself")
    if _is_safetensors(path):
        return f"{path} is a safetensors file with a torch name: rename it to *.safetensors"
    lines = text.splitlines()
    first = next((line.strip() for line in lines if "error:" in line.lower()), lines[0] if lines else "")
    return f"{path} is not a torch state dict that torch.load(weights_only=True) can read ({first[:160]})"


def torch_load_state_dict(path: str | os.PathLike, mmap: bool = False) -> Any:
    """`torch.load(path, map_location="cpu", weights_only=True)`, raising CheckpointReadError
    (one line) instead of torch's multi-line UnpicklingError. mmap: memory-map the file's
    storages (read when used) where its format allows (torch.save's zip format; a legacy
    file is read whole)."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        raise CheckpointReadError(describe_unpickling_error(path, e)) from None
