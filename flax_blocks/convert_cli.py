"""`python -m flax_blocks.convert SRC DST`: convert a checkpoint between the torch layout
and a Flax-layout .safetensors file, print a summary, exit 1 listing every problem.

torch -> Flax: SRC is a .pt/.pth (needs torch) or .safetensors with torch names; DST a
.safetensors with Flax paths (stacked layers) and the config in its metadata.
Flax -> torch: SRC is such a Flax .safetensors; DST a .safetensors (or .pt, with torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import numpy as np

FORMAT = "flax_blocks"


def _build(kind: str, cfg_dict: dict, num_layers: int | None, final_norm: bool | None):
    """An abstract module (nnx.eval_shape: shapes, no values) for the loaders to fill:
    every parameter is loaded strictly, so drawing (and compiling) an init is wasted work."""
    from flax import nnx

    import flax_blocks as fb

    cfg = fb.BlockConfig(**cfg_dict)
    cls = getattr(fb, kind)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flax_blocks.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--num-heads", type=int, help="attention heads (not inferable from a torch checkpoint)")
    ap.add_argument("--prefix", default="", help="read only torch names under this prefix, e.g. 'encoder.'")
    args = ap.parse_args(argv)

    import jax

    jax.config.update("jax_enable_x64", True)  # keep float64 checkpoints float64
    from safetensors.numpy import save_file

    from flax_blocks.convert import (ConversionError, flax_state_dict, infer_config, load_flax_state_dict,
                                     load_torch_state_dict, read_state_dict, torch_state_dict)

    try:
        if _is_flax_file(args.src):
            from safetensors import safe_open

            with safe_open(args.src, "np") as f:
                meta = json.loads(f.metadata()["config"])
            module = _build(meta["kind"], meta["cfg"], meta.get("num_layers"), meta.get("final_norm"))
            load_flax_state_dict(module, args.src)
            sd = torch_state_dict(module)
            if args.dst.endswith((".pt", ".pth")):
                import torch

                from torch_blocks.convert import to_tensors

                torch.save(to_tensors(sd), args.dst)
            else:
                save_file(sd, args.dst)
            print(f"Flax -> torch: {_summary(module, sd)} -> {args.dst}")
            return 0

        report = infer_config(args.src, prefix=args.prefix)
        info = report.inferred
        problems = []
        if "kind" not in info or "d_model" not in info:
            roots = sorted({k.split(".")[0] + "." for k in read_state_dict(args.src)})[:8]
            problems.append(f"{args.src}: found no transformer parameters under prefix {args.prefix!r} "
                            f"(its keys start with {roots}; pass --prefix)")
        if args.num_heads is None and info.get("kind") != "FeedForward":
            problems.append("--num-heads is required: it cannot be inferred from a torch checkpoint")
        if problems:
            raise ConversionError(problems, header="cannot convert")
        cfg = {"d_model": info["d_model"], "num_heads": args.num_heads or 1, "d_ff": info.get("d_ff", 4 * info["d_model"]),
               "bias": info["bias"], "norm": "post" if info["layer_norms"] else "none", "dropout": 0.0,
               "scaling": info.get("scaling", "none")}
        if cfg["scaling"] != "none":
            cfg["norm"] = "pre" if info["layer_norms"] else "none"
        module = _build(info["kind"], cfg, info.get("num_layers"), info.get("final_norm"))
        load_torch_state_dict(module, read_state_dict(args.src), prefix=args.prefix)
        sd = flax_state_dict(module)
        meta = {"kind": info["kind"], "cfg": asdict(module.cfg), "num_layers": info.get("num_layers"),
                "final_norm": info.get("final_norm")}
        save_file(sd, args.dst, metadata={"format": FORMAT, "config": json.dumps(meta)})
        print(f"torch -> Flax: {_summary(module, torch_state_dict(module))} -> {args.dst}")
        print(str(report))
        return 0
    except (ConversionError, FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
