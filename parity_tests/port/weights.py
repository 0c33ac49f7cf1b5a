"""copy_weights: a torch module's parameters (and buffers) into its Flax NNX port.

Pairs by path (`blocks.1.fc2.weight` <-> `blocks[1].fc2.kernel`, an `nnx.Sequential`'s
`layers` level elided as torch's `nn.Sequential` has none) and by layer type, with the
layout transform each pair of layer types needs:

    nn.Linear              nnx.Linear             weight (out, in) -> kernel (in, out)
    nn.LayerNorm           nnx.LayerNorm          weight -> scale, bias -> bias
    nn.RMSNorm             nnx.RMSNorm            weight -> scale
    nn.Embedding           nnx.Embed              weight -> embedding
    nn.Conv1d/2d/3d        nnx.Conv               weight (out, in, *k) -> kernel (*k, in, out)
    nn.BatchNorm1d/2d      nnx.BatchNorm          weight, bias, running_mean, running_var
    nn.MultiheadAttention  nnx.MultiHeadAttention in_proj (3E, E) -> query/key/value (E, H, D),
                                                  out_proj (E, E) -> out (H, D, E)
    HF's Conv1D            nnx.Linear             weight (in, out) -> kernel as it is (GPT-2's layers)
    a hand-written norm    nnx.RMSNorm / LayerNorm weight -> scale, bias -> bias (LlamaRMSNorm and its
                                                  cousins: one weight vector, recognised by what it computes)

A parameter of any other module pairs with the Flax variable of the same path: equal shapes
copy as they are, a non-square matrix stored transposed is transposed, and a square matrix
is refused as ambiguous (its shape cannot say which orientation the code uses): give a rule.
Strict and atomic: every parameter on both sides is accounted for and every shape checked;
all problems are raised together (PortError) and nothing is written unless all is well.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


class PortError(ValueError):
    """A port's weights do not pair; `problems` lists each, naming the path on each side."""

    def __init__(self, problems: list[str], header: str = "cannot copy the weights"):
        self.problems = problems
        super().__init__(f"{header}: {len(problems)} problem(s)\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class Transform:
    """A named layout change from a torch tensor to its Flax variable (linear in the tensor, so
    gradients map through it too)."""

    name: str
    fn: Callable[[np.ndarray], np.ndarray]

    def __call__(self, a: np.ndarray) -> np.ndarray:
        return self.fn(np.asarray(a))

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return repr(self.name)


IDENTITY = Transform("identity", lambda a: a)
TRANSPOSE = Transform("transpose", lambda a: a.T)
CONV = Transform("conv kernel (out, in, *k) -> (*k, in, out)", lambda a: np.transpose(a, (*range(2, a.ndim), 1, 0)))
NAMED = {"identity": IDENTITY, "transpose": TRANSPOSE, "conv": CONV}
NO_BIAS = Transform("zeros: torch's norm has no bias", lambda a: np.zeros_like(a))  # not a gradient pair


class Copied(NamedTuple):
    """One pair: the torch name, the Flax path (dotted; None for a torch buffer the port
    computes instead of storing) and the transform applied."""

    torch_name: str
    flax_path: str | None
    transform: Transform | str


# ----------------------------------------------------------------------------------------
# The Flax side as dotted names
# ----------------------------------------------------------------------------------------


def flax_modules(module) -> dict[str, Any]:
    """Every submodule of an NNX module by its torch-style dotted name ('' for the root;
    an nnx.Sequential's `layers` level elided, as nn.Sequential has none)."""
    from flax import nnx

    out: dict[str, Any] = {}
    seen: set[int] = set()  # a module shared under two paths keeps its first
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module) and id(node) not in seen:
            seen.add(id(node))
            out[dotted(path, module)] = node
    return out


def flax_variables(module, kind=None) -> dict[str, Any]:
    """Every NNX Variable (of `kind`, default all) by dotted name."""
    from flax import nnx

    kind = kind or nnx.Variable
    out: dict[str, Any] = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, kind) and not isinstance(node, nnx.RngState):
            out.setdefault(dotted(path, module), node)
    return out


def dotted(path: tuple, root) -> str:
    """('seq', 'layers', 0, 'kernel') -> 'seq.0.kernel' when root.seq is an nnx.Sequential."""
    from flax import nnx

    parts, node = [], root
    for key in path:
        if not (isinstance(node, nnx.Sequential) and key == "layers"):
            parts.append(str(key))
        node = node[key] if isinstance(node, (list, tuple, nnx.List)) or isinstance(key, int) else getattr(node, key)
    return ".".join(parts)


def torch_units(module) -> dict[str, Any]:
    """Every torch submodule that holds parameters or buffers of its own, by name; a known
    layer (nn.MultiheadAttention) holds its children's (out_proj) too."""
    units: dict[str, Any] = {}
    absorbed: list[str] = []
    for name, m in module.named_modules():
        if any(name != a and _inside(name, a) for a in absorbed):
            continue
        if isinstance(m, _absorbing()):
            absorbed.append(name)
        if (isinstance(m, _absorbing()) or list(m.named_parameters(recurse=False))
                or list(m.named_buffers(recurse=False))):
            units[name] = m
    return units


def _inside(name: str, parent: str) -> bool:
    return parent == "" or name.startswith(parent + ".")


def _owner(key: str) -> str:
    return key.rsplit(".", 1)[0] if "." in key else ""


def _absorbing():
    import torch.nn as nn

    return (nn.MultiheadAttention,)


# ----------------------------------------------------------------------------------------
# Layer types
# ----------------------------------------------------------------------------------------


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _mha(tm, fm, name: str, fpath: str) -> tuple[list[tuple[str, str, Transform]], list[str]]:
    """nn.MultiheadAttention's packed projections onto nnx.MultiHeadAttention's per-head kernels."""
    problems = []
    if tm.num_heads != fm.num_heads:
        problems.append(f"torch {name} has {tm.num_heads} heads, flax {fpath} {fm.num_heads}")
        return [], problems
    e, h = tm.embed_dim, tm.num_heads
    d = e // h
    pairs: list[tuple[str, str, Transform]] = []
    for i, proj in enumerate(("query", "key", "value")):
        rows = slice(i * e, (i + 1) * e)
        if tm._qkv_same_embed_dim:
            pairs.append((_join(name, "in_proj_weight"), _join(fpath, proj, "kernel"),
                          Transform(f"in_proj rows {i * e}:{(i + 1) * e}, transposed to (in, {h}, {d})",
                                    lambda a, r=rows: a[r].T.reshape(-1, h, d))))
        else:
            pairs.append((_join(name, f"{proj[0]}_proj_weight"), _join(fpath, proj, "kernel"),
                          Transform(f"transposed to (in, {h}, {d})", lambda a: a.T.reshape(-1, h, d))))
        if tm.in_proj_bias is not None:
            pairs.append((_join(name, "in_proj_bias"), _join(fpath, proj, "bias"),
                          Transform(f"in_proj_bias {i * e}:{(i + 1) * e} as ({h}, {d})",
                                    lambda a, r=rows: a[r].reshape(h, d))))
    pairs.append((_join(name, "out_proj.weight"), _join(fpath, "out", "kernel"),
                  Transform(f"transposed to ({h}, {d}, out)", lambda a: a.T.reshape(h, d, -1))))
    if tm.out_proj.bias is not None:
        pairs.append((_join(name, "out_proj.bias"), _join(fpath, "out", "bias"), IDENTITY))
    if tm.bias_k is not None:
        problems.append(f"torch {name} has add_bias_kv=True, which nnx.MultiHeadAttention does not compute")
    return pairs, problems


def _flax_name(m) -> str:
    cls = type(m)
    return f"nnx.{cls.__name__}" if cls.__module__.startswith("flax.nnx") else f"{cls.__module__}.{cls.__name__}"


def _hf_conv1d() -> tuple:
    """transformers' Conv1D class when transformers is loaded (a model of it is in hand)."""
    conv = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return (conv,) if conv is not None else ()


def _is_nnx_builtin(m) -> bool:
    return type(m).__module__.startswith("flax.")


def _norm_pairs(tm, fm, name: str, fpath: str) -> tuple[list[tuple[str, str, Transform]], list[str]] | None:
    """A torch module holding one weight vector that computes a norm (LlamaRMSNorm, T5's,
    Gemma's, ...) facing nnx.RMSNorm or nnx.LayerNorm: weight -> scale, bias -> bias; None
    when `fm` is no NNX norm or `tm` computes no norm."""
    from flax import nnx

    from .behaviour import norm_of

    if not isinstance(fm, (nnx.RMSNorm, nnx.LayerNorm)):
        return None
    n = norm_of(tm)
    if n is None:
        return None
    params = dict(tm.named_parameters(recurse=False))
    weight = next(k for k, p in params.items() if "bias" not in k)
    bias = next((k for k in params if "bias" in k), None)
    f_bias = getattr(fm, "bias", None) is not None
    what = f"torch {name} ({type(tm).__name__}) computes {n.words()}"
    if bias is not None and not f_bias:
        return [], [f"{what} with a bias but flax {fpath} is {_flax_name(fm)} without one: nothing holds {bias}"]
    pairs = [(_join(name, weight), _join(fpath, "scale"), IDENTITY)]
    if bias is not None:
        pairs.append((_join(name, bias), _join(fpath, "bias"), IDENTITY))
    elif f_bias:  # a norm without a bias computes what one with a zero bias does
        pairs.append((_join(name, weight), _join(fpath, "bias"), NO_BIAS))
    return pairs, []


def _layer_pairs(tm, fm, name: str, fpath: str) -> tuple[list[tuple[str, str, Transform]], list[str]] | None:
    """The pairs of a known torch layer and its NNX counterpart; None for a module of no known
    type, or a known one facing a module of the port's own (paired by name then). A known
    torch layer facing another NNX type is a problem naming both."""
    import torch.nn as nn
    from flax import nnx

    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    table: list[tuple[Any, Any, dict[str, tuple[str, Transform]], str]] = [
        (nn.Linear, nnx.Linear, {"weight": ("kernel", TRANSPOSE), "bias": ("bias", IDENTITY)}, "a linear layer"),
        (_hf_conv1d(), nnx.Linear, {"weight": ("kernel", IDENTITY), "bias": ("bias", IDENTITY)},
         "a linear layer storing its weight (in, out)"),
        (nn.LayerNorm, nnx.LayerNorm, {"weight": ("scale", IDENTITY), "bias": ("bias", IDENTITY)},
         "it subtracts the mean"),
        (nn.RMSNorm, nnx.RMSNorm, {"weight": ("scale", IDENTITY)}, "it does not subtract the mean"),
        (nn.Embedding, nnx.Embed, {"weight": ("embedding", IDENTITY)}, "an embedding"),
        (conv, nnx.Conv, {"weight": ("kernel", CONV), "bias": ("bias", IDENTITY)}, "a convolution"),
        (bn, nnx.BatchNorm, {"weight": ("scale", IDENTITY), "bias": ("bias", IDENTITY),
                             "running_mean": ("mean", IDENTITY), "running_var": ("var", IDENTITY)}, "a BatchNorm"),
    ]
    if isinstance(tm, nn.MultiheadAttention):
        if not isinstance(fm, nnx.MultiHeadAttention):
            if not _is_nnx_builtin(fm):
                return None
            return [], [f"torch {name} is nn.MultiheadAttention but flax {fpath or '(root)'} is "
                        f"{_flax_name(fm)}, not nnx.MultiHeadAttention"]
        return _mha(tm, fm, name, fpath)
    for ttype, ftype, names, what in table:
        if ttype and isinstance(tm, ttype):
            if not isinstance(fm, ftype) and not _is_nnx_builtin(fm):
                return None  # a module of the port's own: its variables by name
            if not isinstance(fm, ftype):
                kind = f"nn.{type(tm).__name__}" if type(tm).__module__.startswith("torch") else type(tm).__name__
                return [], [f"torch {name or '(root)'} is {kind} ({what}) but flax {fpath or '(root)'} "
                            f"is {_flax_name(fm)}, not nnx.{ftype.__name__}"]
            pairs = [(_join(name, t), _join(fpath, f), tf) for t, (f, tf) in names.items()
                     if getattr(tm, t, None) is not None]
            return pairs, []
    return _norm_pairs(tm, fm, name, fpath)


# ----------------------------------------------------------------------------------------
# copy_weights
# ----------------------------------------------------------------------------------------

Rule = tuple[str, "str | None", "str | Callable[[np.ndarray], np.ndarray] | Transform"]


def _rules(rules, state: dict, problems: list[str]) -> tuple[list, set[str]]:
    """The pairs the rules say, and the torch names they cover."""
    pairs: list[tuple[str, str | None, Transform | str]] = []
    ruled: set[str] = set()
    for pattern, target, transform in rules or []:
        hits = [n for n in state if re.fullmatch(pattern, n)]
        if not hits:
            problems.append(f"rule {pattern!r} matches no torch parameter or buffer")
        for n in hits:
            ruled.add(n)
            if target is None:
                pairs.append((n, None, "not copied (a rule says the port computes it)"))
                continue
            tf = NAMED.get(transform, transform) if isinstance(transform, str) else transform
            if isinstance(transform, str) and transform not in NAMED:
                raise ValueError(f"rule {pattern!r}: transform {transform!r} is not one of {sorted(NAMED)} "
                                 "or a callable")
            if not isinstance(tf, Transform):
                tf = Transform(getattr(tf, "__name__", "rule"), tf)
            pairs.append((n, re.sub(pattern, target, n), tf))
    return pairs, ruled


def _by_name(k: str, v, fv, ruled: set[str], params: set[str]) -> tuple[tuple | None, str | None]:
    """A parameter of a module of no known type paired with the Flax variable of its path:
    (pair, problem)."""
    if fv is None:
        if k in params:
            return None, f"torch parameter {k} {tuple(v.shape)} has no flax variable at {k}"
        return (k, None, "not copied (a buffer the flax port does not store)"), None
    ts, fs = tuple(v.shape), tuple(fv.get_value().shape)
    if v.ndim == 2 and ts[0] == ts[1] and k not in ruled:
        return None, (f"torch parameter {k} {ts} is square: its shape cannot say whether flax {k} holds it "
                      f"as is or transposed; give a rule, e.g. rules=[({re.escape(k)!r}, {k!r}, 'transpose')]")
    if v.ndim == 2 and ts != fs and ts[::-1] == fs:
        return (k, k, TRANSPOSE), None
    return (k, k, IDENTITY), None  # a wrong shape is named by the shape check


def _by_shape(own: list[str], name: str, state: dict, fvars: dict, params: set[str]) -> dict[str, str]:
    """A module's parameters that have no Flax variable of their name, paired with its Flax
    variables of no torch name when each shape is held once on each side (a hand-written
    norm's `weight` against the port's `scale`)."""
    lost = [k for k in own if k in params and k not in fvars]
    taken = {k for k in own if k in fvars}
    free = [v for v in fvars if _owner(v) == name and v not in taken and v.rsplit(".", 1)[-1] not in ("rngs",)]
    shapes = [tuple(state[k].shape) for k in lost]
    fshapes = [tuple(fvars[v].get_value().shape) for v in free]
    if not lost or len(lost) != len(free) or len(set(shapes)) != len(shapes) or sorted(shapes) != sorted(fshapes):
        return {}
    return {k: free[fshapes.index(tuple(state[k].shape))] for k in lost}


def _nearest(name: str, candidates: list[str]) -> str | None:
    """The candidate path most like `name`, when one is alike enough."""
    best = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return best[0] if best else None


def _renamed(missing: list[str], fmods: dict, fparams: set[str], taken: set[str]) -> tuple[dict[str, str], str | None]:
    """For torch modules with no flax module at their path: the nearest flax module holding
    parameters (not at a torch path), and a sentence naming a rename several of them share
    (torch `h.` is flax `blocks.`)."""
    holders = sorted({k.rsplit(".", 1)[0] if "." in k else "" for k in fparams})
    free = [h for h in holders if h not in taken and h in fmods]
    near = {m: n for m in missing if (n := _nearest(m, free)) is not None}
    renames: dict[tuple[str, str], int] = {}
    for t, f in near.items():
        a, b = t.split("."), f.split(".")
        k = 0
        while k < min(len(a), len(b)) and a[-1 - k] == b[-1 - k]:
            k += 1
        if k:
            key = (".".join(a[:len(a) - k]), ".".join(b[:len(b) - k]))
            key = (re.sub(r"\d+", "N", key[0]), re.sub(r"\d+", "N", key[1]))
            renames[key] = renames.get(key, 0) + 1
    if not renames:
        return near, None
    (t, f), n = max(renames.items(), key=lambda kv: kv[1])
    if n < 2:
        return near, None
    return near, (f"the port's names look renamed: torch {t or '(root)'!r} is flax {f or '(root)'!r} in {n} "
                  f"modules (copy_weights pairs by path: name the port's attributes as torch's, or give rules)")


def plan(torch_module, flax_module, rules: list[Rule] | None = None) -> list[Copied]:
    """The pairs copy_weights would write, checked (shapes, every parameter on both sides);
    raises PortError listing every problem once (each torch or flax parameter named in one
    problem at most; an unmatched path with the nearest one on the other side)."""
    import torch
    from flax import nnx

    if not isinstance(torch_module, torch.nn.Module):
        raise TypeError(f"copy_weights: expected a torch.nn.Module first, got {type(torch_module).__name__}")
    if not isinstance(flax_module, nnx.Module):
        raise TypeError(f"copy_weights: expected a flax.nnx.Module second, got {type(flax_module).__name__}")
    state = torch_module.state_dict(keep_vars=True)
    params = {n for n, _ in torch_module.named_parameters()}
    fvars = flax_variables(flax_module)
    fparams = {k for k, v in fvars.items() if isinstance(v, nnx.Param)}
    fmods = flax_modules(flax_module)
    problems: list[str] = []
    named_t: set[str] = set()  # torch names a problem already names
    named_f: set[str] = set()

    first: dict[int, str] = {}
    tied: dict[str, str] = {}  # a name that shares its tensor with an earlier one (GPT-2's head and embedding)
    for k, v in state.items():
        if id(v) in first:
            tied[k] = first[id(v)]
        else:
            first[id(v)] = k
    pairs, ruled = _rules(rules, state, problems)

    missing: dict[str, tuple[Any, list[str]]] = {}
    units = torch_units(torch_module)
    for name, tm in units.items():
        absorbing = isinstance(tm, _absorbing())
        own = sorted(k for k in state if k not in ruled and (_owner(k) == name or (absorbing and _inside(k, name))))
        if not own:
            continue
        fm = fmods.get(name)
        if fm is None and all(k in tied for k in own):  # a tied head the port computes from its embedding
            pairs += [(k, None, f"not copied (tied to {tied[k]}, which is)") for k in own]
            continue
        if fm is None:
            missing[name] = (tm, own)
            named_t.update(own)
            continue
        layer = _layer_pairs(tm, fm, name, name)
        if layer is not None:
            got, bad = layer
            problems += bad
            if bad:
                named_t.update(own)
                named_f.update(k for k in fparams if _owner(k) == name)
            pairs += [(t, f, tf) for t, f, tf in got if t not in ruled]
            if isinstance(tm, torch.nn.modules.batchnorm._BatchNorm):
                pairs.append((_join(name, "num_batches_tracked"), None,
                              "not copied (a counter nnx.BatchNorm does not keep)"))
            continue
        renamed = _by_shape(own, name, state, fvars, params)
        for k in own:  # a module of no known type: by name, orientation by shape
            if k in renamed:
                pairs.append((k, renamed[k], IDENTITY))
                continue
            pair, bad = _by_name(k, state[k], fvars.get(k), ruled, params)
            if bad:
                have = sorted(v.rsplit(".", 1)[-1] for v in fvars if _owner(v) == name)
                problems.append(bad + (f" (flax {name or '(root)'} holds: {', '.join(have)})"
                                       if have and "no flax variable" in bad else ""))
                named_t.add(k)
            if pair is not None:
                pairs.append(pair)

    near, rename = _renamed(list(missing), fmods, fparams, set(units))
    if rename:
        problems.insert(0, rename)
    for name, (tm, own) in missing.items():
        hint = f"; nearest flax module: {near[name]}" if name in near else ""
        problems.append(f"torch {name or '(root)'} ({type(tm).__name__}: "
                        f"{', '.join(k.rsplit('.', 1)[-1] for k in own)}) has no flax module at {name or '(root)'}"
                        + hint)
        if name in near:
            named_f.update(k for k in fparams if _owner(k) == near[name])

    out: list[Copied] = []
    used_f: set[str] = set()
    used_t = {t for t, _, _ in pairs}
    for t, f, tf in pairs:
        if f is None:
            out.append(Copied(t, None, tf))
            continue
        fv = fvars.get(f)
        if fv is None:
            problems.append(f"torch {t} -> flax {f}: no such flax variable")
            named_t.add(t)
            continue
        used_f.add(f)
        try:
            shape = tf(state[t].detach().cpu().numpy()).shape
        except Exception as e:  # a transform that cannot apply names the pair
            problems.append(f"torch {t} {tuple(state[t].shape)} -> flax {f}: {tf} fails ({e})")
            continue
        if shape != tuple(fv.get_value().shape):
            problems.append(f"torch {t} {tuple(state[t].shape)} -> flax {f}: {tf} gives {shape}, "
                            f"flax holds {tuple(fv.get_value().shape)}")
        out.append(Copied(t, f, tf))
    for t in sorted(params - used_t - named_t):
        problems.append(f"torch parameter {t} {tuple(state[t].shape)} is not copied anywhere")
    left = sorted(fparams - used_f - named_f)
    torch_left = sorted(params - used_t)
    for f in left:
        hint = _nearest(f, torch_left)
        problems.append(f"flax parameter {f} {tuple(fvars[f].get_value().shape)} is filled from no torch parameter"
                        + (f"; nearest torch parameter: {hint}" if hint else ""))
    if problems:
        raise PortError(list(dict.fromkeys(problems)))
    return out


def copy_weights(torch_module, flax_module, rules: list[Rule] | None = None) -> list[Copied]:
    """Copy every parameter (and stored buffer) of `torch_module` into `flax_module`, its NNX
    port; returns the pairs as (torch name, flax path, transform).

    rules: (regex on the torch name, target Flax path (regex backrefs allowed; None: the
    port computes it, not copied), transform: 'identity' / 'transpose' / 'conv' or a
    function of a numpy array), tried before the built-in pairing. Raises PortError naming
    every problem (unpaired, mistyped, misshaped, ambiguous) before anything is written."""
    import jax.numpy as jnp

    pairs = plan(torch_module, flax_module, rules)
    state = torch_module.state_dict()
    fvars = flax_variables(flax_module)
    new = {f: jnp.asarray(tf(state[t].detach().cpu().numpy()), dtype=fvars[f].get_value().dtype)
           for t, f, tf in pairs if f is not None}
    for f, v in new.items():
        fvars[f].set_value(v)
    return pairs
