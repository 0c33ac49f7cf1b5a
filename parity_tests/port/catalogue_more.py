"""More porting mistakes for the explainer (catalogue.py yields them): rotary pairing either
way and rotary on the wrong slice of the head, a parallel block run sequentially and the
reverse (and a norm read for the wrong branch, or twice), the softmax scale from the shapes
and the config (1/d, none, doubled, `query_pre_attn_scalar`), positions off by one.

Each is made by replaying torch's own code with the mistake in it, so a name is printed only
where the replay reproduces what the port computes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from .behaviour import norm_of
from .record import map_nested

ROTARY_NEIGHBOURS = ("rotary: the flax port rotates halves (i, i + D/2: HF's rotate_half) where torch rotates "
                     "adjacent feature pairs (2i, 2i + 1: GPT-J's and CodeGen's rotate_every_two)")
ROTARY_SLICE = ("rotary: the flax port rotates the last {r} features of each head where torch rotates the first {r} "
                "(partial rotary: x[..., :rotary_dim] rotated, the rest passed)")


# ----------------------------------------------------------------------------------------
# Rotary
# ----------------------------------------------------------------------------------------


def rotary_functions(root) -> list[tuple[Any, str, str]]:
    """(python module, "apply_rotary_pos_emb", pairing) for the modelling files of the
    subtree's classes: pairing "halves" where the file rotates with rotate_half,
    "neighbours" where with rotate_every_two."""
    found: list[tuple[Any, str, str]] = []
    for m in root.modules():
        mod = sys.modules.get(type(m).__module__)
        if not callable(getattr(mod, "apply_rotary_pos_emb", None)) or any(f[0] is mod for f in found):
            continue
        if callable(getattr(mod, "rotate_every_two", None)):
            found.append((mod, "apply_rotary_pos_emb", "neighbours"))
        elif callable(getattr(mod, "rotate_half", None)):
            found.append((mod, "apply_rotary_pos_emb", "halves"))
    return found


def _features_moved(pairing: str, how: str) -> Callable[[Callable], Callable]:
    """apply_rotary_pos_emb with the rotated tensors' features permuted before and back after:
    how "pairing" makes torch's pairing the other one (halves <-> neighbours, the same
    frequencies); how "slice" rotates the last r features where torch rotates the first r."""
    def make(f):
        def apply(*args, **kw):
            import torch

            heads = [a for a in args if isinstance(a, torch.Tensor) and a.ndim == 4]
            table = min((a for a in args if isinstance(a, torch.Tensor) and a.ndim < 4 and a.is_floating_point()),
                        key=lambda a: a.shape[-1])
            r = table.shape[-1] * (2 if pairing == "neighbours" else 1)
            d = heads[0].shape[-1]
            if how == "pairing":
                if pairing == "halves":
                    order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
                else:
                    order = torch.stack([torch.arange(r // 2), torch.arange(r // 2) + r // 2], -1).flatten()
                order = torch.cat([order, torch.arange(r, d)])
            else:
                if r >= d:
                    raise LookupError("the whole head is rotated")
                order = torch.cat([torch.arange(d - r, d), torch.arange(d - r)])
            back = torch.argsort(order)
            moved = [a[..., order] if any(a is h for h in heads) else a for a in args]
            out = f(*moved, **kw)
            return map_nested(lambda o: o[..., back] if isinstance(o, torch.Tensor) and o.ndim == 4 else o, out)
        return apply
    return make


def rotary_mistakes(root, halves_says: str) -> Iterator[tuple[str, dict]]:
    """(sentence, patches) for the rotary pairing made the other way, and for a partial
    rotary applied to the head's last features."""
    for owner, name, pairing in rotary_functions(root):
        said = halves_says if pairing == "halves" else ROTARY_NEIGHBOURS
        yield said, {(owner, name): _features_moved(pairing, "pairing")}
        if pairing == "halves":
            yield ROTARY_SLICE.format(r="rotary_dim"), {(owner, name): _features_moved(pairing, "slice")}


def rotary_bases(root) -> Iterator[tuple[str, list]]:
    """(sentence, swaps) for a rotary base (rope_theta) other than torch's: every `inv_freq`
    buffer of the subtree recomputed from it."""
    import torch

    tables = [b for m in root.modules() if (b := m._buffers.get("inv_freq")) is not None
              and b.is_floating_point() and b.ndim == 1 and b.numel() > 1]
    if not tables:
        return
    dim = 2 * tables[0].numel()
    theta = float(tables[0][1]) ** (-dim / 2)
    for base in (1e4, 1e5, 5e5, 1e6):
        if abs(base / theta - 1) < 1e-3:
            continue
        swaps = [(b, (1.0 / base ** (torch.arange(0, 2 * b.numel(), 2, dtype=torch.float64) / (2 * b.numel())))
                  .to(b.dtype)) for b in tables]
        yield f"rotary: the flax port's rotary base (rope_theta) is {base:g} where torch's is {theta:.4g}", swaps


# ----------------------------------------------------------------------------------------
# Blocks: parallel and sequential, the norm each branch reads
# ----------------------------------------------------------------------------------------


def _first_tensor(args: tuple, kwargs: dict):
    import torch

    for a in list(args) + [kwargs.get("hidden_states")]:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a
    return None


def _branches(root) -> tuple[Any, Any, dict[str, Any]] | None:
    """(attention-like child, MLP-like child, norm children by name) of a block: its first two
    children holding parameters that are not norms, and its norms; None where it has not."""
    kids = [(n, m) for n, m in root.named_children() if any(True for _ in m.parameters())]
    norms = {n: m for n, m in kids if norm_of(m) is not None}
    rest = [m for n, m in kids if n not in norms]
    if len(rest) < 2 or not norms:
        return None
    return rest[0], rest[1], norms


def block_mistakes(root) -> Iterator[tuple[list[str], list[tuple[Any, str, Callable]], dict]]:
    """(seen, hooks, forwards) for each way a port feeds a block's second branch (its MLP)
    another input than torch: norm(x + attn) where torch's block is parallel (run
    sequentially), norm(x) where it is sequential (run in parallel), another norm's output,
    or its input normalised again. The sentence is written in `seen` when the replay runs,
    from what torch's own block feeds the MLP."""
    found = _branches(root)
    if found is None:
        return
    attn, mlp, norms = found
    names = {id(m): n for n, m in root.named_children()}
    for which in ("sequential", "parallel", "again"):
        for nname, norm in norms.items():
            seen: list[str] = []
            box: dict[str, Any] = {}

            def grab_x(mod, args, kwargs, box=box):
                box["x"] = _first_tensor(args, kwargs)

            def grab_a(mod, args, out, box=box):
                box["a"] = out[0] if isinstance(out, tuple) else out

            def wrong(h, *a, _which=which, _norm=norm, _nname=nname, _box=box, _seen=seen, **k):
                x, att = _box["x"], _box["a"]
                new = {"sequential": lambda: _norm(x + att), "parallel": lambda: _norm(x),
                       "again": lambda: _norm(h)}[_which]()
                _seen.append(_sentence(_which, h, x, att, norms, _nname, names[id(attn)], names[id(mlp)]))
                return type(mlp).forward(mlp, new, *a, **k)
            yield seen, [(root, "pre", grab_x), (attn, "post", grab_a)], {mlp: wrong}


def _sentence(which: str, h, x, att, norms: dict, nname: str, aname: str, mname: str) -> str:
    """What the port does, said against what torch's block does (read from its own input to
    the MLP: some norm of x, parallel; of x + attn, sequential)."""
    import torch

    own = None
    h, x, att = h.detach(), x.detach(), att.detach()
    for n, m in norms.items():
        for form, v in (("parallel", x), ("sequential", x + att)):
            with torch.no_grad():
                near = torch.allclose(m(v), h, rtol=0, atol=1e-12 * max(1.0, float(h.abs().max())))
            if own is None and near:
                own = (form, n)
    if which == "again":
        return (f"norm read twice: the flax port normalises {mname}'s input again with {nname} (x -> {nname}(norm(x)))"
                f" where torch normalises it once")
    if own is None:  # torch's block is neither form: say what the port computes only
        fed = {"sequential": f"{nname}(x + {aname}(...))", "parallel": f"{nname}(x)"}[which]
        return f"block: the flax port feeds {mname} {fed}, the block's input x, where torch feeds it something else"
    form, tnorm = own
    if tnorm != nname and which == form:
        return (f"norm: the flax port feeds {mname} the output of {nname} where torch feeds it {tnorm}'s (a norm of "
                f"one branch read for the other)")
    if form == "parallel":
        return (f"block: the flax port runs a parallel block sequentially: it feeds {mname} {nname}(x + {aname}(...))"
                f" where torch's block computes x + {aname}({tnorm}(x)) + {mname}({tnorm}(x)) (GPT-J, GPT-NeoX, "
                f"Falcon, Phi: both branches read the same input)")
    return (f"block: the flax port runs a sequential block in parallel: it feeds {mname} {nname}(x) where torch "
            f"feeds it {tnorm}(x + {aname}(...)) (the attention's residual added first)")


# ----------------------------------------------------------------------------------------
# Softmax scale, positions
# ----------------------------------------------------------------------------------------


def head_dims(root) -> list[int]:
    """Head sizes the subtree states (head_dim / head_size / attention_head_size / d_kv
    attributes, and its config's hidden_size / num_attention_heads)."""
    out: set[int] = set()
    for m in root.modules():
        for obj in (m, getattr(m, "config", None)):
            for k in ("head_dim", "head_size", "attention_head_size", "d_kv"):
                v = getattr(obj, k, None)
                if isinstance(v, int) and v > 1:
                    out.add(v)
            hs, nh = getattr(obj, "hidden_size", None), getattr(obj, "num_attention_heads", None)
            if isinstance(hs, int) and isinstance(nh, int) and nh > 0 and hs % nh == 0:
                out.add(hs // nh)
    return sorted(out)


def pre_attn_scalars(root) -> list[float]:
    """The configs' query_pre_attn_scalar values in the subtree (Gemma 2, Gemma 3)."""
    out = set()
    for m in root.modules():
        v = getattr(getattr(m, "config", None), "query_pre_attn_scalar", None)
        if isinstance(v, (int, float)) and v > 0:
            out.add(float(v))
    return sorted(out)


def scale_factors(root) -> Iterator[tuple[str, Callable[[int, float], float]]]:
    """(sentence, factor(d, torch's scale)) for the attention logits of a port: the factor the
    port's logits carry over torch's (1/d and no scale are catalogue.py's own)."""
    yield "softmax scale: the flax port scales the attention logits twice (the scale applied doubled)", lambda d, s: s
    yield ("softmax scale: the flax port scales the attention logits by 1/sqrt(head_dim) where torch does not scale "
           "them (T5's attention: the scale is folded into its initialisation)", lambda d, s: _unscaled(s, d ** -0.5))
    for v in pre_attn_scalars(root):
        yield (f"softmax scale: the flax port scales by 1/sqrt(head_dim) where torch scales by "
               f"1/sqrt(query_pre_attn_scalar) (config.query_pre_attn_scalar = {v:g})",
               lambda d, s, v=v: (d ** -0.5) / (v ** -0.5))
        yield (f"softmax scale: the flax port scales by 1/sqrt(query_pre_attn_scalar) ({v:g}) where torch scales by "
               f"1/sqrt(head_dim)", lambda d, s, v=v: (v ** -0.5) / (d ** -0.5))


def _unscaled(s: float, factor: float) -> float:
    """`factor`, where torch's scale is 1 as the sentence says; else no replay."""
    if s != 1.0:
        raise LookupError("torch scales its logits")
    return factor


def positions_shifted(offset: int) -> Callable[[tuple, dict], tuple[tuple, dict]]:
    """The replayed call's arguments with every position-like integer tensor (counting up by
    one along its last axis) moved by `offset`."""
    import torch

    def go(args, kwargs):
        hit = [False]

        def one(t):
            if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool \
                    and t.ndim >= 1 and t.shape[-1] > 1 and bool((t.diff(dim=-1) == 1).all()):
                hit[0] = True
                return t + offset
            return t

        out = map_nested(one, (args, kwargs))
        if not hit[0]:
            raise LookupError("no positions among the arguments")
        return out
    return go
