"""Move weights between PyTorch (torch_blocks / stock nn.TransformerEncoder) and flax_blocks.

    from_torch(Encoder, cfg, source, num_layers=6)                      torch -> a new Flax module
    load_torch_state_dict(module, source, *, prefix="", strict=True)   torch -> Flax, in place
    torch_state_dict(module)                                            Flax  -> {torch name: array}

Both directions read one declarative table, `RULES`: (torch name, Flax path, transform).
Names are written for one block; an Encoder's torch `layers.{i}.` maps to index i of the
Flax layers' leading (stacked) axis. Nothing here imports torch: a `.pt` file needs it,
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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import numpy as np

# ----------------------------------------------------------------------------------------
# The table. Each transform is (to_flax, to_torch), given the block's (heads, head_dim).
# ----------------------------------------------------------------------------------------

Transform = tuple[Callable[[np.ndarray, int, int], np.ndarray], Callable[[np.ndarray, int, int], np.ndarray]]

COPY: Transform = (lambda a, h, d: a, lambda a, h, d: a)
# nn.Linear weight (out, in) <-> flax kernel (in, out)
TRANSPOSE: Transform = (lambda a, h, d: a.T, lambda a, h, d: a.T)
# packed in_proj_weight (3E, E), rows [q; k; v] each (heads, head_dim) <-> (E, 3, heads, head_dim)
QKV_WEIGHT: Transform = (
    lambda a, h, d: a.reshape(3, h, d, a.shape[-1]).transpose(3, 0, 1, 2),
    lambda a, h, d: a.transpose(1, 2, 3, 0).reshape(3 * h * d, a.shape[0]),
)
QKV_BIAS: Transform = (lambda a, h, d: a.reshape(3, h, d), lambda a, h, d: a.reshape(3 * h * d))
# out_proj.weight (E, heads*head_dim) <-> (heads, head_dim, E)
OUT_WEIGHT: Transform = (lambda a, h, d: a.T.reshape(h, d, a.shape[0]), lambda a, h, d: a.reshape(h * d, a.shape[-1]).T)

ATTN = "(?P<attn>self_attn|mha)"
LIN = "(?P<lin>linear1|linear2)"
NORM = "(?P<norm>norm|norm1|norm2)"
GATE = "(?P<gate>scale|scale1|scale2)"

RULES: list[tuple[str, str, Transform]] = [
    # torch name (within a block)         Flax path (within a block)    transform
    (f"{ATTN}.in_proj_weight",            "{attn}.in_kernel",           QKV_WEIGHT),
    (f"{ATTN}.in_proj_bias",              "{attn}.in_bias",             QKV_BIAS),
    (f"{ATTN}.out_proj.weight",           "{attn}.out_kernel",          OUT_WEIGHT),
    (f"{ATTN}.out_proj.bias",             "{attn}.out_bias",            COPY),
    (f"{LIN}.weight",                     "{lin}.kernel",               TRANSPOSE),
    (f"{LIN}.bias",                       "{lin}.bias",                 COPY),
    (f"{NORM}.weight",                    "{norm}.scale",               COPY),
    (f"{NORM}.bias",                      "{norm}.bias",                COPY),
    (f"{GATE}",                           "{gate}",                     COPY),
]
LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _flax_regex(flax_template: str) -> re.Pattern:
    names = re.findall(r"\{(\w+)\}", flax_template)
    pattern = re.escape(flax_template)
    for n in names:
        pattern = pattern.replace(re.escape("{" + n + "}"), f"(?P<{n}>[\\w]+)")
    return re.compile(pattern + "$")


_TORCH_RULES = [(re.compile(t.replace(".", r"\.") + "$"), f, tr) for t, f, tr in RULES]
_FLAX_RULES = [(_flax_regex(f), t, tr) for t, f, tr in RULES]


def _torch_template(torch_regex: str, groups: dict[str, str]) -> str:
    out = torch_regex
    for n, v in groups.items():
        out = re.sub(rf"\(\?P<{n}>[^)]*\)", v, out)
    return out


def flax_to_torch_name(flax_path: str) -> tuple[str, Transform]:
    """('self_attn.in_kernel') -> ('self_attn.in_proj_weight', QKV_WEIGHT), within one block."""
    for regex, torch_regex, transform in _FLAX_RULES:
        m = regex.match(flax_path)
        if m:
            name = _torch_template(torch_regex, m.groupdict())
            if _torch_rule(name) is not None:
                return name, transform
    raise KeyError(f"no conversion rule for Flax parameter {flax_path!r}")


def _torch_rule(torch_name: str):
    for regex, flax_template, transform in _TORCH_RULES:
        m = regex.match(torch_name)
        if m:
            return flax_template.format(**m.groupdict()), transform
    return None


def torch_to_flax_name(torch_name: str) -> tuple[str, Transform]:
    """('linear1.weight') -> ('linear1.kernel', TRANSPOSE), within one block."""
    rule = _torch_rule(torch_name)
    if rule is None:
        raise KeyError(f"no conversion rule for torch parameter {torch_name!r}")
    return rule


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
            obj = torch.load(path, map_location="cpu", weights_only=True)
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


def _layout(module) -> tuple[int, int, int | None]:
    """(heads, head_dim, num_layers or None) of a flax_blocks module."""
    cfg = getattr(module, "cfg", None)
    if cfg is None:
        raise TypeError(f"expected a flax_blocks module (ResidualMHA, FeedForward, TransformerBlock, Encoder), got {type(module).__name__}")
    return cfg.num_heads, cfg.head_dim, getattr(module, "num_layers", None)


@dataclass
class Expected:
    """One torch-named tensor a module expects: where it goes and how it is laid out."""

    flax_path: str
    layer: int | None
    transform: Transform
    torch_shape: tuple[int, ...]


def expected_torch_params(module) -> dict[str, Expected]:
    """{torch name: Expected} for every parameter of `module`, in torch's naming."""
    heads, hd, num_layers = _layout(module)
    out: dict[str, Expected] = {}
    for path, var in _flax_params(module).items():
        value = var.get_value()
        if path.startswith("layers."):
            inner = path[len("layers."):]
            name, tr = flax_to_torch_name(inner)
            tshape = tr[1](np.empty(value.shape[1:], np.bool_), heads, hd).shape
            for i in range(num_layers):
                out[f"layers.{i}.{name}"] = Expected(path, i, tr, tuple(tshape))
        else:
            name, tr = flax_to_torch_name(path)
            tshape = tr[1](np.empty(value.shape, np.bool_), heads, hd).shape
            out[name] = Expected(path, None, tr, tuple(tshape))
    return out


# ----------------------------------------------------------------------------------------
# Config inference
# ----------------------------------------------------------------------------------------


@dataclass
class ConfigReport:
    """What a torch-named state dict says about the config that made it."""

    inferred: dict[str, Any] = field(default_factory=dict)
    unknown: tuple[str, ...] = ("num_heads", "norm (pre or post)", "activation", "layer_norm_eps", "causal", "dropout")

    def __str__(self) -> str:
        known = ", ".join(f"{k}={v!r}" for k, v in self.inferred.items())
        return f"inferred: {known}\ncannot be inferred (give them to BlockConfig): {', '.join(self.unknown)}"


def infer_config(source: Any, *, prefix: str = "") -> ConfigReport:
    """Read a torch-named state dict and report what it fixes: kind, d_model, d_ff,
    num_layers, bias, final_norm, LayerNorms present, residual scaling, dtype."""
    sd = _strip(read_state_dict(source), prefix)
    names = set(sd)
    inner = {LAYER.match(n).group(2) if LAYER.match(n) else n for n in names}
    layers = sorted({int(LAYER.match(n).group(1)) for n in names if LAYER.match(n)})
    info: dict[str, Any] = {}
    if layers:
        info["kind"] = "Encoder"
        info["num_layers"] = len(layers)
        info["final_norm"] = "norm.weight" in names
    elif any(n.startswith("self_attn.") for n in names):
        info["kind"] = "TransformerBlock"
    elif any(n.startswith("mha.") for n in names):
        info["kind"] = "ResidualMHA"
    elif any(n.startswith("linear1.") for n in names):
        info["kind"] = "FeedForward"
    for n, arr in sd.items():
        base = LAYER.match(n).group(2) if LAYER.match(n) else n
        if base.endswith("in_proj_weight"):
            info["d_model"] = int(arr.shape[1])
        if base == "linear1.weight":
            info["d_ff"] = int(arr.shape[0])
            info.setdefault("d_model", int(arr.shape[1]))
    info["bias"] = any(b.endswith(("in_proj_bias", "linear1.bias", "linear2.bias")) for b in inner)
    info["layer_norms"] = any(b.startswith(("norm1.", "norm2.", "norm.")) for b in inner if not (layers and b.startswith("norm.")))
    gates = [sd[n] for n in names if re.search(r"(^|\.)scale[12]?$", n)]
    if gates:
        info["scaling"] = "rezero" if gates[0].ndim == 0 else "layerscale"
    dtypes = sorted({str(a.dtype) for a in sd.values()})
    info["dtype"] = dtypes[0] if len(dtypes) == 1 else dtypes
    return ConfigReport(info)


def _module_facts(module) -> dict[str, Any]:
    cfg = module.cfg
    facts: dict[str, Any] = {"kind": type(module).__name__, "d_model": cfg.d_model, "bias": cfg.bias}
    if facts["kind"] != "ResidualMHA":
        facts["d_ff"] = cfg.d_ff
    if facts["kind"] == "Encoder":
        facts["num_layers"] = module.num_layers
        facts["final_norm"] = module.norm is not None
    return facts


def _strip(sd: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    if not prefix:
        return sd
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


# ----------------------------------------------------------------------------------------
# torch -> Flax
# ----------------------------------------------------------------------------------------


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def load_torch_state_dict(module, source: Any, *, prefix: str = "", strict: bool = True, dtype: Any = None) -> LoadResult:
    """Load torch-named weights into a flax_blocks module, in place.

    source: mapping of name -> array/tensor, a torch module, or a .safetensors/.pt/.pth path.
    prefix: only names starting with it are read (e.g. "encoder." inside a bigger model).
    strict: missing and unexpected keys are errors; with strict=False they are reported
      in the returned LoadResult and the module keeps its own values for missing ones.
    dtype: cast every tensor to this dtype; None keeps the checkpoint's dtypes.
    Shape, dtype and layer-count problems are always errors. On any error nothing changes.
    """
    import jax
    import jax.numpy as jnp

    raw = read_state_dict(source)
    problems: list[str] = []
    sd = _strip(raw, prefix)
    if prefix and not sd:
        roots = sorted({k.split(".")[0] + "." for k in raw})[:8]
        problems.append(f"prefix {prefix!r} matches no key (the checkpoint's keys start with {roots})")
    expected = expected_torch_params(module)
    heads, hd, num_layers = _layout(module)

    report = infer_config(sd) if sd else ConfigReport()
    facts = _module_facts(module)
    for key in ("d_model", "d_ff", "bias", "final_norm"):  # num_layers: see the layer check
        if key in report.inferred and key in facts and report.inferred[key] != facts[key]:
            problems.append(f"config mismatch: {key} is {report.inferred[key]!r} in the checkpoint, {facts[key]!r} in the module")
    ckpt_layers = sorted({int(m.group(1)) for k in sd if (m := LAYER.match(k))})
    if num_layers is not None and ckpt_layers and ckpt_layers != list(range(num_layers)):
        problems.append(
            f"layer count: checkpoint has layers {_ranges(ckpt_layers)} ({len(ckpt_layers)}), module has {num_layers} (0-{num_layers - 1})"
        )

    missing = sorted((k for k in expected if k not in sd), key=_natural)
    unexpected = sorted((k for k in sd if k not in expected), key=_natural)
    if strict:
        problems += [f"missing key {prefix}{k} (expected shape {expected[k].torch_shape})" for k in missing]
        problems += [f"unexpected key {prefix}{k} (shape {tuple(sd[k].shape)})" for k in unexpected]
    params = _flax_params(module)
    abstract = [k for k in missing if isinstance(params[expected[k].flax_path].get_value(), jax.ShapeDtypeStruct)]
    if abstract and not strict:
        problems += [f"missing key {prefix}{k}: the module is abstract (nnx.eval_shape) and has no value for it" for k in abstract]
    x64 = jax.config.jax_enable_x64
    for k, exp in expected.items():
        if k not in sd:
            continue
        a = sd[k]
        if tuple(a.shape) != exp.torch_shape:
            problems.append(f"shape mismatch for {prefix}{k}: expected {exp.torch_shape}, found {tuple(a.shape)}")
        if not np.issubdtype(a.dtype, np.floating) and str(a.dtype) != "bfloat16":
            problems.append(f"dtype of {prefix}{k}: expected a floating dtype, found {a.dtype}")
        elif dtype is None and a.dtype == np.float64 and not x64:
            problems.append(
                f"dtype of {prefix}{k} is float64 but jax_enable_x64 is off (it would silently become "
                "float32): enable it before creating arrays, or pass dtype=jnp.float32"
            )
    if problems:
        raise ConversionError(problems)

    # Everything checks out: build the whole new state, then update once.
    new: dict[str, np.ndarray] = {}
    stacks: dict[str, list] = {}
    for k, exp in expected.items():
        if k not in sd:
            continue
        a = exp.transform[0](sd[k], heads, hd)
        if dtype is not None:
            a = a.astype(dtype)
        if exp.layer is None:
            new[exp.flax_path] = a
        else:
            stacks.setdefault(exp.flax_path, [None] * num_layers)[exp.layer] = a
    for path, items in stacks.items():
        current = np.asarray(params[path].get_value())
        new[path] = np.stack([current[i] if a is None else a for i, a in enumerate(items)])
    for path, a in new.items():
        params[path].set_value(jnp.asarray(a))
    return LoadResult(missing, unexpected)


def from_torch(cls: type, cfg: Any, source: Any, *, seed: int = 0, prefix: str = "", dtype: Any = None, **kwargs: Any):
    """A new `cls(cfg, rngs=nnx.Rngs(seed), **kwargs)` whose parameters come from a torch
    checkpoint (strictly: every parameter must be there), without drawing random initial
    values that would be overwritten: the module is built with `nnx.eval_shape`, loaded,
    and only its dropout RNG state is made concrete (from `seed`).

    Besides saving the work of initialising, this skips compiling the random initialisers,
    which on a CPU takes seconds per new block shape. kwargs go to the constructor
    (num_layers=, final_norm= for an Encoder); source, prefix and dtype are those of
    `load_torch_state_dict`, which raises `ConversionError` on any problem.
    """
    from flax import nnx

    module = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(seed), **kwargs))
    load_torch_state_dict(module, source, prefix=prefix, strict=True, dtype=dtype)
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
    heads, hd, _ = _layout(module)
    params = _flax_params(module)
    out: dict[str, np.ndarray] = {}
    for name, exp in expected_torch_params(module).items():
        value = np.asarray(params[exp.flax_path].get_value())
        if exp.layer is not None:
            value = value[exp.layer]
        out[name] = np.array(exp.transform[1](value, heads, hd), order="C")  # keeps 0-d gates 0-d
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
