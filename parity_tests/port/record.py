"""Record every submodule call of a torch module (forward hooks) and of an NNX module (its
classes' __call__ wrapped for the call), inputs and outputs, in execution order. Both leave
nothing behind: hooks are removed and classes restored when the `with` block ends."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Call:
    """One call of a submodule: its path, the how-many-th call of it this is, where it started
    and ended in the run (a counter shared by all calls), and what went in and came out."""

    path: str
    index: int
    start: int
    module: Any
    args: tuple
    kwargs: dict
    end: int = -1
    output: Any = None
    children: list[Call] = field(default_factory=list)
    parent: Call | None = None


def leaves(obj: Any) -> list[Any]:
    """The array leaves of nested tuples / lists / dicts, in order (torch tensors, jax or numpy arrays)."""
    if isinstance(obj, (tuple, list)):
        return [x for o in obj for x in leaves(o)]
    if isinstance(obj, dict):
        return [x for k in obj for x in leaves(obj[k])]
    return [obj] if hasattr(obj, "shape") and hasattr(obj, "dtype") else []


def is_float(a: Any) -> bool:
    """Whether an array leaf (torch or jax or numpy) holds floating values."""
    import torch

    if isinstance(a, torch.Tensor):
        return a.is_floating_point()
    return np.issubdtype(np.dtype(a.dtype), np.floating)


def float_leaves(obj: Any, adapt: Callable | None = None) -> list[np.ndarray]:
    """The floating array leaves of nested args as numpy, each through `adapt` (torch's
    layout into the port's) when given."""
    out = [to_numpy(a) for a in leaves(obj) if is_float(a)]
    return [adapt(a) for a in out] if adapt else out


def to_numpy(a: Any) -> np.ndarray:
    import torch

    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def map_nested(fn, obj: Any) -> Any:
    """`fn` applied to every leaf of nested tuples / lists / dicts, the nesting kept."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple takes its fields apart
        return type(obj)(*(map_nested(fn, o) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_nested(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: map_nested(fn, v) for k, v in obj.items()}
    return fn(obj)


def _snap(obj: Any) -> Any:
    """A copy of a call's values that later in-place ops cannot change (torch tensors cloned)."""
    import torch

    return map_nested(lambda o: o.detach().clone() if isinstance(o, torch.Tensor) else o, obj)


class Recording:
    """Calls nested as they ran: `calls` in the order they started, `stack` the open ones."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.stack: list[Call] = []
        self.counter = itertools.count()
        self.seen: dict[str, int] = {}

    def enter(self, path: str, module: Any, args: tuple, kwargs: dict) -> Call:
        index = self.seen.get(path, 0)
        self.seen[path] = index + 1
        call = Call(path, index, next(self.counter), module, _snap(args), _snap(kwargs),
                    parent=self.stack[-1] if self.stack else None)
        if call.parent is not None:
            call.parent.children.append(call)
        self.calls.append(call)
        self.stack.append(call)
        return call

    def leave(self, call: Call, output: Any) -> None:
        call.output = _snap(output)
        call.end = next(self.counter)
        while self.stack and self.stack.pop() is not call:
            pass


@contextlib.contextmanager
def record_torch(module) -> Iterator[Recording]:
    """Record every submodule call of a torch module during the block (forward hooks)."""
    tree = Recording()
    handles = []
    open_calls: dict[int, list[Call]] = {}

    def pre(name):
        def hook(mod, args, kwargs):
            open_calls.setdefault(id(mod), []).append(tree.enter(name, mod, args, kwargs))
        return hook

    def post(mod, args, kwargs, output):
        tree.leave(open_calls[id(mod)].pop(), output)

    try:
        for name, m in module.named_modules():
            handles.append(m.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        yield tree
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def record_flax(module, names: dict[str, Any]) -> Iterator[list[Call]]:
    """Record every call of the NNX submodules `names` (dotted name -> module) during the
    block: each class that defines the __call__ they use is wrapped, and restored after."""
    tree = Recording()
    by_id = {id(m): n for n, m in names.items()}
    owners: dict[type, Any] = {}
    for m in names.values():
        owner = next((c for c in type(m).__mro__ if "__call__" in c.__dict__), None)
        if owner is not None and owner is not object:  # nnx.List and the like are never called
            owners.setdefault(owner, owner.__dict__["__call__"])

    def wrap(original):
        def __call__(self, *args, **kwargs):
            name = by_id.get(id(self))
            if name is None or (tree.stack and tree.stack[-1].module is self):  # super().__call__ chains
                return original(self, *args, **kwargs)
            call = tree.enter(name, self, args, kwargs)
            try:
                out = original(self, *args, **kwargs)
            except BaseException:
                tree.leave(call, None)
                raise
            tree.leave(call, out)
            return out
        return __call__

    try:
        for owner, original in owners.items():
            owner.__call__ = wrap(original)
        yield tree.calls
    finally:
        for owner, original in owners.items():
            owner.__call__ = original
