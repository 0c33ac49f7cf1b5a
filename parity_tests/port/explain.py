"""Name the porting mistake behind a divergence: replay torch's module on its own recorded
input with one known mistake made in torch's functions (tanh for exact GELU, another norm
eps, ...) and see which makes torch compute what the Flax port computes on that input.

Each mistake patches functions of torch.nn.functional (or torch.Tensor) for the replay only,
so it reaches the module's own code and its children (nn.GELU calls F.gelu, nn.LayerNorm
F.layer_norm). A mistake that closes the gap to within the tolerance is the explanation.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import same_nan_err


@dataclass(frozen=True)
class Mistake:
    """One known porting mistake: `patches` maps (owner, attribute) to a function of the
    original returning the mistaken replacement; `says` is the sentence naming it ("{seen}"
    in it is filled with what the patched functions noted of torch's own call)."""

    says: str
    patches: dict[tuple[Any, str], Callable[[Callable], Callable]]
    seen: list = field(default_factory=list, compare=False)

    @contextlib.contextmanager
    def made(self, which: int | None = None) -> Iterator[list[int]]:
        """Make the mistake in every call of the patched functions, or in the `which`-th only;
        yields a one-item list that counts the calls."""
        saved = {key: getattr(*key) for key in self.patches}
        count, inside = [0], [False]
        try:
            for (owner, attr), make in self.patches.items():
                original, wrong = saved[(owner, attr)], make(saved[(owner, attr)])

                def patched(*a, _o=original, _w=wrong, **k):
                    if inside[0]:  # F.softmax calls Tensor.softmax: one mistake per call of the code
                        return _o(*a, **k)
                    i = count[0]
                    count[0] += 1
                    inside[0] = True
                    try:
                        return _w(*a, **k) if which is None or i == which else _o(*a, **k)
                    finally:
                        inside[0] = False
                setattr(owner, attr, patched)
            yield count
        finally:
            for (owner, attr), original in saved.items():
                setattr(owner, attr, original)

    def sentence(self) -> str:
        return self.says.replace("{seen}", ", ".join(dict.fromkeys(str(s) for s in self.seen)) or "?")


def _norm_eps(eps_values: list[float]) -> Iterator[Mistake]:
    import torch.nn.functional as F

    for value in eps_values:  # not `eps`: that is the name of the argument torch's code passes
        seen: list = []

        def layer_norm(f, e=value, seen=seen):
            def wrong(x, shape, w=None, b=None, eps=1e-5):
                seen.append(f"{eps:g}")
                return f(x, shape, w, b, e)
            return wrong

        def rms_norm(f, e=value, seen=seen):
            def wrong(x, shape, w=None, eps=None):
                seen.append("None (the dtype's machine epsilon)" if eps is None else f"{eps:g}")
                return f(x, shape, w, e)
            return wrong

        yield Mistake(f"norm eps: the flax port uses eps={value:g} where torch uses eps={{seen}}",
                      {(F, "layer_norm"): layer_norm, (F, "rms_norm"): rms_norm}, seen)


def _fast_variance(f):
    def layer_norm(x, shape, w=None, b=None, eps=1e-5):
        dims = tuple(range(-len(shape), 0))
        mean = x.mean(dims, keepdim=True)
        var = (x * x).mean(dims, keepdim=True) - mean * mean
        y = (x - mean) / (var + eps).sqrt()
        return y * (w if w is not None else 1) + (b if b is not None else 0)
    return layer_norm


def _as_rms(f):
    import torch.nn.functional as F

    return lambda x, shape, w=None, b=None, eps=1e-5: F.rms_norm(x, shape, w, eps) + (b if b is not None else 0)


def _as_layer_norm(f):
    import torch.nn.functional as F

    return lambda x, shape, w=None, eps=None: F.layer_norm(x, shape, w, None, 1e-5 if eps is None else eps)


def _sdpa(scale_of=None, flip_mask=False):
    def make(f):
        def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
            if scale_of is not None:
                scale = scale_of(q.shape[-1])
            if flip_mask and attn_mask is not None and attn_mask.dtype.is_floating_point is False:
                attn_mask = ~attn_mask
            return f(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
        return sdpa
    return make


def _head_split(f):
    """view/reshape splitting the last axis into (a, b) fills it as (b, a) transposed: heads
    taken as (head_dim, heads) where the code says (heads, head_dim)."""
    def split(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        out = f(self, *shape)
        if (out.ndim == self.ndim + 1 and out.shape[:-2] == self.shape[:-1] and out.shape[-1] != 1
                and out.shape[-2] != 1):
            a, b = out.shape[-2:]
            return f(self, *out.shape[:-2], b, a).transpose(-1, -2)
        return out
    return split


def _flip(m):
    """A mask's sense reversed: bool negated; an additive 0 / -inf mask (nn.MultiheadAttention
    turns a bool key_padding_mask into one) swapped."""
    import torch

    if m is None:
        return m
    if m.dtype == torch.bool:
        return ~m
    if bool(((m == 0) | torch.isneginf(m)).all()):
        return torch.where(m == 0, float("-inf"), 0.0).to(m.dtype)
    return m


def _mha_mask_flipped(f):
    def mha(*a, key_padding_mask=None, attn_mask=None, **k):
        return f(*a, key_padding_mask=_flip(key_padding_mask), attn_mask=_flip(attn_mask), **k)
    return mha


def _swap_sides(pad):
    pad = list(pad)
    return [pad[i ^ 1] for i in range(len(pad))]


def _linear_transposed(f):
    return lambda x, w, b=None: f(x, w.T if w.shape[0] == w.shape[1] else w, b)


def _conv(kind: str, pad: Callable[[int], tuple[int, int]], says: str) -> Mistake:
    import torch.nn.functional as F

    def make(f):
        def conv(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
            pads: list[int] = []
            for k in reversed(w.shape[2:]):
                pads += list(pad(int(k)))
            return f(F.pad(x, pads), w, b, stride, 0, dilation, groups)
        return conv
    return Mistake(says, {(F, kind): make})


def mistakes(eps_values: list[float]) -> Iterator[Mistake]:
    """The known porting mistakes, most common first."""
    import torch
    import torch.nn.functional as F

    yield Mistake("GELU: the flax port computes the tanh approximation where torch computes exact GELU "
                  "(jax.nn.gelu and nnx.gelu default to approximate=True; use approximate=False)",
                  {(F, "gelu"): lambda f: lambda x, approximate="none": f(
                      x, approximate="tanh" if approximate == "none" else "none")})
    yield from _norm_eps(eps_values)
    def tanh_gelu(x):
        return F.gelu(x, approximate="tanh")

    for a, b, _fa, fb in (("gelu", "silu", F.gelu, F.silu), ("silu", "gelu", F.silu, F.gelu),
                         ("silu", "tanh GELU (jax.nn.gelu's default)", F.silu, tanh_gelu),
                         ("relu", "gelu", F.relu, F.gelu),
                         ("relu", "tanh GELU (jax.nn.gelu's default)", F.relu, tanh_gelu),
                         ("gelu", "relu", F.gelu, F.relu)):
        yield Mistake(f"activation: the flax port computes {b} where torch computes {a}",
                      {(F, a): lambda f, g=fb: lambda x, *args, **kw: g(x)})
    yield Mistake("norm: the flax port scales by (1 + w) where torch scales by w",
                  {(F, "layer_norm"): lambda f: lambda x, s, w=None, b=None, eps=1e-5: f(
                      x, s, None if w is None else 1 + w, b, eps),
                   (F, "rms_norm"): lambda f: lambda x, s, w=None, eps=None: f(
                       x, s, None if w is None else 1 + w, eps)})
    yield Mistake("norm: the flax port scales by w where torch scales by (1 + w)",
                  {(F, "layer_norm"): lambda f: lambda x, s, w=None, b=None, eps=1e-5: f(
                      x, s, None if w is None else w - 1, b, eps),
                   (F, "rms_norm"): lambda f: lambda x, s, w=None, eps=None: f(
                       x, s, None if w is None else w - 1, eps)})
    yield Mistake("norm: the flax port normalises with RMSNorm (no mean subtracted) where torch uses LayerNorm",
                  {(F, "layer_norm"): _as_rms})
    yield Mistake("norm: the flax port normalises with LayerNorm (mean subtracted) where torch uses RMSNorm",
                  {(F, "rms_norm"): _as_layer_norm})
    yield Mistake("norm: the flax port computes the variance as E[x^2] - E[x]^2 (nnx.LayerNorm's "
                  "use_fast_variance=True) where torch computes E[(x - mean)^2]",
                  {(F, "layer_norm"): _fast_variance})
    yield Mistake("kernel: the flax port uses a square linear kernel transposed (torch stores (out, in), "
                  "flax (in, out))", {(F, "linear"): _linear_transposed})
    yield Mistake("heads: the flax port splits the features as (head_dim, heads) where torch splits "
                  "(heads, head_dim)", {(torch.Tensor, "view"): _head_split, (torch.Tensor, "reshape"): _head_split})
    yield Mistake("mask: the flax port reads the mask in the opposite sense (torch bool masks: True = "
                  "masked in masked_fill / nn.MultiheadAttention, True = may attend in "
                  "scaled_dot_product_attention; flax: True = may attend)",
                  {(torch.Tensor, "masked_fill"): lambda f: lambda self, m, v: f(self, ~m, v),
                   (F, "scaled_dot_product_attention"): _sdpa(flip_mask=True)})
    yield Mistake("mask: the flax port reads the padding mask in the opposite sense (nn.MultiheadAttention's "
                  "key_padding_mask: True = padding; flax's mask: True = may attend)",
                  {(F, "multi_head_attention_forward"): _mha_mask_flipped})
    yield Mistake("padding: the flax port pads the other side of the sequence (F.pad's (left, right) "
                  "read as (right, left): the future where torch pads the past, or the reverse)",
                  {(F, "pad"): lambda f: lambda x, pad, *a, **k: f(x, _swap_sides(pad), *a, **k)})
    for name, scale in (("1/head_dim", lambda d: 1.0 / d), ("1 (no scale)", lambda d: 1.0)):
        yield Mistake(f"softmax scale: the flax port scales the attention logits by {name} where torch uses "
                      f"1/sqrt(head_dim)", {(F, "scaled_dot_product_attention"): _sdpa(scale_of=scale)})
    for d in (4, 8, 16, 32, 64, 128, 256):
        for c, said in ((1 / math.sqrt(d), f"an extra 1/sqrt({d})"), (math.sqrt(d), f"sqrt({d}) less")):
            yield Mistake(f"softmax scale: the flax port's attention logits carry {said} than torch's "
                          f"(a scale of 1/{d} for 1/sqrt({d}), or none)",
                          {(F, "softmax"): lambda f, c=c: lambda x, dim=None, *a, **k: f(x * c, dim, *a, **k),
                           (torch, "softmax"): lambda f, c=c: lambda x, dim=None, *a, **k: f(x * c, dim, *a, **k),
                           (torch.Tensor, "softmax"): lambda f, c=c: lambda self, dim=None, *a, **k: f(
                               self * c, dim, *a, **k)})
    for d in (4, 8, 16, 32, 64, 128, 256):
        for c, said in ((1 / math.sqrt(d), f"an extra 1/sqrt({d})"), (math.sqrt(d), f"sqrt({d}) less")):
            yield Mistake(f"softmax scale: the flax port's attention logits (a matmul of queries and keys) "
                          f"carry {said} than torch's",
                          {(torch.Tensor, "__matmul__"): lambda f, c=c: lambda a, b: f(a, b) * c})
    for kind in ("conv1d", "conv2d"):
        for says, pad in (("'SAME' (k//2 each side)", lambda k: ((k - 1) // 2, k // 2)),
                          ("'VALID' (none)", lambda k: (0, 0)),
                          ("causally (k - 1 on the left)", lambda k: (k - 1, 0)),
                          ("k - 1 on both sides", lambda k: (k - 1, k - 1))):
            yield _conv(kind, pad, f"conv padding: the flax port pads {says} where torch pads otherwise")


def explain(torch_module, args: tuple, kwargs: dict, target: list[np.ndarray], tol: float,
            adapt: Callable[[Any], list[np.ndarray]], eps_values: list[float]) -> str | None:
    """The first known mistake that, made in torch's functions while `torch_module` reruns on
    its recorded input, brings its output (through `adapt`) within `tol` of `target` (the
    Flax module's output on that input); None when none does."""
    import torch


    def replay() -> float:
        with torch.enable_grad():  # as autograd would: nn.MultiheadAttention's no-grad fast path skips F
            return same_nan_err(target, adapt(torch_module(*args, **kwargs)))

    try:
        if replay() <= tol:
            return None  # nothing to explain
    except Exception:
        return None
    for m in mistakes(eps_values):
        try:
            with m.made() as count:
                err = replay()
        except Exception:
            continue
        if err <= tol:
            return m.sentence()
        for which in range(min(count[0], 4) if count[0] > 1 else 0):  # the mistake in one call only
            m.seen.clear()
            try:
                with m.made(which):
                    err = replay()
            except Exception:
                break
            if err <= tol:
                return m.sentence() + f" (in its call #{which + 1} of that function here)"
        m.seen.clear()
    return None
