"""torch-named weights -> a flax_blocks module, in place (`load_torch_state_dict`) or as a
new module (`from_torch`); a Flax-layout checkpoint back in (`load_flax_state_dict`).

Loading runs in three steps, each one concern:
    validate(...)  every problem (prefix, config contradictions, layer count, missing and
                   unexpected keys, shapes, dtypes, float64 without x64, abstract modules)
                   collected into one list;
    plan(...)      the new value of every Flax parameter (torch tensor -> Flax layout,
                   cast, stacked over layers), computed without touching the module;
    apply(...)     the plan placed (`flax_blocks.checkpoints.convert.place`: on the default device, or
                   sharded over a mesh as it is read) and written into the module at once.
A problem in `validate` raises one `ConversionError` before `plan` runs: nothing changes.
A checkpoint file is not read until `apply`: validation and planning see only its header's
names, shapes and dtypes (`flax_blocks.checkpoints.stream`), and `apply` reads each parameter (or each
device's slice of it) from the file once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ...core import declarations
from ...core.declarations import FINAL_NORM
from ...core.lm_config import ENCODER, components
from ...lm import LanguageModel
from .. import dialects, stream
from ..checkpoint import check_hf_source, hf_state_dict
from ..io import ConversionError, few, natural_key, ranges, read_state_dict
from .infer import ConfigReport, infer_config, norm_prefix, strip_prefix
from .place import LAYER, Expected, expected_torch_params, flax_params, materialize_rng_state, np_dtype, place_all


def _module_facts(module) -> dict[str, Any]:
    cfg = module.cfg
    facts: dict[str, Any] = {"kind": type(module).__name__, "d_model": cfg.d_model, "bias": cfg.bias}
    if facts["kind"] == "FeedForward":  # (its checkpoint shows the MLP's biases: infer_config's `bias` there)
        facts["bias"] = cfg.has_mlp_bias
    if facts["kind"] != "ResidualMHA":
        facts["d_ff"] = cfg.d_ff
    if facts["kind"] in declarations.STACKS:
        facts["num_layers"] = module.num_layers
        facts["final_norm"] = module.final_norm is not None
    if facts["kind"] == "Transformer":
        facts = {"kind": "Transformer"}  # its keys say the rest: strict loading checks every one
    return facts



def _suggest_prefix(raw: Mapping[str, Any], expected: Iterable[str]) -> str | None:
    """The key root under which most expected names are found, if any (e.g. "encoder.")."""
    expected = list(expected)
    roots = {k.split(".")[0] for k in raw if "." in k}
    counts = {r: sum(f"{r}.{k}" in raw for k in expected) for r in roots}
    best = max(counts, key=lambda r: counts[r], default=None)
    return f"{best}." if best is not None and counts[best] else None


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class _Source:
    """A checkpoint read and put in our torch names, relative to the module's root."""

    raw: dict[str, np.ndarray]  # as read (after translating another dialect's names)
    prefix: str  # normalised ("encoder." or "")
    sd: dict[str, np.ndarray]  # the keys under prefix, prefix removed
    hint: str | None  # why no dialect was recognised, for the error message


def _read(source: Any, prefix: str, dialect: str | None, num_heads: int | None = None) -> _Source:
    raw, prefix, hint = dialects.prepare(source, dialect, prefix, num_heads)
    prefix = norm_prefix(prefix)
    return _Source(raw, prefix, strip_prefix(raw, prefix), hint)


def _prefix_problems(src: _Source) -> list[str]:
    if src.prefix and not src.sd:
        roots = sorted({k.split(".")[0] + "." for k in src.raw})[:8]
        return [f"prefix {src.prefix!r} matches no key (the checkpoint's keys start with {roots})"]
    return []


def _config_problems(module, src: _Source) -> list[str]:
    """Where what the checkpoint's tensors fix (d_model, d_ff, bias, final norm) contradicts
    the module (num_layers: see `_layer_problems`)."""
    report = infer_config(src.sd) if src.sd else ConfigReport()
    facts = _module_facts(module)
    problems = []
    for key in ("d_model", "d_ff", "bias", "final_norm"):
        if key in report.inferred and key in facts and report.inferred[key] != facts[key]:
            fix = f" (pass final_norm={report.inferred[key]!r})" if key == "final_norm" else ""
            problems.append(f"config mismatch: {key} is {report.inferred[key]!r} in the checkpoint, "
                            f"{facts[key]!r} in the module{fix}")
    return problems


def _layer_problems(module, src: _Source) -> list[str]:
    num_layers = getattr(module, "num_layers", None)
    found = sorted({int(m.group(1)) for k in src.sd if (m := LAYER.match(k))})
    if num_layers is not None and found and found != list(range(num_layers)):
        return [f"layer count: checkpoint has layers {ranges(found)} ({len(found)}), "
                f"module has {num_layers} (0-{num_layers - 1})"]
    return []


def _key_problems(expected: dict[str, Expected], src: _Source, strict: bool, params: dict[str, Any],
                  missing: list[str], unexpected: list[str]) -> list[str]:
    """Missing and unexpected keys (errors when strict), and, when not strict, missing keys
    an abstract module has no value for."""
    import jax

    problems = []
    if strict and missing and len(missing) == len(expected) and not src.prefix:
        hint = _suggest_prefix(src.raw, expected)
        if hint:
            problems.append(f"no expected key at the top level; the weights seem to be under prefix={hint!r}")
    if strict:
        problems += [f"missing key {src.prefix}{k} (expected shape {expected[k].torch_shape})" for k in missing]
        problems += [f"unexpected key {src.prefix}{k} (shape {tuple(src.sd[k].shape)})" for k in unexpected]
    else:
        abstract = [k for k in missing if isinstance(params[expected[k].flax_path].get_value(), jax.ShapeDtypeStruct)]
        problems += [f"missing key {src.prefix}{k}: the module is abstract (nnx.eval_shape) and has no value for it"
                     for k in abstract]
    return problems


def _tensor_problems(expected: dict[str, Expected], src: _Source, cast) -> list[str]:
    """Shapes, non-floating dtypes, and float64 tensors that would silently become float32."""
    import jax

    problems, silent64 = [], []
    for k, exp in expected.items():
        if k not in src.sd:
            continue
        a = src.sd[k]
        if tuple(a.shape) != exp.torch_shape:
            problems.append(f"shape mismatch for {src.prefix}{k}: expected {exp.torch_shape}, found {tuple(a.shape)}")
        if not np.issubdtype(a.dtype, np.floating) and str(a.dtype) != "bfloat16":
            problems.append(f"dtype of {src.prefix}{k}: expected a floating dtype, found {a.dtype}")
        elif cast is None and a.dtype == np.float64 and not jax.config.read("jax_enable_x64"):
            silent64.append(src.prefix + k)
    if silent64:
        problems.append(
            f"{len(silent64)} tensor(s) are float64 ({few(silent64)}) but jax_enable_x64 is off (they would "
            "silently become float32): enable it before creating arrays, or pass dtype=jnp.float32"
        )
    return problems


def validate(module, src: _Source, expected: dict[str, Expected], *, strict: bool, cast,
             params: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(missing, unexpected) keys; raises one ConversionError listing every problem."""
    missing = sorted((k for k in expected if k not in src.sd), key=natural_key)
    unexpected = sorted((k for k in src.sd if k not in expected), key=natural_key)
    problems = (_prefix_problems(src) + _config_problems(module, src) + _layer_problems(module, src)
                + _key_problems(expected, src, strict, params, missing, unexpected)
                + _tensor_problems(expected, src, cast))
    if problems:
        raise ConversionError(problems + ([src.hint] if src.hint else []))
    return missing, unexpected


def plan(module, src: _Source, expected: dict[str, Expected], cast, params: dict[str, Any]) -> dict[str, Any]:
    """{Flax path: new value, a `stream.Lazy` read when placed} for every parameter the
    checkpoint holds: torch tensor -> Flax layout (`Param.transform`), cast, and stacked over
    layers (a stacked parameter partly loaded keeps the module's values for the layers the
    checkpoint lacks)."""
    new: dict[str, Any] = {}
    stacks: dict[str, list] = {}
    for k, exp in expected.items():
        if k not in src.sd:
            continue
        a = exp.param.transform.to_flax(stream.lazy(src.sd[k]), module.cfg)
        if cast is not None:
            a = a.astype(cast)
        if exp.layer is None:
            new[exp.flax_path] = a
        else:
            depth = params[exp.flax_path].get_value().shape[0]  # the stacked layer axis
            stacks.setdefault(exp.flax_path, [None] * depth)[exp.layer] = a
    for path, items in stacks.items():
        if all(a is not None for a in items):
            new[path] = stream.Stacked(items)
        else:  # the layers the checkpoint lacks keep the module's values
            current = np.asarray(params[path].get_value())
            new[path] = stream.Stacked([current[i] if a is None else a for i, a in enumerate(items)])
    return new


def apply(params: dict[str, Any], new: Mapping[str, Any], *, mesh: Any = None, rules: Any = None) -> None:
    """Place the planned values (read from the checkpoint now; sharded over `mesh` by `rules`
    when given) and write them into the module's parameters, all at once."""
    place_all(params, new, mesh=mesh, rules=rules)


def load_torch_state_dict(module, source: Any, *, prefix: str = "", strict: bool = True, dtype: Any = None,
                          dialect: str | None = None, mesh: Any = None, rules: Any = None) -> LoadResult:
    """Load torch-named weights into a flax_blocks module, in place.

    source: mapping of name -> array/tensor, a torch module, or a .safetensors/.pt/.pth path.
    prefix: only names starting with it are read (e.g. "encoder." or "encoder" inside a
      bigger model).
    strict: missing and unexpected keys are errors; with strict=False they are reported
      in the returned LoadResult and the module keeps its own values for missing ones.
    dtype: cast every tensor to this dtype (a name or a numpy / JAX / torch dtype);
      None keeps the checkpoint's dtypes.
    dialect: the checkpoint's key names ("torch", "hf-bert", "hf-gpt2", "hf-llama", ...; see
      flax_blocks.checkpoints.dialects.DIALECTS); None detects it from the key names. A transformers model
      object says its own family and is read as its save_pretrained writes it.
    mesh, rules: place every parameter sharded over `mesh` as it is read, by its declared
      logical axes through `rules` (`flax_blocks.sharding`; default TENSOR_PARALLEL: heads and
      the FFN width over "model"); None keeps a loaded value's placement (default device).
    Shape, dtype and layer-count problems are always errors. On any error nothing changes;
    a file's weights are read only once every check has passed.
    A whole model (`LanguageModel`) loads strictly, its twin's names (`_load_language_model`).
    """
    if isinstance(module, LanguageModel):
        if dialect not in (None, "torch"):
            raise ValueError("a LanguageModel loads its own (torch_blocks) names; Hugging Face models: fb.from_hf")
        _load_language_model(module, source, prefix=prefix, strict=strict, dtype=dtype, mesh=mesh, rules=rules)
        return LoadResult([], [])
    src = _read(hf_state_dict(source), prefix, check_hf_source(module.cfg, source, dialect), module.cfg.num_heads)
    cast = None if dtype is None else np_dtype(dtype)
    expected = expected_torch_params(module)
    params = flax_params(module)
    missing, unexpected = validate(module, src, expected, strict=strict, cast=cast, params=params)
    apply(params, plan(module, src, expected, cast, params), mesh=mesh, rules=rules)
    return LoadResult(missing, unexpected)


def _load_language_model(model: LanguageModel, source: Any, *, prefix: str = "", strict: bool = True,
                         dtype: Any = None, mesh: Any = None, rules: Any = None) -> None:
    """Load torch-named weights (the twin's state dict) into a whole model strictly and
    atomically: every problem of the model's own parts is raised before the stack is loaded,
    and the stack's before anything is written. A file is read tensor by tensor as each is
    placed (on `mesh` by `rules` when given)."""
    if not strict:
        raise ValueError("a LanguageModel loads strictly (strict=False is for blocks and stacks)")
    sd = {k[len(prefix):]: v for k, v in read_state_dict(source, lazy=True).items() if k.startswith(prefix)}
    own = {t: (name, p) for name, comp in components(model.lm, model.cfg)
           for t, _, p in declarations.flatten(comp, f"{name}.")}
    problems = [f"missing key {prefix}{t}" for t in own if t not in sd]
    problems += [f"unexpected key {prefix}{k}" for k in sd if k not in own and not k.startswith(ENCODER + ".")]
    problems += [f"{prefix}{t}: shape {tuple(sd[t].shape)}, expected {p.shape}"
                 for t, (_, p) in own.items() if t in sd and tuple(sd[t].shape) != p.shape]
    if problems:
        raise ConversionError(problems, header="cannot load this LanguageModel checkpoint")
    load_torch_state_dict(model.encoder, {k[len(ENCODER) + 1:]: v for k, v in sd.items()
                                          if k.startswith(ENCODER + ".")}, dtype=dtype, dialect="torch",
                          mesh=mesh, rules=rules)
    variables, values = {}, {}
    for t, (name, p) in own.items():
        a = stream.lazy(sd[t]) if dtype is None else stream.lazy(sd[t]).astype(np_dtype(dtype))  # torch's too
        variables[t], values[t] = getattr(getattr(model, name), p.flax), p.transform.to_flax(a, model.cfg)
    place_all(variables, values, mesh=mesh, rules=rules)


def from_torch_state_dict(cfg: Any, lm: Any, source: Any, *, seed: int = 0, dtype: Any = None, prefix: str = "",
                          mesh: Any = None, rules: Any = None) -> LanguageModel:
    """A new LanguageModel(cfg, lm) whose parameters all come from a torch-named state dict
    (the twin's, or one `flax_blocks.checkpoints.hf` translated), built without drawing random
    values; with `mesh`, each parameter is created sharded over it by `rules` as it is read."""
    from flax import nnx

    model = nnx.eval_shape(lambda: LanguageModel(cfg, lm, rngs=nnx.Rngs(seed)))
    _load_language_model(model, source, prefix=prefix, dtype=dtype, mesh=mesh, rules=rules)
    materialize_rng_state(model, seed, mesh=mesh)
    return model


def _checkpoint_has_final_norm(source: Any, prefix: str) -> tuple[Any, bool]:
    """(the source read into a dict, whether it holds the Encoder's final norm)."""
    sd = read_state_dict(source, lazy=True)
    return sd, f"{norm_prefix(prefix)}{FINAL_NORM}.weight" in sd


def from_torch(cls: type, cfg: Any, source: Any, *, seed: int = 0, prefix: str = "", dtype: Any = None,
               dialect: str | None = None, mesh: Any = None, rules: Any = None, **kwargs: Any):
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
    dialect: see `load_torch_state_dict` (None: detected from the key names).
    mesh, rules: every parameter is created sharded over `mesh` as it is read (each device
      reads only its slice; see `load_torch_state_dict`), the RNG state replicated on it.
    """
    from flax import nnx

    if "layout" in kwargs:  # the old name: say so instead of letting the constructor reject it
        raise TypeError("from_torch() takes dialect= (the checkpoint's key names; layout= was its old name), "
                        f"got layout={kwargs['layout']!r}")
    dialect = check_hf_source(cfg, source, dialect)
    dialects.check_against_source(cfg, source, kwargs.get("final_norm"))
    source, prefix, _ = dialects.prepare(hf_state_dict(source), dialect, prefix, cfg.num_heads, cfg.kv_heads)

    if cls.__name__ in declarations.STACKS and kwargs.get("final_norm") is None:
        source, kwargs["final_norm"] = _checkpoint_has_final_norm(source, prefix)
    module = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(seed), **kwargs))
    load_torch_state_dict(module, source, prefix=prefix, strict=True, dtype=dtype, dialect=dialect and "torch",
                          mesh=mesh, rules=rules)
    materialize_rng_state(module, seed, mesh=mesh)
    return module


def load_flax_state_dict(module, source: Any) -> None:
    """Load a Flax-layout checkpoint ({dotted Flax path: array} or a .safetensors path),
    strictly and atomically, into `module`."""
    sd = read_state_dict(source, lazy=True)
    params = flax_params(module)
    problems = [f"missing key {k} (expected shape {tuple(v.get_value().shape)})"
                for k, v in params.items() if k not in sd]
    problems += [f"unexpected key {k} (shape {tuple(sd[k].shape)})" for k in sd if k not in params]
    problems += [
        f"shape mismatch for {k}: expected {tuple(params[k].get_value().shape)}, found {tuple(a.shape)}"
        for k, a in sd.items() if k in params and tuple(a.shape) != tuple(params[k].get_value().shape)
    ]
    if problems:
        raise ConversionError(problems)
    place_all(params, {k: sd[k] for k in params})

