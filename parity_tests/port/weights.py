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

A parameter of any other module pairs with the Flax variable of the same path: equal shapes
copy as they are, a non-square matrix stored transposed is transposed, and a square matrix
is refused as ambiguous (its shape cannot say which orientation the code uses): give a rule.
Strict and atomic: every parameter on both sides is accounted for and every shape checked;
all problems are raised together (PortError) and nothing is written unless all is well.
"""

from __future__ import annotations

import re
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


def _layer_pairs(tm, fm, name: str, fpath: str) -> tuple[list[tuple[str, str, Transform]], list[str]] | None:
    """The pairs of a known torch layer and its NNX counterpart; None for a module of no known
    type. A known torch layer facing another NNX type is a problem naming both."""
    import torch.nn as nn
    from flax import nnx

    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    table: list[tuple[Any, Any, dict[str, tuple[str, Transform]], str]] = [
        (nn.Linear, nnx.Linear, {"weight": ("kernel", TRANSPOSE), "bias": ("bias", IDENTITY)}, "a linear layer"),
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
            return [], [f"torch {name} is nn.MultiheadAttention but flax {fpath or '(root)'} is "
                        f"{_flax_name(fm)}, not nnx.MultiHeadAttention"]
        return _mha(tm, fm, name, fpath)
    for ttype, ftype, names, what in table:
        if isinstance(tm, ttype):
            if not isinstance(fm, ftype):
                return [], [f"torch {name or '(root)'} is nn.{type(tm).__name__} ({what}) but flax {fpath or '(root)'} "
                            f"is {_flax_name(fm)}, not nnx.{ftype.__name__}"]
            pairs = [(_join(name, t), _join(fpath, f), tf) for t, (f, tf) in names.items()
                     if getattr(tm, t, None) is not None]
            return pairs, []
    return None


# ----------------------------------------------------------------------------------------
# copy_weights
# ----------------------------------------------------------------------------------------

Rule = tuple[str, "str | None", "str | Callable[[np.ndarray], np.ndarray] | Transform"]


def plan(torch_module, flax_module, rules: list[Rule] | None = None) -> list[Copied]:
    """The pairs copy_weights would write, checked (shapes, every parameter on both sides);
    raises PortError listing every problem."""
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
    pairs: list[tuple[str, str | None, Transform | str]] = []
    problems: list[str] = []

    first: dict[int, str] = {}
    tied: dict[str, str] = {}  # a name that shares its tensor with an earlier one (GPT-2's head and embedding)
    for k, v in state.items():
        if id(v) in first:
            tied[k] = first[id(v)]
        else:
            first[id(v)] = k
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

    for name, tm in torch_units(torch_module).items():
        absorbing = isinstance(tm, _absorbing())
        own = sorted(k for k in state if k not in ruled and (_owner(k) == name or (absorbing and _inside(k, name))))
        if not own:
            continue
        fm = fmods.get(name)
        if fm is None and all(k in tied for k in own):  # a tied head the port computes from its embedding
            pairs += [(k, None, f"not copied (tied to {tied[k]}, which is)") for k in own]
            continue
        if fm is None:
            problems.append(f"torch {name or '(root)'} "
                            f"({type(tm).__name__}: {', '.join(k.rsplit('.', 1)[-1] for k in own)}) "
                            f"has no flax module at {name or '(root)'}")
            continue
        layer = _layer_pairs(tm, fm, name, name)
        if layer is not None:
            got, bad = layer
            problems += bad
            for t, f, tf in got:
                if t not in ruled:
                    pairs.append((t, f, tf))
            if isinstance(tm, torch.nn.modules.batchnorm._BatchNorm):
                pairs.append((_join(name, "num_batches_tracked"), None,
                              "not copied (a counter nnx.BatchNorm does not keep)"))
            continue
        for k in own:  # a module of no known type: by name, orientation by shape
            v = state[k]
            fv = fvars.get(k)
            if fv is None:
                if k in params:
                    problems.append(f"torch parameter {k} {tuple(v.shape)} has no flax variable at {k}")
                else:
                    pairs.append((k, None, "not copied (a buffer the flax port does not store)"))
                continue
            ts, fs = tuple(v.shape), tuple(fv.get_value().shape)
            if v.ndim == 2 and ts[0] == ts[1] and k not in ruled:
                problems.append(f"torch parameter {k} {ts} is square: its shape cannot say whether flax {k} holds it "
                                f"as is or transposed; give a rule, e.g. "
                                f"rules=[({re.escape(k)!r}, {k!r}, 'transpose')]")
            elif ts == fs:
                pairs.append((k, k, IDENTITY))
            elif v.ndim == 2 and ts[::-1] == fs:
                pairs.append((k, k, TRANSPOSE))
            else:
                pairs.append((k, k, IDENTITY))  # the shape check below names it

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
    for t in sorted(params - used_t):
        problems.append(f"torch parameter {t} {tuple(state[t].shape)} is not copied anywhere")
    for f in sorted(fparams - used_f):
        problems.append(f"flax parameter {f} {tuple(fvars[f].get_value().shape)} is filled from no torch parameter")
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
