"""Speed of the experts MLP (issue 53): the Flax dispatch at 8 and 64 experts, top-2, against a
dense MLP of the same active width, the torch twin and Hugging Face's Mixtral block, on the same
tokens, in one process, interleaved (timing.py's `interleaved`).

    python -m experiments.bench.moe --doc docs/speed.md   # CPU, ~5 minutes -> experiments/bench/results/moe/
    python -m experiments.bench.moe --quick           # smoke run (tiny sizes)

Rows, each forward and forward + backward (d tokens and d every weight of sum(y * r)), float32:
  flax X      flax_blocks.experts.Experts (router, top-k, grouped dispatch) under jax.jit
  flax dense  a SwiGLU MLP of width k * F under jax.jit: the FLOPs of the k active experts
  twin X      torch_blocks.experts.Experts (HF's eager loop over the experts that have tokens)
  torch dense the same dense SwiGLU in torch eager
  hf-eager X  transformers' MixtralSparseMoeBlock, experts_implementation="eager" (what a block
              built alone from its config runs: its config leaves the implementation unset)
  hf-grouped_mm X  the same block with "grouped_mm", what a MixtralForCausalLM picks by default
Every contender of a step is timed in the same shuffled repeats; ratios (64 / 8 experts, MoE /
dense, Flax / torch) are medians of per-repeat ratios. The torch twin and HF's block get the Flax
module's weights, and their outputs are compared before anything is timed. A profile of the Flax
forward, piece by piece (routing and layout, the loops over blocks, the gather back), is timed
apart, each piece its own jit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from flax import nnx

from flax_blocks.core import declarations
from flax_blocks.core.config import BlockConfig
from flax_blocks.experts import Experts, block_rows, block_size, expert_blocks, route

from .timing import interleaved, paired_ratio, summary

FULL = dict(batch=4, seq=512, d_model=256, expert_d_ff=512, top_k=2, experts=(8, 64), wide=(8, 32, 256))
QUICK = dict(batch=2, seq=16, d_model=32, expert_d_ff=16, top_k=2, experts=(4, 8), wide=(4, 4, 16))
# wide: (k, X, X'): top-k of X and of X' experts on the same tokens (DeepSeek-V3's top-8 of 256)
HF_IMPLS = ("eager", "grouped_mm")


def config(size: dict, x: int) -> BlockConfig:
    return BlockConfig(d_model=size["d_model"], num_heads=4, d_ff=size["expert_d_ff"], mlp="swiglu",
                       activation="silu", bias=False, dropout=0.0, num_experts=x,
                       num_experts_per_tok=size["top_k"], expert_d_ff=size["expert_d_ff"])


def flax_experts(size: dict, x: int) -> Experts:
    cfg = config(size, x)
    return Experts(cfg, declarations.experts(cfg), rngs=nnx.Rngs(x))


def twin_experts(module: Experts):
    import torch_blocks.experts as te

    twin = te.Experts(module.cfg, declarations.experts(module.cfg))
    with torch.no_grad():
        twin.router.copy_(torch.tensor(np.asarray(module.router[...]).T))
        for name in ("up", "gate", "down"):
            getattr(twin, name).copy_(torch.tensor(np.asarray(getattr(module, name)[...]).transpose(0, 2, 1)))
    return twin


def hf_block(module: Experts, impl: str):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = module.cfg
    hc = MixtralConfig(hidden_size=cfg.d_model, intermediate_size=cfg.experts_width,
                       num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                       hidden_act="silu", router_jitter_noise=0.0)
    hc._experts_implementation = impl
    block = MixtralSparseMoeBlock(hc)
    with torch.no_grad():
        block.gate.weight.copy_(torch.tensor(np.asarray(module.router[...]).T))
        up, gate = (np.asarray(module.up[...]).transpose(0, 2, 1), np.asarray(module.gate[...]).transpose(0, 2, 1))
        block.experts.gate_up_proj.copy_(torch.tensor(np.concatenate([gate, up], axis=1)))
        block.experts.down_proj.copy_(torch.tensor(np.asarray(module.down[...]).transpose(0, 2, 1)))
    return block


def dense_weights(size: dict, seed: int = 0) -> list[np.ndarray]:
    e, w = size["d_model"], size["top_k"] * size["expert_d_ff"]
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for s in ((e, w), (e, w), (w, e))]


def jax_dense(w, t):
    up, gate, down = w
    return (jax.nn.silu(t @ gate) * (t @ up)) @ down


def torch_dense(t, w):
    up, gate, down = w
    return (F.silu(t @ gate) * (t @ up)) @ down


def jax_fns(apply, params, t, r):
    """(forward, forward + backward) of apply(params, t) under jit; params and t are arguments."""
    fwd = jax.jit(apply)
    train = jax.jit(jax.value_and_grad(lambda p, t: jnp.sum(apply(p, t) * r), argnums=(0, 1)))
    return (lambda: jax.block_until_ready(fwd(params, t)), lambda: jax.block_until_ready(train(params, t)))


def torch_fns(apply, params, t, r):
    def fwd():
        with torch.no_grad():
            return apply(t)

    def train():
        x = t.detach().requires_grad_(True)
        return torch.autograd.grad((apply(x) * r).sum(), [*params, x])

    return fwd, train


def pieces(module: Experts, t: jax.Array) -> dict:
    """The Flax forward piece by piece, each its own jit: routing + layout + scatter into blocks,
    the loops over the blocks, the gather back and the weighted sum over the k picks."""
    from flax_blocks import experts as fe

    up, gate, down, router = (module.up[...], module.gate[...], module.down[...], module.router[...])
    cfg = module.cfg
    n, k, x = t.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    b = block_size(n * k, x)

    def prep(t, router):
        weights, experts = route(cfg, t @ router)
        experts = experts.reshape(-1)
        slot, _, _, nb = block_rows(experts, x, b)
        rows = jnp.zeros((nb * b, t.shape[1]), t.dtype).at[slot].set(jnp.repeat(t, k, axis=0)).reshape(nb, b, -1)
        return rows, expert_blocks(experts, x, b), slot, weights

    def loops(rows, up, gate, down, layout):
        return fe._blocks_mlp(rows, up, gate, down, layout, jax.nn.silu)

    def back(y, slot, weights):
        y = y.reshape(-1, y.shape[-1])[slot]
        return jnp.sum(y.reshape(n, k, -1) * weights[..., None], axis=1)

    jp, jl, jb = jax.jit(prep), jax.jit(loops), jax.jit(back)
    rows, layout, slot, weights = jp(t, router)
    y = jl(rows, up, gate, down, layout)
    counts = np.bincount(np.asarray(jnp.repeat(jnp.arange(x), layout[1])), minlength=x)
    info = {"block": b, "blocks": int(rows.shape[0]), "used_blocks": int(np.sum(np.asarray(layout[1]))),
            "rows": n * k, "rows_in_used_blocks": int(np.sum(np.asarray(layout[1]))) * b,
            "experts_with_rows": int(np.sum(counts > 0))}
    fns = {"route + layout + scatter": lambda: jax.block_until_ready(jp(t, router)),
           "loops over blocks": lambda: jax.block_until_ready(jl(rows, up, gate, down, layout)),
           "gather + weighted sum": lambda: jax.block_until_ready(jb(y, slot, weights))}
    return {"info": info, "fns": fns}


def cpu_timed(fns: dict, cpu: dict) -> dict:
    """fns, each also recording its process CPU seconds (every thread's) in cpu[name]: on a shared,
    busy machine a step's CPU time moves less with the neighbours than its wall time."""
    def wrap(name, f):
        def g():
            c = time.process_time()
            out = f()
            cpu.setdefault(name, []).append(time.process_time() - c)
            return out
        return g
    return {name: wrap(name, f) for name, f in fns.items()}


OP_KINDS = (("dots", ("ynn_fusion", "dot")), ("zero fills", ("broadcast",)),
            ("weight and block slices", ("dynamic-slice",)), ("writes into buffers", ("dynamic-update-slice",)),
            ("gradient sums", ("wrapped_add",)), ("sort, scatter, gather", ("sort", "scatter", "gather", "cumsum",
                                                                         "reduce-window")),
            ("copies", ("copy",)), ("loops and thunks", ("while", "ThunkExecutor::Execute")))


def op_kind(name: str) -> str | None:
    """The kind of an XLA:CPU trace event (an HLO op or the runtime's own), None for Python's."""
    if name.startswith("$") or "wait for completion" in name:
        return None
    for kind, marks in OP_KINDS:
        if any(name.startswith(m) or (m in name and kind != "loops and thunks") for m in marks):
            return kind
    return "elementwise and other"


def op_profile(fn, reps: int = 3) -> dict[str, float]:
    """ms per call of fn() by op kind (`op_kind`): the self time (children taken out) of every XLA:CPU
    op in a jax.profiler trace of `reps` calls."""
    import collections
    import gzip
    import tempfile

    fn()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(reps):
                fn()
        with gzip.open(next(Path(d).rglob("*.trace.json.gz"))) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            threads[(e["pid"], e["tid"])].append(e)
    kinds: dict[str, float] = collections.Counter()
    for evs in threads.values():
        stack: list = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack and (k := op_kind(stack[-1]["name"])):
                kinds[k] -= e["dur"]
            if k := op_kind(e["name"]):
                kinds[k] += e["dur"]
            stack.append(e)
    return {k: v / reps / 1e3 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}


def wide_run(size: dict, args, t_j, r_j) -> dict:
    """Top-k of X against top-k of X' experts (size["wide"]) on the same tokens, same widths: Flax
    forward and forward+backward, interleaved; wall and CPU times; each one's op profile."""
    k, xs, xb = size["wide"]
    fns: dict[str, dict] = {"forward": {}, "forward+backward": {}}
    for x in (xs, xb):
        module = flax_experts({**size, "top_k": k}, x)
        graphdef, state = nnx.split(module)

        def apply(state, t, graphdef=graphdef):
            return nnx.merge(graphdef, state)(t)[0]

        fwd, train = jax_fns(apply, state, t_j, r_j)
        fns["forward"][f"flax {x}"], fns["forward+backward"][f"flax {x}"] = fwd, train
    cpu: dict = {}
    times = {step: interleaved(cpu_timed(f, cpu.setdefault(step, {})), args.reps, warmup=1, max_s=args.max_s,
                               seed=11 + i) for i, (step, f) in enumerate(fns.items())}
    rows = [{"step": step, "contender": name, **summary(v), "min_ms": 1e3 * min(v),
             "cpu_median_ms": 1e3 * float(np.median(cpu[step][name][1:]))}
            for step, tt in times.items() for name, v in tt.items()]
    ratios = [{"step": step, "ratio": f"flax {xb} / flax {xs}", "clock": clock,
               **paired_ratio(*(src[f"flax {x}"][1 if clock == "cpu" else 0:] for x in (xb, xs)))}
              for step in times for clock, src in (("wall", times[step]), ("cpu", cpu[step]))]
    block = {str(x): block_size(size["batch"] * size["seq"] * k, x) for x in (xs, xb)}
    return {"k": k, "experts": [xs, xb], "rows": rows, "ratios": ratios, "block": block,
            "op_profile": {f"flax {x} top-{k}": op_profile(fns["forward+backward"][f"flax {x}"]) for x in (xs, xb)}}


def main_ratios(times: dict, size: dict) -> tuple[list, list]:
    """The rows (every contender's times) and the ratios (64 / 8 experts per family, MoE / dense,
    Flax / torch) of the interleaved steps, each ratio a median of per-repeat ratios."""
    x8, x64 = size["experts"]
    rows, ratios = [], []
    for step, tt in times.items():
        for name, v in tt.items():
            rows.append({"step": step, "contender": name, **summary(v), "min_ms": 1e3 * min(v)})
        for fam in ["flax", "twin", *(f"hf-{i}" for i in HF_IMPLS)]:
            ratios.append({"step": step, "ratio": f"{fam} {x64} / {fam} {x8}",
                           **paired_ratio(tt[f"{fam} {x64}"], tt[f"{fam} {x8}"])})
        for x in size["experts"]:
            ratios.append({"step": step, "ratio": f"flax {x} / flax dense",
                           **paired_ratio(tt[f"flax {x}"], tt["flax dense"])})
            ratios.append({"step": step, "ratio": f"twin {x} / torch dense",
                           **paired_ratio(tt[f"twin {x}"], tt["torch dense"])})
            for other in ["twin", *(f"hf-{i}" for i in HF_IMPLS)]:
                ratios.append({"step": step, "ratio": f"flax {x} / {other} {x}",
                               **paired_ratio(tt[f"flax {x}"], tt[f"{other} {x}"])})
        ratios.append({"step": step, "ratio": "flax dense / torch dense",
                       **paired_ratio(tt["flax dense"], tt["torch dense"])})
    return rows, ratios


def run(args) -> dict:
    size = QUICK if args.quick else FULL
    if getattr(args, "batch", None):
        size = {**size, "batch": args.batch}
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    n, e = size["batch"] * size["seq"], size["d_model"]
    rng = np.random.default_rng(0)
    t_np = rng.standard_normal((n, e)).astype(np.float32)
    r_np = rng.standard_normal((n, e)).astype(np.float32)
    t_j, r_j = jnp.asarray(t_np), jnp.asarray(r_np)
    t_t, r_t = torch.tensor(t_np), torch.tensor(r_np)
    fns: dict[str, dict] = {"forward": {}, "forward+backward": {}}
    agree, compile_s, profile = {}, {}, {}
    for x in size["experts"]:
        module = flax_experts(size, x)
        graphdef, state = nnx.split(module)

        def apply(state, t, graphdef=graphdef):
            return nnx.merge(graphdef, state)(t)[0]

        fwd, train = jax_fns(apply, state, t_j, r_j)
        s = time.perf_counter()
        fwd(), train()
        compile_s[f"flax {x}"] = time.perf_counter() - s
        fns["forward"][f"flax {x}"], fns["forward+backward"][f"flax {x}"] = fwd, train
        y_ref = np.asarray(apply(state, t_j))
        twin = twin_experts(module)
        contenders = {f"twin {x}": (lambda t, twin=twin: twin(t)[0], list(twin.parameters()))}
        for impl in HF_IMPLS:
            block = hf_block(module, impl)
            contenders[f"hf-{impl} {x}"] = (lambda t, block=block: block(t[None])[0], list(block.parameters()))
        for name, (fn, params) in contenders.items():
            with torch.no_grad():
                y = fn(t_t).numpy()
            agree[name] = float(np.max(np.abs(y - y_ref)) / np.max(np.abs(y_ref)))
            fns["forward"][name], fns["forward+backward"][name] = torch_fns(fn, params, t_t, r_t)
        p = pieces(module, t_j)
        profile[x] = p
    wj = [jnp.asarray(w) for w in dense_weights(size)]
    wt = [torch.tensor(w, requires_grad=True) for w in dense_weights(size)]
    fwd, train = jax_fns(jax_dense, wj, t_j, r_j)
    fns["forward"]["flax dense"], fns["forward+backward"]["flax dense"] = fwd, train
    f2, t2 = torch_fns(lambda t: torch_dense(t, wt), wt, t_t, r_t)
    fns["forward"]["torch dense"], fns["forward+backward"]["torch dense"] = f2, t2

    cpu: dict = {}
    times = {step: interleaved(cpu_timed(f, cpu.setdefault(step, {})), args.reps, warmup=1, max_s=args.max_s,
                               seed=i) for i, (step, f) in enumerate(fns.items())}
    ops = {f"flax {x} top-{size['top_k']}": op_profile(fns["forward+backward"][f"flax {x}"]) for x in size["experts"]}
    prof_times = {x: interleaved(p["fns"], args.reps, warmup=1, max_s=args.max_s / 4) for x, p in profile.items()}
    x8, x64 = size["experts"]
    rows, ratios = main_ratios(times, size)
    prof_rows = [{"experts": x, "piece": k, **summary(v), "min_ms": 1e3 * min(v)}
                 for x, pt in prof_times.items() for k, v in pt.items()]
    return {
        "size": {k: list(v) if isinstance(v, tuple) else v for k, v in size.items()},
        "tokens": n, "rows": rows, "ratios": ratios, "agree_max_rel_err": agree,
        "flax_compile_s": compile_s, "profile": prof_rows, "op_profile": ops,
        "cpu_ratios": [{"step": step, "ratio": f"flax {x64} / flax {x8}",
                        **paired_ratio(cpu[step][f"flax {x64}"][1:], cpu[step][f"flax {x8}"][1:])} for step in cpu],
        "wide": wide_run(size, args, t_j, r_j),
        "layout": {str(x): p["info"] for x, p in profile.items()},
        "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                 "command": " ".join(["python -m experiments.bench.moe", *args.argv]),
                 "wall_s": time.perf_counter() - t0, "reps": args.reps,
                 "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                 "load_before": load_before, "load_after": os.getloadavg(),
                 "python": sys.version.split()[0], "jax": jax.__version__, "torch": torch.__version__,
                 "transformers": __import__("transformers").__version__,
                 "torch_threads": torch.get_num_threads(), "jax_devices": str(jax.devices()),
                 "xla_flags": os.environ.get("XLA_FLAGS", "")},
    }


def markdown(res: dict) -> str:
    s, m = res["size"], res["meta"]
    x8, x64 = s["experts"]
    by = {(r["step"], r["contender"]): r for r in res["rows"]}
    ratio = {(r["step"], r["ratio"]): r for r in res["ratios"]}
    names = list(dict.fromkeys(r["contender"] for r in res["rows"]))
    lines = [
        "# Experts MLP: dispatch cost at 8 and 64 experts (top-2)",
        "",
        f"Regenerate: `{m['command']}` ({m['wall_s']:.0f} s, {m['date']}). Written whole by "
        "experiments/bench/moe.py; every number below is from this one run.",
        "",
        f"Tokens: {s['batch']} x {s['seq']} = {res['tokens']}, d_model {s['d_model']}, expert width F "
        f"{s['expert_d_ff']}, top-{s['top_k']} of {x8} and {x64} experts, SwiGLU experts, float32; dense: a SwiGLU "
        f"of width {s['top_k']} x F = {s['top_k'] * s['expert_d_ff']} (the active experts' FLOPs). "
        "Forward+backward: d tokens and d every weight of sum(y * r).",
        "",
        f"Machine: {m['machine']}, {m['cpus']} CPUs shared with other workers (load average "
        f"{' '.join(f'{v:.1f}' for v in m['load_before'])} before, {' '.join(f'{v:.1f}' for v in m['load_after'])} "
        f"after): timings are noisy; every contender of a step is timed in the same shuffled repeats "
        f"({m['reps']} asked), medians with min and interquartile range, ratios the median of per-repeat ratios. "
        f"jax {m['jax']}, torch {m['torch']} ({m['torch_threads']} threads), transformers {m['transformers']}, "
        f"python {m['python']}, XLA_FLAGS `{m['xla_flags'] or '(none)'}`.",
        "",
        "## Times (ms)",
        "",
        "| contender | forward median [IQR] | forward min | fwd+bwd median [IQR] | fwd+bwd min | n |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        f, t = by[("forward", name)], by[("forward+backward", name)]
        lines.append(f"| {name} | {f['median_ms']:.1f} [{f['p25_ms']:.1f}, {f['p75_ms']:.1f}] | {f['min_ms']:.1f} | "
                     f"{t['median_ms']:.1f} [{t['p25_ms']:.1f}, {t['p75_ms']:.1f}] | {t['min_ms']:.1f} | "
                     f"{f['n']}/{t['n']} |")
    lines += ["", "## Ratios (median of per-repeat ratios [IQR])", "",
              "| ratio | forward | forward+backward |", "|---|---|---|"]
    for key in dict.fromkeys(r["ratio"] for r in res["ratios"]):
        cells = [ratio[(step, key)] for step in ("forward", "forward+backward")]
        lines.append(f"| {key} | " + " | ".join(f"{c['median']:.2f} [{c['p25']:.2f}, {c['p75']:.2f}]" for c in cells)
                     + " |")
    acc = [ratio[(step, f"flax {x64} / flax {x8}")]["median"] for step in ("forward", "forward+backward")]
    cpu = {r["step"]: r for r in res.get("cpu_ratios", [])}
    cpu_line = (" In process CPU time (every thread's; it moves less with a busy machine's neighbours): forward "
                + ", forward+backward ".join(f"{cpu[st]['median']:.2f} [{cpu[st]['p25']:.2f}, {cpu[st]['p75']:.2f}]"
                                             for st in ("forward", "forward+backward")) + ".") if cpu else ""
    lines += ["", f"Acceptance (issue 53): flax {x64} / flax {x8} experts at most 1.5: forward {acc[0]:.2f}, "
              f"forward+backward {acc[1]:.2f}: **{'met' if max(acc) <= 1.5 else 'not met'}** in this run.{cpu_line}",
              "",
              "Outputs against the Flax module's (max abs difference / max abs output, float32): "
              + ", ".join(f"{k} {v:.1e}" for k, v in res["agree_max_rel_err"].items()) + ".", "",
              "Flax compile (forward + forward+backward, first call): "
              + ", ".join(f"{k} {v:.1f} s" for k, v in res["flax_compile_s"].items()) + ".", "",
              "## Profile: the Flax forward piece by piece (each piece its own jit, ms)", "",
              "| experts | piece | median [IQR] | min |", "|---|---|---|---|"]
    for p in res["profile"]:
        lines.append(f"| {p['experts']} | {p['piece']} | {p['median_ms']:.1f} [{p['p25_ms']:.1f}, {p['p75_ms']:.1f}] | "
                     f"{p['min_ms']:.1f} |")
    lines += ["", "Layout: " + "; ".join(
        f"{x} experts: blocks of {i['block']} rows, {i['used_blocks']} of {i['blocks']} blocks used, "
        f"{i['rows_in_used_blocks']} rows computed for {i['rows']} (token, expert) rows, "
        f"{i['experts_with_rows']} experts with rows" for x, i in res["layout"].items()) + "."]
    return "\n".join(lines + wide_markdown(res) + ops_markdown(res)) + "\n"


def wide_markdown(res: dict) -> list[str]:
    """The top-k of X against top-k of X' section (DeepSeek's expert counts), from res["wide"]."""
    if "wide" not in res:
        return []
    w, s = res["wide"], res["size"]
    xs, xb = w["experts"]
    by = {(r["step"], r["contender"]): r for r in w["rows"]}
    lines = ["", f"## Top-{w['k']} of {xb} experts against top-{w['k']} of {xs} (the same {res['tokens']} tokens)", "",
             f"d_model {s['d_model']}, F {s['expert_d_ff']}, SwiGLU experts, float32, Flax only (forward+backward: "
             f"d tokens and d every weight); blocks of {w['block'][str(xs)]} and {w['block'][str(xb)]} rows. "
             f"{xb} experts hold {xb // xs}x the weights of {xs} for the same FLOPs.", "",
             "| contender | forward median [IQR] ms | forward CPU ms | fwd+bwd median [IQR] ms | fwd+bwd CPU ms |",
             "|---|---|---|---|---|"]
    for x in (xs, xb):
        f, t = by[("forward", f"flax {x}")], by[("forward+backward", f"flax {x}")]
        lines.append(f"| flax {x} top-{w['k']} | {f['median_ms']:.1f} [{f['p25_ms']:.1f}, {f['p75_ms']:.1f}] | "
                     f"{f['cpu_median_ms']:.1f} | {t['median_ms']:.1f} [{t['p25_ms']:.1f}, {t['p75_ms']:.1f}] | "
                     f"{t['cpu_median_ms']:.1f} |")
    lines += ["", "| ratio (median of per-repeat ratios [IQR]) | clock | forward | forward+backward |",
              "|---|---|---|---|"]
    rat = {(r["step"], r["clock"]): r for r in w["ratios"]}
    for clock in ("wall", "cpu"):
        lines.append(f"| flax {xb} / flax {xs} | {clock} | " + " | ".join(
            f"{rat[(st, clock)]['median']:.2f} [{rat[(st, clock)]['p25']:.2f}, {rat[(st, clock)]['p75']:.2f}]"
            for st in ("forward", "forward+backward")) + " |")
    return lines


def ops_markdown(res: dict) -> list[str]:
    """The forward+backward's op profile (jax.profiler trace, self time by op kind), from res["op_profile"]."""
    profiles = {**res.get("op_profile", {}), **res.get("wide", {}).get("op_profile", {})}
    if not profiles:
        return []
    kinds = list(dict.fromkeys(k for p in profiles.values() for k in p))
    lines = ["", "## Profile: forward+backward by op kind (jax.profiler trace; ms of self time per call, "
             "XLA:CPU ops; the trace's own overhead included, so sums exceed the step's time)", "",
             "| op kind | " + " | ".join(profiles) + " |", "|---|" + "---|" * len(profiles)]
    for k in kinds:
        lines.append(f"| {k} | " + " | ".join(f"{p.get(k, 0.0):.1f}" for p in profiles.values()) + " |")
    lines.append("| total | " + " | ".join(f"{sum(p.values()):.1f}" for p in profiles.values()) + " |")
    return lines


DOC_START, DOC_END = "<!-- moe-table:start -->", "<!-- moe-table:end -->"


def doc_table(res: dict, source: str) -> str:
    """The short table docs/speed.md shows: Flax's 64 / 8 ratios, MoE / dense, Flax against the
    torch twin and HF's block, each a median of per-repeat ratios [IQR], from one run's JSON."""
    s, m = res["size"], res["meta"]
    x8, x64 = s["experts"]
    ratio = {(r["step"], r["ratio"]): r for r in res["ratios"]}
    by = {(r["step"], r["contender"]): r for r in res["rows"]}
    keys = [f"flax {x64} / flax {x8}", f"twin {x64} / twin {x8}", *(f"hf-{i} {x64} / hf-{i} {x8}" for i in HF_IMPLS),
            f"flax {x8} / flax dense", f"flax {x64} / flax dense", f"twin {x8} / torch dense",
            f"twin {x64} / torch dense",
            *(f"flax {x} / {o} {x}" for x in (x8, x64) for o in ["twin", *(f"hf-{i}" for i in HF_IMPLS)])]
    lines = [f"From [`{source}`](../{source}) (`{m['command']}`, {m['date']}, load average "
             f"{m['load_before'][0]:.1f} before, {m['load_after'][0]:.1f} after; {res['tokens']} tokens, d_model "
             f"{s['d_model']}, F {s['expert_d_ff']}, top-{s['top_k']}, float32; torch {m['torch_threads']} threads):",
             "", "| ratio (median of per-repeat ratios [IQR]) | forward | forward+backward |", "|---|---|---|"]
    for key in keys:
        cells = [ratio[(step, key)] for step in ("forward", "forward+backward")]
        lines.append(f"| {key} | " + " | ".join(f"{c['median']:.2f} [{c['p25']:.2f}, {c['p75']:.2f}]" for c in cells)
                     + " |")
    lines += ["", "| median ms | " + " | ".join(dict.fromkeys(r["contender"] for r in res["rows"])) + " |",
              "|---|" + "---|" * len(dict.fromkeys(r["contender"] for r in res["rows"]))]
    for step in ("forward", "forward+backward"):
        lines.append(f"| {step} | " + " | ".join(f"{by[(step, n)]['median_ms']:.0f}"
                                               for n in dict.fromkeys(r["contender"] for r in res["rows"])) + " |")
    return "\n".join(lines) + "\n"


def splice(path: Path, table: str) -> None:
    """Replace what lies between the moe-table markers of `path` with `table`."""
    text = path.read_text()
    if text.count(DOC_START) != 1 or text.count(DOC_END) != 1:
        raise SystemExit(f"{path} needs one {DOC_START} and one {DOC_END}")
    head, rest = text.split(DOC_START)
    path.write_text(head + DOC_START + "\n" + table + rest[rest.index(DOC_END):])


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.bench.moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", "--smoke", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--batch", type=int, default=None,
                   help=f"sequences of {FULL['seq']} tokens (default {FULL['batch']}; more: more rows per expert)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--max-s", type=float, default=None, help="stop each step's repeats after this many seconds")
    p.add_argument("--torch-threads", type=int, default=None, help="default: JAX's CPU count (os.cpu_count())")
    p.add_argument("--doc", type=Path, default=None,
                   help="write the short ratio table into this file (docs/speed.md) between the moe-table markers")
    p.add_argument("--from-json", type=Path, default=None, help="with --doc: the table from a run's moe.json, no run")
    args = p.parse_args(argv)
    args.argv = argv
    if args.from_json is not None:
        if args.doc is None:
            raise SystemExit("--from-json needs --doc")
        result = json.loads(args.from_json.read_text())
        splice(args.doc, doc_table(result, args.from_json.as_posix()))
        return result
    args.reps = args.reps or (3 if args.quick else 5)
    args.max_s = args.max_s or (5.0 if args.quick else 60.0)
    args.torch_threads = args.torch_threads or os.cpu_count()
    out = args.out or Path("experiments/bench/results/moe" + ("/quick" if args.quick else ""))
    result = run(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text(markdown(result))
    if args.doc is not None:
        splice(args.doc, doc_table(result, (out / "moe.json").as_posix()))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
