"""Which parameters a flax_blocks module has, in torch's naming and in Flax's, derived from
the declarations: the one map both conversion directions read.

A stack's layer i is torch's `layers.{i}.` and index i of the Flax layers' leading
(stacked) axis (a mixed stack's MLPs: index j of their kind's); a Transformer holds an encoder and a decoder stack.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...core import declarations
from ...core.config import BlockConfig
from ...core.declarations import FINAL_NORM, LAYERS, Param

LAYER = re.compile(rf"{LAYERS}\.(\d+)\.(.+)")
BLOCK_KINDS = tuple(declarations.BLOCKS)
KINDS = (*BLOCK_KINDS, *declarations.STACKS, "Transformer")


def module_params(kind: str, cfg: BlockConfig, *, num_layers: Any = None,
                  final_norm: Any = False) -> list[tuple[str, str, Param, int | None]]:
    """(torch name, dotted Flax path, Param, layer index or None) of every parameter of a
    module of `kind`, derived from the declarations. A stack's layer i is torch's
    `layers.{i}.` and index i of the Flax layers' leading (stacked) axis; each layer holds its
    own MLP (`declarations.layer_mlp`), and a stack mixing the two kinds holds them in Flax
    apart (`declarations.LAYER_MLPS`: index j among that kind's layers). A Transformer
    takes num_layers and final_norm as (encoder, decoder) pairs; its encoder is never causal
    (which changes no parameter)."""
    if kind in BLOCK_KINDS:
        block = declarations.block(cfg, kind, declarations.layer_mlp(cfg, 1))  # a block alone is layer 1
        return [(t, f, p, None) for t, f, p in declarations.flatten(block)]
    if kind == "Transformer":
        out = []
        for (prefix, stack), n, fn in zip(declarations.TRANSFORMER.items(), num_layers, final_norm, strict=True):
            out += [(f"{prefix}.{t}", f"{prefix}.{f}", p, i)
                    for t, f, p, i in module_params(stack, cfg, num_layers=n, final_norm=fn)]
        return out
    if kind not in declarations.STACKS:
        raise TypeError(f"expected one of {KINDS}, got {kind!r}")
    out = []
    kinds = [declarations.layer_mlp(cfg, i + 1) for i in range(num_layers or 0)]
    mixed = len(set(kinds)) > 1
    for i, mlp in enumerate(kinds):
        for t, f, p in declarations.flatten(declarations.block(cfg, declarations.STACKS[kind], mlp)):
            if mixed and f.split(".")[0] in (*declarations.MLP_MODULES, declarations.EXPERTS_MODULE):
                # a mixed stack's MLPs: Flax stacks each kind apart, index j among that kind's layers
                out.append((f"{LAYERS}.{i}.{t}", f"{declarations.LAYER_MLPS[mlp]}.{f}", p, kinds[:i].count(mlp)))
            else:
                out.append((f"{LAYERS}.{i}.{t}", f"{LAYERS}.{f}", p, i))
    if final_norm:
        norm = declarations.norm(cfg, cfg.d_model)
        out += [(t, f, p, None) for t, f, p in declarations.flatten(norm, f"{FINAL_NORM}.")]
    return out



def flax_params(module) -> dict[str, Any]:
    """{dotted Flax path: nnx.Param} of a flax_blocks module."""
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {".".join(str(p) for p in path): var for path, var in flat}


def module_kind(module) -> str:
    kind = type(module).__name__
    if getattr(module, "cfg", None) is None or kind not in KINDS:
        raise TypeError(f"expected a flax_blocks module ({', '.join(KINDS)}), got {kind}")
    return kind


@dataclass
class Expected:
    """One torch-named tensor a module expects: where it goes and how it is laid out."""

    flax_path: str
    layer: int | None
    param: Param
    torch_shape: tuple[int, ...]


def stack_shape(module) -> tuple[Any, Any]:
    """(num_layers, final_norm) of a module, as `module_params` takes them."""
    kind = module_kind(module)
    if kind == "Transformer":
        return ((module.encoder.num_layers, module.decoder.num_layers),
                (module.encoder.final_norm is not None, module.decoder.final_norm is not None))
    if kind in declarations.STACKS:
        return module.num_layers, module.final_norm is not None
    return None, False


def expected_torch_params(module) -> dict[str, Expected]:
    """{torch name: Expected} for every parameter of `module`, in torch's naming."""
    num_layers, final = stack_shape(module)
    params = module_params(module_kind(module), module.cfg, num_layers=num_layers, final_norm=final)
    return {t: Expected(f, layer, p, p.shape) for t, f, p, layer in params}
