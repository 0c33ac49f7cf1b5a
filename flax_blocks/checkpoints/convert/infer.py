"""What a torch-named state dict says about the config that made it (`infer_config`),
read from the declarations: which parameter names exist under which option."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from ...core import declarations
from ...core.declarations import FINAL_NORM, Param
from ...core.options import PROBE, PROBES
from ..io import read_state_dict
from .place import BLOCK_KINDS, LAYER


# The declarations of the probe configs never change: each answer below is computed once per
# process (a load then reads them without re-deriving every block's parameters).
@functools.cache
def _names(kind: str, **options: Any) -> Mapping[str, Param]:
    """Every name a layer of block `kind` may hold under the probe config with `options` applied (both
    MLPs of a mixed stack's layers: `declarations.block`'s mlp=None)."""
    block = declarations.block(replace(PROBE, **options), kind)
    return MappingProxyType({t: p for t, _, p in declarations.flatten(block)})


@functools.cache
def _only_with(kind: str, **options: Any) -> frozenset[str]:
    """Names that exist with the probe config and vanish when `options` are applied."""
    return frozenset(_names(kind)) - frozenset(_names(kind, **options))


@functools.cache
def _only_in_probes(kind: str) -> frozenset[str]:
    """Names of the other probes (values refused beside PROBE's, as DyT's alpha) that PROBE lacks."""
    return frozenset(t for probe in PROBES[1:] for t, _, _ in declarations.flatten(declarations.block(probe, kind))
                     ) - frozenset(_names(kind))


@dataclass
class ConfigReport:
    """What a torch-named state dict says about the config that made it."""

    inferred: dict[str, Any] = field(default_factory=dict)
    unknown: tuple[str, ...] = ("num_heads", "norm (pre or post)", "activation", "layer_norm_eps", "causal", "dropout")

    def __str__(self) -> str:
        known = ", ".join(f"{k}={v!r}" for k, v in self.inferred.items())
        return f"inferred: {known}\ncannot be inferred (give them to BlockConfig): {', '.join(self.unknown)}"


def _block_kind(roots: set[str]) -> str | None:
    """The block kind whose sublayers' main modules are all among the key roots (the
    largest such kind first)."""
    for kind in sorted(BLOCK_KINDS, key=lambda k: -len(declarations.BLOCKS[k])):
        if all(sub.modules[0] in roots for sub in declarations.BLOCKS[kind]):
            return kind
    return None


def infer_config(source: Any, *, prefix: str = "") -> ConfigReport:
    """Read a torch-named state dict and report what it fixes: kind, d_model, d_ff
    (head_dim with QK-norm), num_layers, bias, qkv_bias, final_norm, norms present and
    their placement (peri) and type (DyT from its alpha), gated MLP, QK-norm, residual
    scaling, dtype."""
    sd = strip_prefix(read_state_dict(source, lazy=True), norm_prefix(prefix))
    layers = sorted({int(m.group(1)) for n in sd if (m := LAYER.match(n))})
    inner = {(m.group(2) if (m := LAYER.match(n)) else n): a for n, a in sd.items()}
    if layers:
        inner = {n: a for n, a in inner.items() if not n.startswith(f"{FINAL_NORM}.")}
    info: dict[str, Any] = {}
    kind = _block_kind({n.split(".")[0] for n in inner})
    if layers:
        stacks: dict[str | None, str] = {block: name for name, block in declarations.STACKS.items()}
        stack = stacks.get(kind, "Encoder")
        info.update(kind=stack, num_layers=len(layers), final_norm=f"{FINAL_NORM}.weight" in sd)
        kind = declarations.STACKS[stack]
    elif kind is not None:
        info["kind"] = kind
    if kind is not None:
        declared = _names(kind)
        for name, a in inner.items():  # each dimension that is a config field
            p = declared.get(name)
            if p is not None and len(p.dims) == a.ndim:
                for dim, size in zip(p.dims, a.shape, strict=True):
                    if dim is not None:
                        info.setdefault(dim, int(size))

        def has(names: AbstractSet[str]) -> bool:
            return any(n in inner for n in names)

        # `bias` from the biases that follow it alone (out_proj's: the probe fixes qkv_bias, mlp_bias and
        # norm_bias); a FeedForward has none such and says its MLP's (which then follow `bias`)
        own = _only_with(kind, bias=False) or _only_with(kind, bias=False, mlp_bias=None)
        info["bias"] = has(own - _only_with(kind, norm_type="rmsnorm"))
        if has(_only_with(kind, qkv_bias=False)) != info["bias"]:
            info["qkv_bias"] = not info["bias"]  # recorded only where it departs from `bias`
        info["layer_norms"] = has(_only_with(kind, norm="none"))
        if has(_only_with(kind, norm="pre")):
            info["norm"] = "peri"
        info["gated_mlp"] = has(_only_with(kind, mlp="dense", activation="relu"))
        info["qk_norm"] = has(_only_with(kind, qk_norm=False))
        for option in ("attn_sinks", "experts_bias"):  # GPT-OSS's sinks, its experts' biases: recorded when there
            if has(_only_with(kind, **{option: False})):
                info[option] = True
        if has(_only_in_probes(kind)):  # DyT's alpha (its bias and weight are LayerNorm's names)
            info["norm_type"] = "dyt"
        elif info["bias"] and info["layer_norms"]:
            info["norm_type"] = "layernorm" if has(_only_with(kind, norm_type="rmsnorm")) else "rmsnorm"
        gates = [a for n, a in inner.items() if n in _only_with(kind, scaling="none")]
        if gates:
            info["scaling"] = "rezero" if gates[0].ndim == 0 else "layerscale"
        if "head_dim" in info and "d_model" in info:
            rows = next((a.shape[0] for n, a in inner.items() if declared.get(n) is not None
                         and declared[n].transform is declarations.QKV_WEIGHT), None)
            cols = next((a.shape[1] for n, a in inner.items() if declared.get(n) is not None
                         and declared[n].transform is declarations.OUT_HEADS), None)
            if rows is not None and cols is not None:  # out_proj (E, H * hd): H heads of head_dim hd
                info["num_heads"] = cols // info["head_dim"]
                info["num_kv_heads"] = (rows // info["head_dim"] - info["num_heads"]) // 2
            if info.get("num_heads") and info["head_dim"] == info["d_model"] // info["num_heads"]:
                del info["head_dim"]  # the default width: BlockConfig.head_dim stays None
    dtypes = sorted({str(a.dtype) for a in sd.values()})
    info["dtype"] = dtypes[0] if len(dtypes) == 1 else dtypes
    unknown = tuple(u for u in ConfigReport.unknown if u.split(" ")[0] not in info)
    return ConfigReport(info, unknown)



def norm_prefix(prefix: str) -> str:
    """"encoder" and "encoder." both mean the keys under encoder."""
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def strip_prefix(sd: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    if not prefix:
        return sd
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}

