"""float32 islands: where torch itself computes in float32 inside a float64 run.

HF computes RMSNorm, rotary angles and the eager softmax in float32 whatever the model's dtype
(`hidden_states.to(torch.float32)`, `position_ids.float()`, `softmax(..., dtype=torch.float32)`),
so a float64 run of a LLaMA-family model carries float32 rounding from its first norm on.
`watch` sees it (a float32 tensor made while a module runs in a float64 run: the innermost
recorded call is an island); `promoted` reruns torch with those computations in float64 (every
float32 dtype asked for becomes float64, every float32 tensor made is cast up), which gives the
noise each module's figures carry: a module is then judged at ten times that noise, at least
float32's floor, and a module free of islands stays at float64's tolerance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .record import map_nested


def _low():
    import torch

    return (torch.float32, torch.float16, torch.bfloat16)


def _tensors(obj: Any) -> Iterator[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)


@contextlib.contextmanager
def watch(stack: list, found: dict[int, set[str]]) -> Iterator[None]:
    """While the block runs, note in `found` (id of a recorded call -> the functions) each
    call on top of `stack` (record_torch's open calls) inside which a torch function makes a
    float32 / float16 / bfloat16 tensor."""
    from torch.overrides import TorchFunctionMode

    low = _low()

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if stack and any(t.is_floating_point() and t.dtype in low for t in _tensors(out)):
                found.setdefault(id(stack[-1]), set()).add(getattr(func, "__name__", str(func)))
            return out

    with Watch():
        yield


@contextlib.contextmanager
def promoted() -> Iterator[None]:
    """While the block runs, torch computes in float64 where it would drop to float32: every
    float32 / float16 / bfloat16 dtype passed to a torch function is float64, `Tensor.float()`
    is `.double()`, and every lower-precision tensor a function makes is cast up."""
    import torch
    from torch.overrides import TorchFunctionMode

    low = _low()

    def up(o):
        if isinstance(o, torch.dtype) and o in low:
            return torch.float64
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.dtype in low:
            return o.double()
        return o

    class Promote(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16):
                func = torch.Tensor.double
            args, kwargs = map_nested(up, (tuple(args), dict(kwargs or {})))
            return map_nested(up, func(*args, **kwargs))

    with Promote():
        yield


# ----------------------------------------------------------------------------------------
# Constants made at init
# ----------------------------------------------------------------------------------------


@dataclass
class Constant:
    """A floating buffer torch computed in float32 in a module's `__init__` (HF's rotary
    tables: GPT-J's `embed_positions`, the `inv_freq` of LLaMA's family): held by `owner` (at
    `path`) as `name`, not stored in the state dict (the port computes its own), its values
    float32's after the float64 cast. `wobbled`: the values moved by float32's rounding
    (2^-24 relative, signs drawn), the reference the noise they carry is measured against."""

    path: str
    owner: Any
    name: str
    wobbled: Any


def _float32_made(b) -> bool:
    """Whether a float64 tensor holds float32 values only, and values a float32 computation
    rounds (some finite entry with more than 12 fractional bits: not a mask, not integers)."""
    import torch

    finite = b[torch.isfinite(b)]
    if finite.numel() == 0 or not torch.equal(finite, finite.float().double()):
        return False
    scaled = finite * 4096
    return bool((scaled != torch.round(scaled)).any())


def init_constants(root) -> list[Constant]:
    """The float32 constants made at init in `root` (its float64 copy): non-persistent
    floating buffers whose values hold float32's precision."""
    import torch

    out = []
    gen = torch.Generator().manual_seed(0)
    for path, m in root.named_modules():
        for name, b in m._buffers.items():
            if b is None or not b.is_floating_point() or b.dtype != torch.float64 \
                    or name not in m._non_persistent_buffers_set or not _float32_made(b):
                continue
            signs = torch.randint(0, 2, b.shape, generator=gen).double() * 2 - 1
            out.append(Constant(path, m, name, b * (1 + signs * 2.0 ** -24)))
    return out


@contextlib.contextmanager
def wobbled(constants: list[Constant]) -> Iterator[None]:
    """While the block runs, each constant holds its values moved by float32's rounding."""
    kept = [(c, c.owner._buffers[c.name]) for c in constants]
    try:
        for c, _ in kept:
            c.owner._buffers[c.name] = c.wobbled
        yield
    finally:
        for c, b in kept:
            c.owner._buffers[c.name] = b
