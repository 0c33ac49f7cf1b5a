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
