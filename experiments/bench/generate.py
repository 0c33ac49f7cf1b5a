"""Speed of whole-model generation: fb.generate against Hugging Face's generate and the torch
twin's own cached loop, in one process, interleaved (timing.py's `interleaved`).

    python -m experiments.bench.generate                 # CPU, a few minutes -> experiments/bench/results/generate/
    python -m experiments.bench.generate --quick         # smoke run

Rows, each greedy (HF do_sample=False), from the same random LlamaForCausalLM weights:
  hf        transformers' generate, torch eager (its default attention), its dynamic cache
  fb        fb.generate: prompt in one chunk, then a jax.lax.while_loop inside one jit
            (compile excluded, reported apart)
  twin      torch_blocks.lm.generate: the torch twin's cached loop (a Python loop, eager)
  rerun     (cached vs re-running) one jit whose loop re-runs the model over the whole
            (prompt + new) buffer at every step, reading the logits at the next position:
            what generation costs without a cache at that length
Models: tiny (d_model 64, 2 layers, 4 heads, vocab 256) and d512 (8 layers, 8 heads,
d_ff 1376, vocab 1024); the re-run row on the tiny one. Batches 1 and 8; 64 and 256 new tokens after an 8-token prompt.
Tokens/s counts new tokens of every row (batch * new tokens / seconds).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_blocks as fb
import torch_blocks as tb
from torch_blocks.lm import generate as twin_generate

from .timing import interleaved, paired_ratio, summary

MODELS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=172, vocab_size=256),
    "d512": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                 intermediate_size=1376, vocab_size=1024),
}
PROMPT = 8


def hf_model(kw):
    import transformers

    config = transformers.LlamaConfig(**kw, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@functools.partial(jax.jit, static_argnames=("graphdef", "new"))
def rerun(graphdef, state, ids, *, new):
    """Greedy decoding without a cache: every step runs the whole (B, T + new) buffer."""
    b, t = ids.shape
    buf = jnp.concatenate([ids, jnp.zeros((b, new), ids.dtype)], axis=1)

    def body(i, buf):
        logits = nnx.merge(graphdef, state)(buf)
        nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, t + i - 1, axis=1, keepdims=False), -1)
        return jax.lax.dynamic_update_slice(buf, nxt[:, None].astype(buf.dtype), (0, t + i))

    return jax.lax.fori_loop(0, new, body, buf)


def run(args) -> dict:
    torch.set_num_threads(args.torch_threads) if args.torch_threads else None
    rows = []
    for name in args.models:
        hf = hf_model(MODELS[name])
        lm = fb.from_hf(hf, part="causal-lm")
        twin = tb.LanguageModel(lm.cfg, lm.lm)
        twin.load_state_dict(tb.to_tensors(fb.torch_state_dict(lm)), strict=True)
        twin.eval()
        graphdef, state = nnx.split(lm)
        for batch in args.batches:
            ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, (batch, PROMPT))
            tids = torch.tensor(ids)
            for new in args.new:
                t0 = time.perf_counter()
                jax.block_until_ready(fb.generate(lm, ids, max_new_tokens=new))
                compile_s = time.perf_counter() - t0
                fns = {
                    "fb": lambda lm=lm, ids=ids, new=new: jax.block_until_ready(
                        fb.generate(lm, ids, max_new_tokens=new)),
                    "hf": lambda hf=hf, tids=tids, new=new: hf.generate(tids, attention_mask=torch.ones_like(tids),
                                                                        max_new_tokens=new,
                                                                        do_sample=False, pad_token_id=0),
                    "twin": lambda twin=twin, tids=tids, new=new: twin_generate(twin, tids, max_new_tokens=new),
                }
                with torch.no_grad():
                    same = {k: np.asarray(f() if k != "fb" else fb.generate(lm, ids, max_new_tokens=new))
                            for k, f in fns.items()}
                times = interleaved(fns, args.reps, warmup=1)
                row = {"model": name, "batch": batch, "new": new, "fb_compile_s": compile_s,
                       "same_tokens": {k: bool(np.array_equal(same["fb"], v)) for k, v in same.items() if k != "fb"},
                       **{f"{k}_tok_s": batch * new / statistics.median(v) for k, v in times.items()},
                       **{f"{k}_ms": summary(v) for k, v in times.items()},
                       "fb_over_hf": paired_ratio(times["hf"], times["fb"]),
                       "fb_over_twin": paired_ratio(times["twin"], times["fb"])}
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("model", "batch", "new", "fb_tok_s", "hf_tok_s", "twin_tok_s",
                                                       "fb_compile_s", "same_tokens")}), flush=True)
        # cached vs re-running the prefix, at 256 positions (prompt + new tokens); the tiny
        # model only (re-running the d512 model's prefix 248 times takes minutes per repeat)
        if args.rerun and name == "tiny":
            ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, (1, PROMPT))
            new = args.rerun - PROMPT
            jax.block_until_ready(rerun(graphdef, state, jnp.asarray(ids), new=new))
            jax.block_until_ready(fb.generate(lm, ids, max_new_tokens=new))
            times = interleaved({
                "cached": lambda lm=lm, ids=ids, new=new: jax.block_until_ready(
                    fb.generate(lm, ids, max_new_tokens=new)),
                "rerun": lambda graphdef=graphdef, state=state, ids=ids, new=new: jax.block_until_ready(
                    rerun(graphdef, state, jnp.asarray(ids), new=new)),
            }, args.reps, warmup=1)
            agree = bool(np.array_equal(np.asarray(rerun(graphdef, state, jnp.asarray(ids), new=new)),
                                        np.asarray(fb.generate(lm, ids, max_new_tokens=new))))
            row = {"model": name, "positions": args.rerun, "cached_ms": summary(times["cached"]),
                   "rerun_ms": summary(times["rerun"]), "cached_speedup": paired_ratio(times["rerun"], times["cached"]),
                   "same_tokens": agree}
            rows.append(row)
            print(json.dumps({"model": name, "positions": args.rerun, "cached_speedup": row["cached_speedup"]["median"],
                              "same_tokens": agree}), flush=True)
    return {"rows": rows, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_after": os.getloadavg(), "jax": jax.__version__, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}


def markdown(result: dict) -> str:
    lines = ["| model | batch | new | fb tok/s | HF tok/s | twin tok/s | fb / HF | fb / twin | fb compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "new" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['new']} | {r['fb_tok_s']:.0f} | {r['hf_tok_s']:.0f} | "
                         f"{r['twin_tok_s']:.0f} | {r['fb_over_hf']['median']:.1f}x | "
                         f"{r['fb_over_twin']['median']:.1f}x | {r['fb_compile_s']:.1f} |")
    lines += ["", "| model | positions | cached ms | re-run ms | cached speed-up |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        if "positions" in r:
            lines.append(f"| {r['model']} | {r['positions']} | {r['cached_ms']['median_ms']:.0f} | "
                         f"{r['rerun_ms']['median_ms']:.0f} | {r['cached_speedup']['median']:.1f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--torch-threads", type=int, default=None)
    args = p.parse_args(argv)
    args.models = ["tiny"] if args.quick else list(MODELS)
    args.batches = [1] if args.quick else [1, 8]
    args.new = [8] if args.quick else [64, 256]
    args.rerun = 32 if args.quick else 256
    args.reps = args.reps or (2 if args.quick else 5)
    out = args.out or Path("experiments/bench/results/generate" + ("/quick" if args.quick else ""))
    result = run(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate.json").write_text(json.dumps(result, indent=1))
    (out / "generate.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
