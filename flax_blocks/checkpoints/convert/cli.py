"""`python -m flax_blocks.checkpoints.convert SRC DST`: convert a checkpoint between torch names
and a Flax-layout .safetensors file, print a summary, exit 1 listing every problem.

torch -> Flax: SRC is a .pt/.pth (needs torch) or .safetensors with torch names; DST must be
  a .safetensors file: Flax paths (stacked layers) and, in its metadata, the config. The
  metadata records only what is known: what the tensors fix (d_model, d_ff, bias, layers,
  final norm, gates) and the options you give below; the rest is listed as not recorded.
Flax -> torch: SRC is such a Flax .safetensors; DST a .safetensors, or a .pt/.pth written
  with torch.save (needs torch) holding a state dict with torch names.

Other PyTorch checkpoint dialects (--dialect, detected from the key names by default): the
  Hugging Face families of flax_blocks.checkpoints.dialects.DIALECTS (hf-bert, hf-gpt2, hf-llama, ...; listed
  by --help and in docs/dialects.md); only the stack (layers, final norm) is read. A
  Hugging Face save_pretrained folder as SRC carries its own config: no flags needed.
  Flax -> torch with --dialect hf-*: DST gets the Hugging Face names of the stack.

  python -m flax_blocks.checkpoints.convert encoder.pt encoder_flax.safetensors \
      --num-heads 8 --norm pre --activation gelu
  python -m flax_blocks.checkpoints.convert encoder_flax.safetensors back.pt
  python -m flax_blocks.checkpoints.convert ./tiny-llama llama_flax.safetensors
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from typing import Any

import numpy as np

from flax_blocks.checkpoints.dialects import DIALECTS

FORMAT = "flax_blocks"
TORCH_SUFFIXES = (".pt", ".pth")

# Not properties of a checkpoint: training noise, initialisation, computation dtype and the
# attention implementation (options of kind "implementation").
_NOT_RECORDED = {"dropout", "init", "dtype", "attention", "attention_block"}

FINAL_NORM_HELP = "an Encoder's final norm (default: as the checkpoint has it, norm.weight present or not)"


def _config_fields() -> list[tuple[str, Any, Any]]:
    """(name, type hint, default) of every BlockConfig field the CLI takes as a flag (the
    options declared with cli=True in flax_blocks.core.options)."""
    from flax_blocks.core.config import BlockConfig
    from flax_blocks.core.options import BY_NAME

    hints = typing.get_type_hints(BlockConfig)
    return [(f.name, hints[f.name], f.default) for f in dataclasses.fields(BlockConfig) if BY_NAME[f.name].cli]


def _add_config_flag(ap: argparse._ArgumentGroup, name: str, hint: Any, default: Any) -> None:
    """--name-with-dashes for one BlockConfig field; the value stays None when not given."""
    flag = "--" + name.replace("_", "-")
    base = hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: the flag takes an X
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        base = inner[0] if len(inner) == 1 else hint
    from flax_blocks.core.options import BY_NAME

    text = BY_NAME[name].help
    default_note = " (not recorded unless given)"
    if typing.get_origin(base) is typing.Literal:
        ap.add_argument(flag, dest=name, choices=typing.get_args(base), default=None, help=text + default_note)
    elif base is bool:
        ap.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text + default_note)
    elif base in (int, float, str):
        ap.add_argument(flag, dest=name, type=base, default=None, metavar=name.upper(), help=text + default_note)
    elif typing.get_origin(base) is None and hasattr(base, "as_dict"):  # a structured option: its dict, as JSON
        ap.add_argument(flag, dest=name, type=json.loads, default=None, metavar="JSON", help=text + default_note)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flax_blocks.checkpoints.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="checkpoint to read: torch names (.pt/.pth/.safetensors) or a Flax .safetensors "
                                "written by this tool")
    ap.add_argument("dst", help="file to write: .safetensors (torch -> Flax, or Flax -> torch), or .pt/.pth "
                                "(Flax -> torch only, needs torch)")
    ap.add_argument("--num-heads", type=int, help="attention heads (not inferable from a torch checkpoint; "
                                                  "required for torch -> Flax unless it is a FeedForward)")
    ap.add_argument("--prefix", default="", help="read only torch names under this prefix, e.g. 'encoder.' "
                                                 "inside a whole nn.Transformer")
    ap.add_argument("--dialect", choices=list(DIALECTS), default=None,
                    help="the checkpoint's key names (torch -> Flax: detected when not given; Flax -> torch: "
                         "torch names unless given)")
    cfg = ap.add_argument_group("config (torch -> Flax): written into the Flax file's metadata only when given")
    for name, hint, default in _config_fields():
        _add_config_flag(cfg, name, hint, default)
    cfg.add_argument("--final-norm", dest="final_norm", action=argparse.BooleanOptionalAction, default=None,
                     help=FINAL_NORM_HELP)
    return ap


def _build(kind: str, cfg_dict: dict, num_layers: int | None, final_norm: bool | None):
    """An abstract module (nnx.eval_shape: shapes, no values) for the loaders to fill:
    every parameter is loaded strictly, so drawing (and compiling) an init is wasted work.
    Fields missing from cfg_dict take BlockConfig's defaults (they do not change the tensors)."""
    from flax import nnx

    from flax_blocks import blocks, stacks
    from flax_blocks.core.config import BlockConfig

    cfg = BlockConfig(**cfg_dict)
    cls = getattr(stacks if kind == "Encoder" else blocks, kind)  # a stack, or a block
    kw = {"num_layers": num_layers, "final_norm": final_norm} if kind == "Encoder" else {}
    return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), **kw))


def _summary(module, sd: dict[str, np.ndarray]) -> str:
    n = sum(int(np.prod(a.shape)) for a in sd.values())
    dtypes = sorted({str(a.dtype) for a in sd.values()})
    layers = getattr(module, "num_layers", 1)
    return f"{type(module).__name__}: {layers} layer(s), {len(sd)} tensors, {n:,} parameters, dtype {'/'.join(dtypes)}"


def _is_flax_file(path: str) -> bool:
    if not path.endswith(".safetensors"):
        return False
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        return (f.metadata() or {}).get("format") == FORMAT


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The config flags that were given: {BlockConfig field: value}."""
    return {name: getattr(args, name) for name, _, _ in _config_fields() if getattr(args, name, None) is not None}


def _save_torch(sd: dict[str, np.ndarray], path: str) -> None:
    """torch.save a {name: tensor} state dict (bfloat16 kept)."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"writing {path} needs PyTorch (pip install 'twin-blocks[torch]'); "
                          "or name the destination *.safetensors") from e

    def tensor(a: np.ndarray):
        if str(a.dtype) == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))

    torch.save({k: tensor(v) for k, v in sd.items()}, path)


def _flax_to_torch(args: argparse.Namespace) -> int:
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from flax_blocks.checkpoints.convert import load_flax_state_dict, torch_state_dict

    if not args.dst.endswith((".safetensors", *TORCH_SUFFIXES)):
        raise ValueError(f"cannot write {args.dst}: Flax -> torch writes a .safetensors, .pt or .pth file")
    ignored = [*_given(args), *(["num_heads"] if args.num_heads is not None else []),
               *(["final_norm"] if args.final_norm is not None else [])]
    if ignored:
        flags = ", ".join("--" + k.replace("_", "-") for k in ignored)
        print(f"note: {args.src} carries its config; ignoring {flags}", file=sys.stderr)
    with safe_open(args.src, "np") as f:
        meta = json.loads(f.metadata()["config"])
    module = _build(meta["kind"], meta["cfg"], meta.get("num_layers"), meta.get("final_norm"))
    load_flax_state_dict(module, args.src)
    sd = torch_state_dict(module)
    if args.dialect not in (None, "torch"):
        from flax_blocks.checkpoints.hf import to_hf

        sd = to_hf(module, args.dialect)
    if args.dst.endswith(TORCH_SUFFIXES):
        _save_torch(sd, args.dst)
    else:
        save_file(sd, args.dst)
    print(f"Flax -> torch: {_summary(module, sd)} -> {args.dst}")
    return 0


def _torch_to_flax(args: argparse.Namespace) -> int:
    from safetensors.numpy import save_file

    from flax_blocks.checkpoints import dialects
    from flax_blocks.checkpoints.convert import (
        ConversionError,
        flax_state_dict,
        infer_config,
        load_torch_state_dict,
        torch_state_dict,
    )
    from flax_blocks.core.config import BlockConfig

    if not args.dst.endswith(".safetensors"):
        raise ValueError(f"cannot write {args.dst}: torch -> Flax writes a .safetensors file (its metadata carries "
                         "the config); name the destination *.safetensors. To write torch names to a .pt, convert "
                         "that Flax file back: python -m flax_blocks.checkpoints.convert FLAX.safetensors OUT.pt")
    if os.path.isdir(args.src):
        return _hf_to_flax(args)
    sd, args.prefix, _ = dialects.prepare(args.src, args.dialect, args.prefix, args.num_heads,  # our names
                                          getattr(args, "num_kv_heads", None))  # (Falcon's grouped rows)
    report = infer_config(sd, prefix=args.prefix)
    info = report.inferred
    problems = []
    if "kind" not in info or "d_model" not in info:
        roots = sorted({k.split(".")[0] + "." for k in sd})[:8]
        problems.append(f"{args.src}: found no transformer parameters under prefix {args.prefix!r} "
                        f"(its keys start with {roots}; pass --prefix)")
    if args.num_heads is None and info.get("kind") != "FeedForward":
        problems.append("--num-heads is required: it cannot be inferred from a torch checkpoint")
    if problems:
        raise ConversionError(problems, header="cannot convert")

    fields = {f.name for f in dataclasses.fields(BlockConfig)}
    known: dict[str, Any] = {"d_model": info["d_model"], "bias": info["bias"]}
    if args.num_heads is not None:
        known["num_heads"] = args.num_heads
    if "d_ff" in info:
        known["d_ff"] = info["d_ff"]
    if not info.get("layer_norms", True):
        known["norm"] = "none"  # no norm tensors at all: that much is fixed
    for k, v in info.items():  # whatever else the inference reads that is a config field
        if k in fields and k not in known and k not in ("dtype", "num_layers"):
            known[k] = v
    if isinstance(info.get("dtype"), str) and info["dtype"] in ("float32", "float64", "bfloat16", "float16"):
        known["param_dtype"] = info["dtype"]
    known.update(_given(args))
    final_norm = args.final_norm if args.final_norm is not None else info.get("final_norm")

    build = dict(known)
    build.setdefault("num_heads", 1)  # a FeedForward has no heads
    if "norm" not in build and build.get("scaling", "none") != "none":
        build["norm"] = "pre"  # any norm placement has the same tensors; BlockConfig's default does not fit gates
    module = _build(info["kind"], build, info.get("num_layers"), final_norm)
    load_torch_state_dict(module, sd, prefix=args.prefix, dialect="torch")
    not_recorded = sorted(fields - set(known) - _NOT_RECORDED)
    meta = {"kind": info["kind"], "cfg": known, "num_layers": info.get("num_layers"), "final_norm": final_norm,
            "not_recorded": not_recorded}
    save_file(flax_state_dict(module), args.dst, metadata={"format": FORMAT, "config": json.dumps(meta)})
    print(f"torch -> Flax: {_summary(module, torch_state_dict(module))} -> {args.dst}")
    print("recorded: " + ", ".join(f"{k}={v!r}" for k, v in known.items())
          + (f", final_norm={final_norm!r}" if final_norm is not None else ""))
    if not_recorded:
        print(f"not recorded (give them to BlockConfig, or as --flags here): {', '.join(not_recorded)}")
    return 0


def _hf_to_flax(args: argparse.Namespace) -> int:
    """A Hugging Face save_pretrained folder -> a Flax .safetensors: every setting from its config."""
    from safetensors.numpy import save_file

    from flax_blocks.checkpoints.checkpoint import hf_config, read_folder
    from flax_blocks.checkpoints.convert import flax_state_dict, torch_state_dict
    from flax_blocks.checkpoints.hf import from_hf

    if not args.dst.endswith(".safetensors"):
        raise ValueError(f"cannot write {args.dst}: torch -> Flax writes a .safetensors file")
    given = [*_given(args), *(["num_heads"] if args.num_heads is not None else [])]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        print(f"note: {args.src} carries its config (config.json); ignoring {flags}", file=sys.stderr)
    config, _ = read_folder(args.src)
    dialect, _, _, _ = hf_config(config)
    module = from_hf(args.src)
    known = {f.name: getattr(module.cfg, f.name) for f in dataclasses.fields(module.cfg)
             if f.name not in _NOT_RECORDED}
    if known.get("rope_scaling") is not None:  # recorded as its dict, which BlockConfig reads back
        known["rope_scaling"] = known["rope_scaling"].as_dict()
    final_norm = module.final_norm is not None
    meta = {"kind": "Encoder", "cfg": known, "num_layers": module.num_layers, "final_norm": final_norm,
            "not_recorded": []}
    save_file(flax_state_dict(module), args.dst, metadata={"format": FORMAT, "config": json.dumps(meta)})
    print(f"Hugging Face {config.get('model_type')} (dialect {dialect}) -> Flax: "
          f"{_summary(module, torch_state_dict(module))} -> {args.dst}")
    print("recorded (from config.json): " + ", ".join(f"{k}={v!r}" for k, v in known.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import jax

    from flax_blocks.checkpoints.convert import ConversionError

    try:
        with jax.enable_x64(True):  # keep float64 checkpoints float64; the caller's setting is restored
            if _is_flax_file(args.src):
                return _flax_to_torch(args)
            return _torch_to_flax(args)
    except (ConversionError, FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
