"""Move weights between PyTorch (torch_blocks / stock nn.TransformerEncoder) and flax_blocks.

    from_torch(Encoder, cfg, source, num_layers=6)                      torch -> a new Flax module
    load_torch_state_dict(module, source, *, prefix="", strict=True)   torch -> Flax, in place
    torch_state_dict(module)                                            Flax  -> {torch name: array}

Both directions read the parameter declarations (`flax_blocks.declarations`): each
Param's torch name, Flax path and Layout (torch tensor <-> Flax array). An Encoder's
torch `layers.{i}.` maps to index i of the Flax layers' leading (stacked) axis. Nothing here imports torch: a `.pt` file needs it,
a `.safetensors` file or a mapping of arrays does not.

Loading is strict by default and atomic: every problem (missing or unexpected keys, shape
mismatches, non-floating dtypes, a prefix that matches nothing, a layer count that differs)
is collected and raised together in one `ConversionError` before the module is touched.
Dtypes are preserved (float32, float64, bfloat16) unless `dtype=` asks for a cast.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, NamedTuple

import numpy as np

from . import declarations, layouts
from .config import BlockConfig, dtype_name
from .declarations import FINAL_NORM, LAYERS, Param
from .io_errors import torch_load_state_dict

LAYER = re.compile(rf"{LAYERS}\.(\d+)\.(.+)")
BLOCK_KINDS = tuple(declarations.BLOCKS)
KINDS = (*BLOCK_KINDS, *declarations.STACKS, "Transformer")


def module_params(kind: str, cfg: BlockConfig, *, num_layers: Any = None,
                  final_norm: Any = False) -> list[tuple[str, str, Param, int | None]]:
    """(torch name, dotted Flax path, Param, layer index or None) of every parameter of a
    module of `kind`, derived from the declarations. A stack's layer i is torch's
    `layers.{i}.` and index i of the Flax layers' leading (stacked) axis. A Transformer
    takes num_layers and final_norm as (encoder, decoder) pairs; its encoder is never causal
    (which changes no parameter)."""
    if kind in BLOCK_KINDS:
        return [(t, f, p, None) for t, f, p in declarations.flatten(declarations.block(cfg, kind))]
    if kind == "Transformer":
        out = []
        for (prefix, stack), n, fn in zip(declarations.TRANSFORMER.items(), num_layers, final_norm):
            out += [(f"{prefix}.{t}", f"{prefix}.{f}", p, i) for t, f, p, i in module_params(stack, cfg, num_layers=n, final_norm=fn)]
        return out
    if kind not in declarations.STACKS:
        raise TypeError(f"expected one of {KINDS}, got {kind!r}")
    layer = declarations.flatten(declarations.block(cfg, declarations.STACKS[kind]))
    out = [(f"{LAYERS}.{i}.{t}", f"{LAYERS}.{f}", p, i) for i in range(num_layers or 0) for t, f, p in layer]
    if final_norm:
        out += [(t, f, p, None) for t, f, p in declarations.flatten(declarations.norm(cfg, cfg.d_model), f"{FINAL_NORM}.")]
    return out


# ----------------------------------------------------------------------------------------
# Reading sources
# ----------------------------------------------------------------------------------------


class ConversionError(ValueError):
    """Raised with every problem found, one per line; the module was not modified."""

    def __init__(self, problems: list[str], header: str = "cannot load state dict"):
        self.problems = list(problems)
        super().__init__(f"{header}: {len(problems)} problem(s)\n  " + "\n  ".join(problems))


def to_numpy(value: Any) -> np.ndarray:
    """Array or torch tensor -> numpy, keeping bfloat16 (as ml_dtypes.bfloat16)."""
    if type(value).__module__.startswith("torch"):
        t = value.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes

            return t.view(dtype=_torch_int16()).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(value)


def _torch_int16():
    import torch

    return torch.int16


def read_state_dict(source: Any) -> dict[str, np.ndarray]:
    """A mapping of arrays/tensors, a module with .state_dict(), or a path to a
    .safetensors / .pt / .pth file -> {name: numpy array}."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint not found: {path}")
        if path.endswith(".safetensors"):
            from safetensors.numpy import load_file

            return dict(load_file(path))
        if path.endswith((".pt", ".pth", ".bin")):
            try:
                import torch
            except ImportError as e:
                raise ImportError(
                    f"reading {path} needs PyTorch: install the 'torch' extra "
                    "(pip install 'twin-blocks[torch]'), or convert it to .safetensors"
                ) from e
            obj = torch_load_state_dict(path)  # one-line CheckpointReadError for a pickled module
            if not isinstance(obj, Mapping):
                raise ConversionError([f"{path} holds a {type(obj).__name__}, expected a state dict (name -> tensor)"])
            return {k: to_numpy(v) for k, v in obj.items()}
        raise ValueError(f"unknown checkpoint format {path!r}: expected .safetensors, .pt or .pth")
    if hasattr(source, "state_dict") and callable(source.state_dict):
        source = source.state_dict()
    if not isinstance(source, Mapping):
        raise TypeError(f"source must be a mapping of name -> array, a module or a path, got {type(source).__name__}")
    return {str(k): to_numpy(v) for k, v in source.items()}


# ----------------------------------------------------------------------------------------
# What a module expects
# ----------------------------------------------------------------------------------------


def _flax_params(module) -> dict[str, Any]:
    """{dotted Flax path: nnx.Param} of a flax_blocks module."""
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {".".join(str(p) for p in path): var for path, var in flat}


def _kind(module) -> str:
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


def _layout_of(module) -> tuple[Any, Any]:
    """(num_layers, final_norm) of a module, as `module_params` takes them."""
    kind = _kind(module)
    if kind == "Transformer":
        return ((module.encoder.num_layers, module.decoder.num_layers),
                (module.encoder.final_norm is not None, module.decoder.final_norm is not None))
    if kind in declarations.STACKS:
        return module.num_layers, module.final_norm is not None
    return None, False


def expected_torch_params(module) -> dict[str, Expected]:
    """{torch name: Expected} for every parameter of `module`, in torch's naming."""
    num_layers, final = _layout_of(module)
    return {t: Expected(f, layer, p, p.shape)
            for t, f, p, layer in module_params(_kind(module), module.cfg, num_layers=num_layers, final_norm=final)}


# ----------------------------------------------------------------------------------------
# Config inference, from the declarations: which parameter names exist under which option
# ----------------------------------------------------------------------------------------

_PROBE = BlockConfig(d_model=8, num_heads=2, d_ff=8, norm="peri", mlp="swiglu", activation="silu",
                     qk_norm=True, scaling="layerscale", qkv_bias=True)


def _names(kind: str, **options: Any) -> dict[str, Param]:
    return {t: p for t, _, p, _ in module_params(kind, replace(_PROBE, **options))}


def _only_with(kind: str, **options: Any) -> set[str]:
    """Names that exist with the probe config and vanish when `options` are applied."""
    return set(_names(kind)) - set(_names(kind, **options))


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
    their placement (peri), gated MLP, QK-norm, residual scaling, dtype."""
    sd = _strip(read_state_dict(source), _norm_prefix(prefix))
    layers = sorted({int(m.group(1)) for n in sd if (m := LAYER.match(n))})
    inner = {(m.group(2) if (m := LAYER.match(n)) else n): a for n, a in sd.items()}
    if layers:
        inner = {n: a for n, a in inner.items() if not n.startswith(f"{FINAL_NORM}.")} if layers else inner
    info: dict[str, Any] = {}
    kind = _block_kind({n.split(".")[0] for n in inner})
    if layers:
        stack = {block: name for name, block in declarations.STACKS.items()}.get(kind, "Encoder")
        info.update(kind=stack, num_layers=len(layers), final_norm=f"{FINAL_NORM}.weight" in sd)
        kind = declarations.STACKS[stack]
    elif kind is not None:
        info["kind"] = kind
    if kind is not None:
        declared = _names(kind)
        for name, a in inner.items():  # each dimension that is a config field
            p = declared.get(name)
            if p is not None and len(p.dims) == a.ndim:
                for dim, size in zip(p.dims, a.shape):
                    if dim is not None:
                        info.setdefault(dim, int(size))
        has = lambda names: any(n in inner for n in names)  # noqa: E731
        info["bias"] = has(_only_with(kind, bias=False, qkv_bias=True) - _only_with(kind, norm_type="rmsnorm"))
        if has(_only_with(kind, qkv_bias=False)) != info["bias"]:
            info["qkv_bias"] = not info["bias"]  # recorded only where it departs from `bias`
        info["layer_norms"] = has(_only_with(kind, norm="none"))
        if has(_only_with(kind, norm="pre")):
            info["norm"] = "peri"
        info["gated_mlp"] = has(_only_with(kind, mlp="dense", activation="relu"))
        info["qk_norm"] = has(_only_with(kind, qk_norm=False))
        if info["bias"] and info["layer_norms"]:
            info["norm_type"] = "layernorm" if has(_only_with(kind, norm_type="rmsnorm")) else "rmsnorm"
        gates = [a for n, a in inner.items() if n in _only_with(kind, scaling="none")]
        if gates:
            info["scaling"] = "rezero" if gates[0].ndim == 0 else "layerscale"
        if "head_dim" in info and "d_model" in info:
            rows = next((a.shape[0] for n, a in inner.items() if declared.get(n) is not None
                         and declared[n].layout is declarations.QKV_WEIGHT), None)
            if rows is not None:
                info["num_heads"] = info["d_model"] // info["head_dim"]
                info["num_kv_heads"] = (rows // info["head_dim"] - info["num_heads"]) // 2
    dtypes = sorted({str(a.dtype) for a in sd.values()})
    info["dtype"] = dtypes[0] if len(dtypes) == 1 else dtypes
    unknown = tuple(u for u in ConfigReport.unknown if u.split(" ")[0] not in info)
    return ConfigReport(info, unknown)


def _module_facts(module) -> dict[str, Any]:
    cfg = module.cfg
    facts: dict[str, Any] = {"kind": type(module).__name__, "d_model": cfg.d_model, "bias": cfg.bias}
    if facts["kind"] != "ResidualMHA":
        facts["d_ff"] = cfg.d_ff
    if facts["kind"] in declarations.STACKS:
        facts["num_layers"] = module.num_layers
        facts["final_norm"] = module.final_norm is not None
    if facts["kind"] == "Transformer":
        facts = {"kind": "Transformer"}  # its keys say the rest: strict loading checks every one
    return facts


def _norm_prefix(prefix: str) -> str:
    """"encoder" and "encoder." both mean the keys under encoder."""
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def _strip(sd: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    if not prefix:
        return sd
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def _suggest_prefix(raw: Mapping[str, Any], expected: Iterable[str]) -> str | None:
    """The key root under which most expected names are found, if any (e.g. "encoder.")."""
    expected = list(expected)
    roots = {k.split(".")[0] for k in raw if "." in k}
    counts = {r: sum(f"{r}.{k}" in raw for k in expected) for r in roots}
    best = max(counts, key=counts.get, default=None)
    return f"{best}." if best is not None and counts[best] else None


def _np_dtype(dtype: Any):
    """A dtype given as a name or a numpy / JAX / torch dtype object -> a numpy dtype."""
    name = dtype_name(dtype)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise TypeError(f"dtype must be float32, float64, bfloat16 or float16 (a name or a dtype object), got {dtype!r}") from None


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# ----------------------------------------------------------------------------------------
# torch -> Flax
# ----------------------------------------------------------------------------------------


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def load_torch_state_dict(module, source: Any, *, prefix: str = "", strict: bool = True, dtype: Any = None,
                          layout: str | None = None) -> LoadResult:
    """Load torch-named weights into a flax_blocks module, in place.

    source: mapping of name -> array/tensor, a torch module, or a .safetensors/.pt/.pth path.
    prefix: only names starting with it are read (e.g. "encoder." or "encoder" inside a
      bigger model).
    strict: missing and unexpected keys are errors; with strict=False they are reported
      in the returned LoadResult and the module keeps its own values for missing ones.
    dtype: cast every tensor to this dtype (a name or a numpy / JAX / torch dtype);
      None keeps the checkpoint's dtypes.
    layout: the checkpoint's naming ("torch", "hf-bert", "hf-gpt2", "hf-llama"; see
      flax_blocks.layouts); None detects it from the key names.
    Shape, dtype and layer-count problems are always errors. On any error nothing changes.
    """
    import jax
    import jax.numpy as jnp

    raw, prefix, layout_hint = layouts.prepare(source, layout, prefix)
    prefix = _norm_prefix(prefix)
    cast = None if dtype is None else _np_dtype(dtype)
    problems: list[str] = []
    sd = _strip(raw, prefix)
    if prefix and not sd:
        roots = sorted({k.split(".")[0] + "." for k in raw})[:8]
        problems.append(f"prefix {prefix!r} matches no key (the checkpoint's keys start with {roots})")
    expected = expected_torch_params(module)
    cfg = module.cfg
    num_layers = getattr(module, "num_layers", None)

    report = infer_config(sd) if sd else ConfigReport()
    facts = _module_facts(module)
    for key in ("d_model", "d_ff", "bias", "final_norm"):  # num_layers: see the layer check
        if key in report.inferred and key in facts and report.inferred[key] != facts[key]:
            fix = " (pass final_norm=%r)" % report.inferred[key] if key == "final_norm" else ""
            problems.append(f"config mismatch: {key} is {report.inferred[key]!r} in the checkpoint, "
                            f"{facts[key]!r} in the module{fix}")
    ckpt_layers = sorted({int(m.group(1)) for k in sd if (m := LAYER.match(k))})
    if num_layers is not None and ckpt_layers and ckpt_layers != list(range(num_layers)):
        problems.append(
            f"layer count: checkpoint has layers {_ranges(ckpt_layers)} ({len(ckpt_layers)}), module has {num_layers} (0-{num_layers - 1})"
        )

    missing = sorted((k for k in expected if k not in sd), key=_natural)
    unexpected = sorted((k for k in sd if k not in expected), key=_natural)
    if strict and missing and len(missing) == len(expected) and not prefix:
        hint = _suggest_prefix(raw, expected)
        if hint:
            problems.append(f"no expected key at the top level; the weights seem to be under prefix={hint!r}")
    if strict:
        problems += [f"missing key {prefix}{k} (expected shape {expected[k].torch_shape})" for k in missing]
        problems += [f"unexpected key {prefix}{k} (shape {tuple(sd[k].shape)})" for k in unexpected]
    params = _flax_params(module)
    abstract = [k for k in missing if isinstance(params[expected[k].flax_path].get_value(), jax.ShapeDtypeStruct)]
    if abstract and not strict:
        problems += [f"missing key {prefix}{k}: the module is abstract (nnx.eval_shape) and has no value for it" for k in abstract]
    x64 = jax.config.jax_enable_x64
    silent64 = []
    for k, exp in expected.items():
        if k not in sd:
            continue
        a = sd[k]
        if tuple(a.shape) != exp.torch_shape:
            problems.append(f"shape mismatch for {prefix}{k}: expected {exp.torch_shape}, found {tuple(a.shape)}")
        if not np.issubdtype(a.dtype, np.floating) and str(a.dtype) != "bfloat16":
            problems.append(f"dtype of {prefix}{k}: expected a floating dtype, found {a.dtype}")
        elif cast is None and a.dtype == np.float64 and not x64:
            silent64.append(prefix + k)
    if silent64:
        problems.append(
            f"{len(silent64)} tensor(s) are float64 ({_few(silent64)}) but jax_enable_x64 is off (they would "
            "silently become float32): enable it before creating arrays, or pass dtype=jnp.float32"
        )
    if problems:
        raise ConversionError(problems + ([layout_hint] if layout_hint else []))

    # Everything checks out: build the whole new state, then update once.
    new: dict[str, np.ndarray] = {}
    stacks: dict[str, list] = {}
    for k, exp in expected.items():
        if k not in sd:
            continue
        a = exp.param.layout.to_flax(sd[k], cfg)
        if cast is not None:
            a = a.astype(cast)
        if exp.layer is None:
            new[exp.flax_path] = a
        else:
            depth = params[exp.flax_path].get_value().shape[0]  # the stacked layer axis
            stacks.setdefault(exp.flax_path, [None] * depth)[exp.layer] = a
    for path, items in stacks.items():
        current = None if all(a is not None for a in items) else np.asarray(params[path].get_value())
        new[path] = np.stack([current[i] if a is None else a for i, a in enumerate(items)])
    for path, a in new.items():
        params[path].set_value(jnp.asarray(a))
    return LoadResult(missing, unexpected)


def _checkpoint_has_final_norm(source: Any, prefix: str) -> tuple[Any, bool]:
    """(the source read into a dict, whether it holds the Encoder's final norm)."""
    sd = read_state_dict(source)
    return sd, f"{_norm_prefix(prefix)}{FINAL_NORM}.weight" in sd


def from_torch(cls: type, cfg: Any, source: Any, *, seed: int = 0, prefix: str = "", dtype: Any = None,
               layout: str | None = None, **kwargs: Any):
    """A new `cls(cfg, rngs=nnx.Rngs(seed), **kwargs)` whose parameters come from a torch
    checkpoint (strictly: every parameter must be there), without drawing random initial
    values that would be overwritten: the module is built with `nnx.eval_shape`, loaded,
    and only its dropout RNG state is made concrete (from `seed`).

    Besides saving the work of initialising, this skips compiling the random initialisers,
    which on a CPU takes seconds per new block shape. kwargs go to the constructor
    (num_layers=, final_norm= for an Encoder); source, prefix and dtype are those of
    `load_torch_state_dict`, which raises `ConversionError` on any problem. A stock
    nn.TransformerEncoder(Layer) as source is also checked against cfg: a field that contradicts
    the module's own (heads, norm placement, activation, eps, final norm) is an error.
    layout: see `load_torch_state_dict` (None: detected from the key names).
    """
    from flax import nnx

    layouts.check_against_source(cfg, source, kwargs.get("final_norm"))
    source, prefix, _ = layouts.prepare(source, layout, prefix)

    if cls.__name__ in declarations.STACKS and kwargs.get("final_norm") is None:
        source, kwargs["final_norm"] = _checkpoint_has_final_norm(source, prefix)
    module = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(seed), **kwargs))
    load_torch_state_dict(module, source, prefix=prefix, strict=True, dtype=dtype, layout=layout and "torch")
    materialize_rng_state(module, seed)
    return module


def materialize_rng_state(module, seed: int) -> None:
    """Give an abstract (nnx.eval_shape) module's RNG keys and counts concrete values, in
    place: keys derived from `seed` and the variable's path (so each dropout gets its own
    stream, and stacked layers one key per layer), counts zero. Parameters must already be
    concrete (loaded); a non-RNG variable left abstract raises RuntimeError."""
    import zlib

    import jax
    import jax.numpy as jnp
    from flax import nnx

    root = jax.random.key(seed)
    left = []
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable) or not isinstance(node.get_value(), jax.ShapeDtypeStruct):
            continue
        shape, name = node.get_value().shape, ".".join(map(str, path))
        if isinstance(node, nnx.RngKey):
            key = jax.random.fold_in(root, zlib.crc32(name.encode()))
            node.set_value(jax.random.split(key, math.prod(shape)).reshape(shape))
        elif isinstance(node, nnx.RngCount):
            node.set_value(jnp.zeros(shape, node.get_value().dtype))
        else:
            left.append(f"{name} ({type(node).__name__}, shape {shape})")
    if left:
        raise RuntimeError("these variables are still abstract (nothing loaded them): " + ", ".join(left))


# ----------------------------------------------------------------------------------------
# Flax -> torch
# ----------------------------------------------------------------------------------------


def torch_state_dict(module) -> dict[str, np.ndarray]:
    """{torch name: numpy array} of a flax_blocks module, in torch's layout and naming
    (loadable with strict=True into the torch_blocks twin, and into stock torch layers
    where the config is one torch supports). Dtypes are kept (bfloat16 as ml_dtypes)."""
    params = _flax_params(module)
    out: dict[str, np.ndarray] = {}
    for name, exp in expected_torch_params(module).items():
        value = np.asarray(params[exp.flax_path].get_value())
        if exp.layer is not None:
            value = value[exp.layer]
        out[name] = np.array(exp.param.layout.to_torch(value, module.cfg), order="C")  # keeps 0-d gates 0-d
    return dict(sorted(out.items(), key=lambda kv: _natural(kv[0])))


def flax_state_dict(module) -> dict[str, np.ndarray]:
    """{dotted Flax path: numpy array}, the Flax-layout checkpoint (stacked layers)."""
    return {p: np.asarray(v.get_value()) for p, v in _flax_params(module).items()}


def load_flax_state_dict(module, source: Any) -> None:
    """Load a Flax-layout checkpoint ({dotted Flax path: array} or a .safetensors path),
    strictly and atomically, into `module`."""
    import jax.numpy as jnp

    sd = read_state_dict(source)
    params = _flax_params(module)
    problems = [f"missing key {k} (expected shape {tuple(v.get_value().shape)})" for k, v in params.items() if k not in sd]
    problems += [f"unexpected key {k} (shape {tuple(sd[k].shape)})" for k in sd if k not in params]
    problems += [
        f"shape mismatch for {k}: expected {tuple(params[k].get_value().shape)}, found {tuple(a.shape)}"
        for k, a in sd.items() if k in params and tuple(a.shape) != tuple(params[k].get_value().shape)
    ]
    if problems:
        raise ConversionError(problems)
    for k, var in params.items():
        var.set_value(jnp.asarray(sd[k]))


# ----------------------------------------------------------------------------------------


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _ranges(xs: Iterable[int]) -> str:
    xs = sorted(xs)
    parts, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


if __name__ == "__main__":  # python -m flax_blocks.convert
    import sys

    from flax_blocks.convert_cli import main

    sys.exit(main())
