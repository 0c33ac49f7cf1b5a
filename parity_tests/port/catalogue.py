"""The catalogue of porting mistakes the explainer replays (explain.py), each made three
ways, whichever reaches the code it concerns:
  - in torch's functions (F.gelu, F.layer_norm, F.scaled_dot_product_attention, torch.matmul,
    Tensor.view, ...), swapped in a torch function mode for the replay: code that calls them,
    or holds a reference to them;
  - in the replayed module's own submodules, recognised by what they compute (behaviour.py):
    an activation or a hand-written norm gets a forward computing the mistaken variant, a
    square kernel is transposed, HF's `apply_rotary_pos_emb` pairs features the other way;
  - in the replayed call's own arguments: a mask read in the other sense or shifted by one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import catalogue_more as M
from .behaviour import ACTIVATIONS, Norm, activation_of, norm_forward, norm_of
from .pairing import MASKED
from .record import map_nested


@dataclass
class Mistake:
    """One known porting mistake. patches: (owner, attribute) -> a function of the original
    returning the mistaken replacement; forwards: module -> the forward computing the mistake
    (for modules of the replayed subtree); swaps: (parameter, mistaken value) pairs; args: a
    function of the replayed call's (args, kwargs) returning mistaken ones. `says` names it
    ("{seen}" is filled with what the patched functions noted of torch's own call)."""

    says: str
    patches: dict[tuple[Any, str], Callable[[Callable], Callable]] = field(default_factory=dict)
    forwards: dict[Any, Callable] = field(default_factory=dict)
    swaps: list[tuple[Any, Any]] = field(default_factory=list)
    args: Callable[[tuple, dict], tuple[tuple, dict]] | None = None
    seen: list = field(default_factory=list, compare=False)
    hooks: list = field(default_factory=list, compare=False)  # (module, "pre" / "post", hook) while made
    dead: list = field(default_factory=list, compare=False)  # (B, Tq) queries the mistaken mask leaves no key

    @contextlib.contextmanager
    def made(self, which: int | None = None) -> Iterator[list[int]]:
        """Make the mistake in every call of the patched functions and forwards, or in the
        `which`-th only; yields a one-item list that counts the calls. torch's own functions
        are swapped in a torch function mode, which reaches a reference to them kept
        anywhere (transformers' GELUActivation holds F.gelu); others (HF's
        apply_rotary_pos_emb) are patched where they live."""
        import torch
        from torch.overrides import TorchFunctionMode

        torch_owned = {key: make for key, make in self.patches.items() if key[0] in _torch_owners()}
        saved = {key: getattr(*key) for key in self.patches if key not in torch_owned}
        own = {m: vars(m).get("forward") for m in self.forwards}
        kept = [(p, p.data) for p, _ in self.swaps]
        count, inside = [0], [False]

        def counted(original, wrong):
            def call(*a, **k):
                if inside[0]:  # a mistaken function calling a patched one: one mistake per call of the code
                    return original(*a, **k)
                i = count[0]
                count[0] += 1
                inside[0] = True
                try:
                    return wrong(*a, **k) if which is None or i == which else original(*a, **k)
                finally:
                    inside[0] = False
            return call

        swapped = {}
        for (owner, attr), make in torch_owned.items():
            original = getattr(owner, attr)
            for func in _aliases(owner, attr):
                swapped[func] = counted(original, make(original))

        class Swap(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return swapped.get(func, func)(*args, **(kwargs or {}))

        handles = []
        try:
            for m, kind, hook in self.hooks:
                handles.append(m.register_forward_pre_hook(hook, with_kwargs=True) if kind == "pre"
                               else m.register_forward_hook(hook))
            for (owner, attr), original in saved.items():
                setattr(owner, attr, counted(original, self.patches[(owner, attr)](original)))
            for m, wrong in self.forwards.items():
                m.forward = counted(type(m).forward.__get__(m), wrong)
            with torch.no_grad():
                for p, value in self.swaps:
                    p.data = value
            with Swap() if swapped else contextlib.nullcontext():
                yield count
        finally:
            for h in handles:
                h.remove()
            for (owner, attr), original in saved.items():
                setattr(owner, attr, original)
            for m, before in own.items():
                if before is None:
                    del m.forward
                else:
                    m.forward = before
            for p, data in kept:
                p.data = data

    def sentence(self) -> str:
        return self.says.replace("{seen}", ", ".join(dict.fromkeys(str(s) for s in self.seen)) or "?")


def _torch_owners() -> tuple:
    import torch
    import torch.nn.functional as F

    return (torch, F, torch.Tensor)


def _aliases(owner, attr: str) -> list:
    """The function objects a torch function mode sees for owner.attr (`a @ b` arrives as
    Tensor.matmul)."""
    import torch

    out = [getattr(owner, attr)]
    if owner is torch.Tensor and attr == "__matmul__":
        out.append(torch.Tensor.matmul)
    return out


# ----------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------


def _keep(m) -> Any:
    """A torch mask as True = may attend (bool as is; additive: above MASKED)."""
    import torch

    return m if m.dtype == torch.bool else m > MASKED


def _additive(keep, dtype) -> Any:
    """True = may attend -> 0 / -1e38: a fully masked row then softmaxes to uniform weights,
    as flax's masking by the lowest value gives, in float64 and in a float32 softmax alike
    (float64's lowest would be -inf there, and the row NaN)."""
    import torch

    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -1e38)


def _causal_like(keep) -> bool:
    n = keep.shape[-1]
    if keep.ndim < 2 or keep.shape[-2] != n or n < 2:
        return False
    import torch

    upper = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    return not bool((keep & upper).any()) and bool(keep[..., -1, :].any())


def _shift(keep, offset: int):
    """A causal keep-mask with its diagonal moved: +1 lets each query see the next key too
    (where that key is not padding), -1 hides each query's own key."""
    import torch

    n = keep.shape[-1]
    if offset > 0:
        valid = keep[..., -1:, :]  # the last query sees every key that is not padding
        superdiag = torch.ones(n, n, dtype=torch.bool).triu(1) & ~torch.ones(n, n, dtype=torch.bool).triu(2)
        return keep | (superdiag & valid)
    return keep & ~torch.eye(n, dtype=torch.bool)


def _flip_padding(keep):
    """A mask's sense reversed; in a causal mask only its padding part (the causal part kept)."""
    import torch

    if _causal_like(keep):
        n = keep.shape[-1]
        return torch.tril(torch.ones(n, n, dtype=torch.bool)) & ~keep[..., -1:, :]
    return ~keep


def _is_mask(t) -> bool:
    import torch

    if not isinstance(t, torch.Tensor) or t.ndim < 2:
        return False
    if t.dtype == torch.bool:
        return True
    if not t.is_floating_point() or t.numel() == 0:
        return False
    masked = t <= MASKED
    return bool(masked.any()) and bool((masked | (t == 0)).all())


def _note_dead(keep, dead: list) -> None:
    """Note the queries a mask (True = may attend, (..., Tq, Tk)) lets attend no key: what a
    port gives there is its own convention (NaN, zeros, uniform weights, the unmasked
    softmax of a finite fill), so those rows are not compared."""
    rows = ~keep.any(-1)
    while rows.ndim > 2:
        rows = rows.any(1)
    dead.append(rows.cpu().numpy())


def _masks_changed(change: Callable, only_causal: bool, dead: list) -> Callable[[tuple, dict], tuple[tuple, dict]]:
    """The replayed call's arguments with each mask `change`d (as additive float masks)."""
    import torch

    def go(args, kwargs):
        hit = [False]

        def one(t):
            if not _is_mask(t):
                return t
            keep = _keep(t)
            if only_causal and not _causal_like(keep):
                return t
            hit[0] = True
            dtype = t.dtype if t.is_floating_point() else torch.float64
            new = change(keep)
            _note_dead(new, dead)
            return _additive(new, dtype)

        out = map_nested(one, (args, kwargs))
        if not hit[0]:
            raise LookupError("no mask among the arguments")
        return out
    return go


def _sdpa(scale_of=None, mask_change: Callable | None = None, causal_offset: int = 0, dead: list | None = None):
    """F.scaled_dot_product_attention with its scale replaced, its mask changed (as a keep
    mask), or its causal diagonal moved (is_causal made explicit)."""
    def make(f):
        def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
            if scale_of is not None:
                d = q.shape[-1]
                scale = scale_of(d, d ** -0.5 if scale is None else scale)
            if causal_offset:
                import torch

                n, s = q.shape[-2], k.shape[-2]
                if is_causal:
                    attn_mask, is_causal = torch.tril(torch.ones(n, s, dtype=torch.bool)), False
                if attn_mask is not None and _causal_like(_keep(attn_mask)):
                    new = _shift(_keep(attn_mask), causal_offset)
                    _note_dead(new, dead)
                    attn_mask = _additive(new, q.dtype)
            if mask_change is not None and attn_mask is not None:
                new = mask_change(_keep(attn_mask))
                _note_dead(new, dead)
                attn_mask = _additive(new, q.dtype)
            return f(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
        return sdpa
    return make


def _future_shifted(offset: int, dead: list):
    """masked_fill with a "future" mask (True above the diagonal) moved by one."""
    def make(f):
        def fill(self, mask, value):
            import torch

            n = mask.shape[-1]
            if mask.dtype == torch.bool and mask.ndim >= 2 and mask.shape[-2] == n and _causal_like(~mask):
                mask = ~_shift(~mask, offset)
                _note_dead(~mask, dead)
            return f(self, mask, value)
        return fill
    return make


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


# ----------------------------------------------------------------------------------------
# Heads: split order, grouped-query repeat, rotary pairs
# ----------------------------------------------------------------------------------------


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


def _head_split_and_merge(f):
    """_head_split, and a merge of the last two axes (a, b) -> a * b read as (b, a)."""
    split = _head_split(f)

    def both(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        out = f(self, *shape)
        if out.ndim == self.ndim - 1 and out.shape[:-1] == self.shape[:-2] and 1 not in self.shape[-2:]:
            return f(self.transpose(-1, -2).contiguous(), *shape)
        return split(self, *shape)
    return both


def _groups(x) -> int:
    """r > 1 when x's heads (axis 1) come in runs of r equal ones (key / value heads repeated
    for grouped-query attention), else 1."""
    import torch

    if x.ndim != 4:
        return 1
    h = x.shape[1]
    for r in range(2, h + 1):
        if h % r == 0:
            g = x.reshape(x.shape[0], h // r, r, *x.shape[2:])
            if torch.equal(g, g[:, :, :1].expand_as(g)):
                return r
    return 1


def _tiled(x, r: int):
    """Heads repeated (query head h uses kv head h // r) rearranged as tiled (h % n_kv)."""
    return x[:, ::r].repeat(1, r, 1, 1)


def _gqa_sdpa(f):
    def sdpa(q, k, v, *a, enable_gqa=False, **kw):
        if k.shape[-3] != q.shape[-3]:
            r = q.shape[-3] // k.shape[-3]
            k, v = k.repeat(1, r, 1, 1), v.repeat(1, r, 1, 1)
        else:
            r = _groups(k)
            if r > 1:
                k, v = _tiled(k, r), _tiled(v, r)
        return f(q, k, v, *a, **kw)
    return sdpa


def _gqa_matmul(f):
    def matmul(a, b, *rest, **kw):
        import torch

        if isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor) and a.ndim == b.ndim == 4 \
                and a.shape[1] == b.shape[1]:
            r = _groups(b)
            if r > 1:
                b = _tiled(b, r)
        return f(a, b, *rest, **kw)
    return matmul


# ----------------------------------------------------------------------------------------
# Norms, activations, kernels
# ----------------------------------------------------------------------------------------


def _norm_eps(value: float, norms: dict) -> Mistake:
    import torch.nn.functional as F

    seen: list = []

    def layer_norm(f):
        def wrong(x, shape, weight=None, bias=None, eps=1e-5):  # F's own argument names: a torch
            seen.append(f"{eps:g}")                              # function mode passes them by name
            return f(x, shape, weight, bias, value)
        return wrong

    def rms_norm(f):
        def wrong(x, shape, weight=None, eps=None):
            seen.append("None (the dtype's machine epsilon)" if eps is None else f"{eps:g}")
            return f(x, shape, weight, value)
        return wrong

    forwards = {}
    for m, n in norms.items():
        if n.eps != value:
            forwards[m] = _norm_forward(m, Norm(n.kind, value, n.place, n.one_plus), seen=seen, said=n.eps)
    return Mistake(f"norm eps: the flax port uses eps={value:g} where torch uses eps={{seen}}",
                   {(F, "layer_norm"): layer_norm, (F, "rms_norm"): rms_norm}, forwards, seen=seen)


def _norm_forward(m, n: Norm, seen: list | None = None, said: float | None = None) -> Callable:
    """A forward for the norm module `m` computing `n` (noting `said`, its own eps, in `seen`)."""
    params = [p for p in m.parameters(recurse=False)]
    weight = next(p for name, p in m.named_parameters(recurse=False) if "bias" not in name)
    bias = next((p for name, p in m.named_parameters(recurse=False) if "bias" in name), None)
    del params

    def forward(x, *a, **k):
        if seen is not None and said is not None:
            seen.append(f"{said:g}")
        return norm_forward(x, weight, bias, n)
    return forward


def _norm_variants(norms: dict) -> Iterator[Mistake]:
    """Mistakes of a norm's own math, made in every recognised norm module (and in F's)."""
    import torch.nn.functional as F

    def each(change: Callable[[Norm], Norm | None]) -> dict:
        out = {}
        for m, n in norms.items():
            wrong = change(n)
            if wrong is not None and wrong != n:
                out[m] = _norm_forward(m, wrong)
        return out

    def shifted(by: float) -> dict:
        """F's norms with their weight moved by `by` (1 + w for w, or w - 1)."""
        return {(F, "layer_norm"): lambda f: lambda x, s, weight=None, bias=None, eps=1e-5: f(
                    x, s, None if weight is None else weight + by, bias, eps),
                (F, "rms_norm"): lambda f: lambda x, s, weight=None, eps=None: f(
                    x, s, None if weight is None else weight + by, eps)}

    def as_rms(f):
        return lambda x, shape, weight=None, bias=None, eps=1e-5: F.rms_norm(x, shape, weight, eps) + (
            bias if bias is not None else 0)

    def as_layer_norm(f):
        return lambda x, shape, weight=None, eps=None: F.layer_norm(x, shape, weight, None,
                                                                    1e-5 if eps is None else eps)

    yield Mistake("norm eps: the flax port adds eps outside the square root (x / (sqrt(mean(x^2)) + eps)) where "
                  "torch adds it inside (x / sqrt(mean(x^2) + eps))",
                  forwards=each(lambda n: Norm(n.kind, n.eps, "outside", n.one_plus) if n.place == "inside" else None))
    yield Mistake("norm: the flax port scales by (1 + w) where torch scales by w", shifted(1.0),
                  each(lambda n: Norm(n.kind, n.eps, n.place, True) if not n.one_plus else None))
    yield Mistake("norm: the flax port scales by w where torch scales by (1 + w) (Gemma's norms: stored w starts "
                  "at 0)", shifted(-1.0), each(lambda n: Norm(n.kind, n.eps, n.place, False) if n.one_plus else None))
    yield Mistake("norm: the flax port normalises with RMSNorm (no mean subtracted) where torch uses LayerNorm",
                  {(F, "layer_norm"): as_rms}, each(lambda n: Norm("rms", n.eps, n.place, n.one_plus)
                                                     if n.kind == "layer" else None))
    yield Mistake("norm: the flax port normalises with LayerNorm (mean subtracted) where torch uses RMSNorm",
                  {(F, "rms_norm"): as_layer_norm}, each(lambda n: Norm("layer", n.eps, n.place, n.one_plus)
                                                          if n.kind == "rms" else None))


def _activation_variants(acts: dict) -> Iterator[Mistake]:
    """Exact vs tanh GELU both ways first, then any other swap, in F's functions and in every
    activation module recognised by what it computes."""
    import torch.nn.functional as F

    def modules(have: str, want: str) -> dict:
        fn = ACTIVATIONS[want][1]
        return {m: (lambda x, *a, _f=fn, **k: _f(x)) for m, kind in acts.items() if kind == have}

    yield Mistake("GELU: the flax port computes the tanh approximation where torch computes exact GELU "
                  "(jax.nn.gelu and nnx.gelu default to approximate=True; use approximate=False)",
                  {(F, "gelu"): lambda f: lambda x, approximate="none": f(
                      x, approximate="tanh" if approximate == "none" else approximate)},
                  modules("gelu", "gelu_tanh"))
    yield Mistake("GELU: the flax port computes exact GELU where torch computes the tanh approximation (HF's "
                  "gelu_new / gelu_pytorch_tanh; use jax.nn.gelu(x, approximate=True))",
                  {(F, "gelu"): lambda f: lambda x, approximate="none": f(
                      x, approximate="none" if approximate == "tanh" else approximate)},
                  modules("gelu_tanh", "gelu"))

    def tanh_gelu(x):
        return F.gelu(x, approximate="tanh")

    for a, b, fb in (("gelu", "silu", F.silu), ("silu", "gelu", F.gelu), ("silu", "gelu_tanh", tanh_gelu),
                     ("relu", "gelu", F.gelu), ("relu", "gelu_tanh", tanh_gelu), ("gelu", "relu", F.relu)):
        said = "tanh GELU (jax.nn.gelu's default)" if b == "gelu_tanh" else b
        yield Mistake(f"activation: the flax port computes {said} where torch computes {a}",
                      {(F, a): lambda f, g=fb: lambda x, *args, **kw: g(x)}, modules(a, b))
    for a in sorted(set(acts.values())):
        for b, (words, _) in ACTIVATIONS.items():
            if b != a and {a, b} != {"gelu", "gelu_tanh"}:
                yield Mistake(f"activation: the flax port computes {words} where torch computes {ACTIVATIONS[a][0]}",
                              forwards=modules(a, b))


def _square_kernels(root) -> Iterator[Mistake]:
    """Each square matrix parameter of the subtree transposed (and all of them together)."""
    import torch.nn.functional as F

    square = [(name, p) for name, p in root.named_parameters() if p.ndim == 2 and p.shape[0] == p.shape[1]]
    says = ("kernel: the flax port uses {name}'s square kernel transposed (torch's nn.Linear stores (out, in), "
            "HF's Conv1D (in, out), flax (in, out): the shape cannot tell)")
    for name, p in square:
        yield Mistake(says.format(name=name or "the module"), swaps=[(p, p.data.T.contiguous())])
    if len(square) > 1:
        yield Mistake(says.format(name="every"), swaps=[(p, p.data.T.contiguous()) for _, p in square])
    yield Mistake(says.format(name="a linear layer"),
                  {(F, "linear"): lambda f: lambda x, weight, bias=None: f(
                      x, weight.T if weight.shape[0] == weight.shape[1] else weight, bias)})


def _swap_sides(pad):
    pad = list(pad)
    return [pad[i ^ 1] for i in range(len(pad))]


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


# ----------------------------------------------------------------------------------------
# The catalogue
# ----------------------------------------------------------------------------------------

ROTARY_HALVES = ("rotary: the flax port rotates adjacent feature pairs (2i, 2i + 1: GPT-J's and Meta's "
                 "interleaved layout) where torch rotates halves (i, i + D/2: HF's rotate_half)")


def _if_usual(d: int, s: float, wrong: float) -> float:
    """`wrong`, where torch's scale is 1/sqrt(d) as the sentence says; else no replay."""
    if abs(s * d ** 0.5 - 1) > 1e-9:
        raise LookupError("torch's scale is not 1/sqrt(head_dim)")
    return wrong


def _scales(root) -> Iterator[Mistake]:
    """The softmax scale made another way in scaled_dot_product_attention (torch's own scale
    known there) and, for query_pre_attn_scalar, in the matmul of queries by keys (head_dim
    read from its shapes)."""
    import torch
    import torch.nn.functional as F

    yield Mistake("softmax scale: the flax port scales the attention logits by 1/head_dim where torch uses "
                  "1/sqrt(head_dim)",
                  {(F, "scaled_dot_product_attention"): _sdpa(scale_of=lambda d, s: _if_usual(d, s, 1.0 / d))})
    yield Mistake("softmax scale: the flax port scales the attention logits by 1 (no scale) where torch uses "
                  "1/sqrt(head_dim)",
                  {(F, "scaled_dot_product_attention"): _sdpa(scale_of=lambda d, s: _if_usual(d, s, 1.0))})
    for says, factor in M.scale_factors(root):
        yield Mistake(says, {(F, "scaled_dot_product_attention"): _sdpa(scale_of=lambda d, s, f=factor: f(d, s) * s)})
        if "query_pre_attn_scalar" not in says:  # torch's own scale is not known in a matmul
            continue
        yield Mistake(says + " (in the matmul of queries by keys)",
                      {(torch.Tensor, "__matmul__"): lambda f, c=factor: lambda a, b: f(a, b) * c(
                          a.shape[-1], a.shape[-1] ** -0.5),
                       (torch, "matmul"): lambda f, c=factor: lambda a, b, **k: f(a, b, **k) * c(
                           a.shape[-1], a.shape[-1] ** -0.5)})


MASK_SENSE = ("mask: the flax port reads the mask in the opposite sense, inverted (torch bool masks: True = masked in "
              "masked_fill / nn.MultiheadAttention, True = may attend in scaled_dot_product_attention and HF's "
              "masks; flax: True = may attend)")


def mistakes(root, eps_values: list[float]) -> Iterator[Mistake]:
    """The known porting mistakes for the torch module `root` (its subtree examined for
    activations, norms, square kernels and HF's rotary), most common first."""
    import torch
    import torch.nn.functional as F

    acts = {m: kind for m in root.modules() if (kind := activation_of(m)) is not None}
    norms = {m: n for m in root.modules() if (n := norm_of(m)) is not None}
    yield from _activation_variants(acts)
    for value in eps_values:
        yield _norm_eps(value, norms)
    yield from _norm_variants(norms)
    yield from _square_kernels(root)
    heads = ("heads: the flax port splits the features as (head_dim, heads) where torch splits "
             "(heads, head_dim)")
    yield Mistake(heads, {(torch.Tensor, "view"): _head_split, (torch.Tensor, "reshape"): _head_split})
    yield Mistake(heads + " (and merges them back the same way)",
                  {(torch.Tensor, "view"): _head_split_and_merge, (torch.Tensor, "reshape"): _head_split_and_merge})
    yield Mistake("GQA: the flax port tiles the key / value heads (query head h uses kv head h % num_kv_heads: "
                  "jnp.tile) where torch repeats them (h // (num_heads // num_kv_heads): repeat_kv, jnp.repeat)",
                  {(F, "scaled_dot_product_attention"): _gqa_sdpa, (torch, "matmul"): _gqa_matmul,
                   (torch.Tensor, "__matmul__"): _gqa_matmul})
    for says, patches in M.rotary_mistakes(root, ROTARY_HALVES):
        yield Mistake(says, patches)
    for says, swaps in M.rotary_bases(root):
        yield Mistake(says, swaps=swaps)
    for seen, hooks, forwards in M.block_mistakes(root):
        yield Mistake("{seen}", forwards=forwards, hooks=hooks, seen=seen)
    yield Mistake("mask: the flax port reads the padding mask in the opposite sense (nn.MultiheadAttention's "
                  "key_padding_mask: True = padding; flax's mask: True = may attend)",
                  {(F, "multi_head_attention_forward"): _mha_mask_flipped})
    dead: list = []
    yield Mistake(MASK_SENSE, args=_masks_changed(_flip_padding, False, dead), dead=dead)
    dead = []
    yield Mistake(MASK_SENSE, {(torch.Tensor, "masked_fill"): lambda f: lambda self, m, v: f(self, ~m, v),
                               (F, "scaled_dot_product_attention"): _sdpa(mask_change=_flip_padding, dead=dead)},
                  dead=dead)
    for offset, says in ((1, "each query also sees the next key (tril(k=1))"),
                         (-1, "no query sees its own key (tril(k=-1), or triu(k=0) as the masked part)")):
        sentence = f"causal mask: the flax port's is shifted by one: {says} where torch's is tril (k=0)"
        dead = []
        yield Mistake(sentence, args=_masks_changed(lambda keep, o=offset: _shift(keep, o), True, dead), dead=dead)
        dead = []
        yield Mistake(sentence, {(F, "scaled_dot_product_attention"): _sdpa(causal_offset=offset, dead=dead),
                                 (torch.Tensor, "masked_fill"): _future_shifted(offset, dead)}, dead=dead)
    yield Mistake("padding: the flax port pads the other side of the sequence (F.pad's (left, right) "
                  "read as (right, left): the future where torch pads the past, or the reverse)",
                  {(F, "pad"): lambda f: lambda x, pad, *a, **k: f(x, _swap_sides(pad), *a, **k)})
    yield from _scales(root)
    for offset in (1, -1):
        yield Mistake(f"positions off by one: the flax port's positions are torch's {offset:+d} (counted from "
                      f"{offset} where torch counts from 0{', or the reverse' if offset < 0 else ''})",
                      args=M.positions_shifted(offset))
    for d in sorted({4, 6, 8, 12, 16, 32, 64, 128, 256} | set(M.head_dims(root))):
        for c, said in ((1 / math.sqrt(d), f"an extra 1/sqrt({d})"), (math.sqrt(d), f"sqrt({d}) less")):
            yield Mistake(f"softmax scale: the flax port's attention logits carry {said} than torch's "
                          f"(a scale of 1/{d} for 1/sqrt({d}), or none)",
                          {(F, "softmax"): lambda f, c=c: lambda x, dim=None, *a, **k: f(x * c, dim, *a, **k),
                           (torch, "softmax"): lambda f, c=c: lambda x, dim=None, *a, **k: f(x * c, dim, *a, **k),
                           (torch.Tensor, "softmax"): lambda f, c=c: lambda self, dim=None, *a, **k: f(
                               self * c, dim, *a, **k)})
            yield Mistake(f"softmax scale: the flax port's attention logits (a matmul of queries and keys) "
                          f"carry {said} than torch's",
                          {(torch.Tensor, "__matmul__"): lambda f, c=c: lambda a, b: f(a, b) * c,
                           (torch, "matmul"): lambda f, c=c: lambda a, b, **k: f(a, b, **k) * c})
    for kind in ("conv1d", "conv2d"):
        for says, pad in (("'SAME' (k//2 each side)", lambda k: ((k - 1) // 2, k // 2)),
                          ("'VALID' (none)", lambda k: (0, 0)),
                          ("causally (k - 1 on the left)", lambda k: (k - 1, 0)),
                          ("k - 1 on both sides", lambda k: (k - 1, k - 1))):
            yield _conv(kind, pad, f"conv padding: the flax port pads {says} where torch pads otherwise")
