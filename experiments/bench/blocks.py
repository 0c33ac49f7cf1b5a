"""Speed of the twin blocks, JAX against PyTorch, measured side by side in one process.

    python -m experiments.bench                  # CPU defaults, < 5 min -> experiments/bench/results/blocks/
    python -m experiments.bench --quick          # smoke run (tests)
    python -m experiments.bench --peak-tflops bfloat16=989 --peak-tflops float32=67   # on a GPU

What it measures (every timing: warm-up, then R repeats interleaved in shuffled order
across the contenders of one configuration, median and interquartile range; ratios are
medians of per-repeat ratios, so the contenders of a ratio share the machine's state):

  peak      the machine's matmul rate: a large jnp.dot and torch.mm, float32 (+ bf16 on GPU)
  block     TransformerBlock forward and train step (forward + backward w.r.t. every
            parameter, loss sum(y * r) with a random cotangent r): JAX jitted, PyTorch
            eager, torch.compile (train step, target sizes), optionally JAX with tuned
            compile options (--tuned; see XLA_TUNED_CPU); achieved FLOP/s against the peak; JAX compile
            time and XLA's temp-buffer size
  encoder   Encoder of the experiments' shapes (d_model 64, 6 and 24 layers), same contenders,
            plus JAX with the layers unrolled (scan_layers=False)
  depth     compile time of an Encoder train step against depth: layers scanned (the
            default) or unrolled (scan_layers=False)
  seeds     S seeds of a small causal LM (the experiments' quick-preset shapes; Adam) trained
            K steps under lax.scan: one program vmapped over seeds vs S sequential runs
  targets   the CPU targets the project set itself (check_targets), checked on this run's numbers

Model FLOPs are counted analytically (matmuls only, 3x the forward for a train step), the
same count for both frameworks. Dropout is 0. The machine is usually shared: the JSON
records the load average before and after, and each row its IQR.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from flax_blocks import BlockConfig
from flax_blocks.blocks import TransformerBlock
from flax_blocks.checkpoints.convert import torch_state_dict
from flax_blocks.stacks import Encoder

from .timing import interleaved, paired_ratio, summary

DEFAULT_OUT = Path("experiments/bench/results/blocks")

# XLA CPU options for the optional "jax+xla_tuned" rows (--tuned): the memory-optimised
# scheduler runs a step's thunks in a cache-friendly order instead of overlapping independent
# ones; it changes no arithmetic. Neutral to 5% on the 2-core CPU. Routing dots to oneDNN
# (xla_cpu_use_onednn) crashed on vmapped programs (double free), so it is not used.
XLA_TUNED_CPU: dict[str, Any] = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}

# An XLA flag the benchmark set by default until a paired study settled it: float32 dots through
# XLA's Eigen path instead of jaxlib 0.10's YNNPACK fusions. Five interleaved pairs of
# processes on the bench's four target rows (`python -m experiments.bench.xla_flags`,
# experiments/bench/results/xla_flags.md): JAX flag/default 0.856 at d256 T128 B8, 1.008 at d512,
# 0.984 at T2048 causal, 1.045 at T8192 causal; torch 0.966-0.991. It helps the small-head
# rows and costs the long ones, so by the rule fixed before the runs (> 5 % faster on every
# row) it is dropped: the benchmark runs XLA's defaults, as a user gets them, and sets the
# flag only with --cpu-dot-flag (it is process-wide and must reach XLA before the backend).
CPU_DOT_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def configure_xla(defaults: bool) -> None:
    """Add CPU_DOT_FLAG to XLA_FLAGS (before any backend exists) unless `defaults` (the
    benchmark's default since the flag study: see CPU_DOT_FLAG)."""
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    if defaults or "xla_cpu_experimental_ynn_fusion_type" in flags:
        return
    if xla_bridge._backends:  # too late: the flag would be silently ignored
        raise RuntimeError("configure_xla must run before JAX initialises a backend")
    os.environ["XLA_FLAGS"] = (flags + " " + CPU_DOT_FLAG).strip()


def xla_tuned() -> dict[str, Any]:
    return dict(XLA_TUNED_CPU) if jax.default_backend() == "cpu" else {}


# ------------------------------------------------------------------------------------
# Sizes
# ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    name: str
    d_model: int
    num_heads: int
    d_ff: int
    batch: int
    seq: int
    layers: int = 1  # 1 with block=True: a TransformerBlock; else an Encoder of `layers`
    block: bool = True
    target: bool = False  # a target size (check_targets): also torch.compile and tuned XLA
    options: tuple[tuple[str, Any], ...] = ()  # further BlockConfig fields (the LLaMA-like row)
    reps: int | None = None  # timed repeats (default --reps): the T 32768 row runs one train step
    fwd: bool = True  # also time the forward

    def cfg(self, dtype: str) -> BlockConfig:
        return BlockConfig(**{**dict(d_model=self.d_model, num_heads=self.num_heads, d_ff=self.d_ff, dropout=0.0,
                                     norm="pre", dtype=dtype, param_dtype=dtype), **dict(self.options)})

    def flops(self, train: bool) -> float:
        """Matmul FLOPs: projections 2*tokens*(E*(H+2K)*hd + E^2 + (2 or 3)*E*F), attention
        4*B*T^2*E; x3 to train."""
        cfg = self.cfg("float32")
        e, f, b, t = self.d_model, self.d_ff, self.batch, self.seq
        qkv = e * (cfg.num_heads + 2 * cfg.kv_heads) * cfg.head_width
        mlp = (3 if cfg.gated else 2) * e * f
        fwd = self.layers * (2 * b * t * (qkv + e * e + mlp) + 4 * b * t * t * e)
        return 3 * fwd if train else fwd


LLAMA_LIKE = (("norm_type", "rmsnorm"), ("mlp", "swiglu"), ("activation", "silu"), ("rope_theta", 10000.0),
              ("num_kv_heads", 4), ("bias", False), ("causal", True))


SIZES = {
    "cpu": [
        Size("block d64 T32", 64, 4, 256, 32, 32),
        Size("block d256 T128", 256, 8, 1024, 8, 128, target=True),
        Size("block d512 T128", 512, 8, 2048, 8, 128, target=True),
        Size("block d256 T512", 256, 8, 1024, 2, 512),
        Size("block d256 T128 llama-like", 256, 8, 1024, 8, 128, options=LLAMA_LIKE),
        Size("block d256 T2048", 256, 8, 1024, 1, 2048),  # long sequences: the blocked attention
        Size("block d256 T2048 causal", 256, 8, 1024, 1, 2048, options=(("causal", True),)),
        Size("block d256 T8192", 256, 8, 1024, 1, 8192),
        Size("block d256 T8192 causal", 256, 8, 1024, 1, 8192, options=(("causal", True),)),
        Size("block d256 T32768 causal", 256, 8, 1024, 1, 32768, options=(("causal", True),), reps=1, fwd=False),
        Size("encoder d64 L6", 64, 4, 256, 32, 32, layers=6, block=False),
        Size("encoder d64 L24", 64, 4, 256, 32, 32, layers=24, block=False),
    ],
    "gpu": [
        Size("block d512 T512", 512, 8, 2048, 16, 512),
        Size("block d1024 T1024", 1024, 16, 4096, 16, 1024, target=True),
        Size("block d1024 T2048", 1024, 16, 4096, 8, 2048, target=True),  # the MFU target row
        Size("block d2048 T1024", 2048, 16, 8192, 8, 1024, target=True),
        Size("encoder d1024 L12", 1024, 16, 4096, 8, 1024, layers=12, block=False, target=True),
        Size("encoder d64 L6", 64, 4, 256, 32, 32, layers=6, block=False),
    ],
    "quick": [
        Size("block d32 T16", 32, 4, 64, 4, 16, target=True),
        Size("encoder d16 L2", 16, 2, 32, 2, 8, layers=2, block=False),
        Size("block d32 T16 llama-like", 32, 8, 64, 4, 16, options=LLAMA_LIKE),
    ],
}


# ------------------------------------------------------------------------------------
# Timing (the timer and statistics: timing.py)
# ------------------------------------------------------------------------------------


class Clock:
    """A deadline shared by every section: later, lower-priority work is skipped, not cut."""

    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()


# ------------------------------------------------------------------------------------
# Frameworks
# ------------------------------------------------------------------------------------


class Torch:
    """PyTorch side, imported lazily (the benchmark still runs JAX-only without torch)."""

    def __init__(self, device: str | None):
        import torch

        import torch_blocks

        self.torch, self.tb = torch, torch_blocks
        self.device = device or ("cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu")
        self.cuda = self.device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def dtype(self, name: str):
        return {"float32": self.torch.float32, "bfloat16": self.torch.bfloat16, "float64": self.torch.float64}[name]

    def model(self, size: Size, dtype: str):
        cfg = size.cfg(dtype)
        m = self.tb.TransformerBlock(cfg) if size.block else self.tb.Encoder(cfg, num_layers=size.layers)
        return m.to(self.device)

    def fns(self, m, x, r, compiled: bool = False):
        torch = self.torch
        run = torch.compile(m, dynamic=False) if compiled else m

        def fwd():
            with torch.no_grad():
                run(x)
            self.sync()

        def train():
            m.zero_grad(set_to_none=True)
            (run(x) * r).sum().backward()
            self.sync()

        return fwd, train

    def peak_memory(self, fn) -> int | None:
        if not self.cuda:
            return None
        self.torch.cuda.reset_peak_memory_stats()
        fn()
        return int(self.torch.cuda.max_memory_allocated())


def jax_model(size: Size, dtype: str, seed: int = 0, scan_layers: bool = True):
    cfg = size.cfg(dtype)
    m = (TransformerBlock(cfg, rngs=nnx.Rngs(seed)) if size.block
         else Encoder(cfg, num_layers=size.layers, scan_layers=scan_layers, rngs=nnx.Rngs(seed)))
    return nnx.split(m, nnx.Param, ...)


REMAT_VARIANTS = (None, "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
JAX_VS_TORCH_EAGER = ("jax / torch", "jax unrolled / torch")  # the ratios the targets and docs/speed.md's table take

BASE_OPTIONS: dict[str, Any] = {}  # set by --opt-level (CPU only): applied to every JAX compile


def compile_jax(fn, *args, options: dict[str, Any] | None = None):
    """AOT-compile; returns (compiled, trace+lower s, compile s, temp bytes or None)."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile({**BASE_OPTIONS, **(options or {})} or None)
    t2 = time.perf_counter()
    temp = None
    try:
        ma = compiled.memory_analysis()
        temp = int(ma.temp_size_in_bytes) if ma is not None else None
    except Exception:  # noqa: BLE001 - not every backend reports it
        pass
    return compiled, t1 - t0, t2 - t1, temp


def jax_step_fns(graphdef, rest):
    def forward(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    def train(params, x, r):
        return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x) * r))(params)

    return forward, train


def jax_device_peak_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
        return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
    except Exception:  # noqa: BLE001
        return None


# ------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------


@dataclass
class Bench:
    args: argparse.Namespace
    clock: Clock
    torch: Torch | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    ratios: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    peak: dict[str, float] = field(default_factory=dict)  # dtype -> FLOP/s

    def log(self, msg: str) -> None:
        print(f"[{self.clock.elapsed():6.1f}s] {msg}", flush=True)

    def add(self, section: str, name: str, contender: str, times: list[float], **extra: Any) -> dict[str, Any]:
        row = {"section": section, "name": name, "contender": contender, **summary(times), **extra}
        if "flops" in extra and extra["flops"]:
            rate = extra["flops"] / (row["median_ms"] / 1e3)
            row["gflops"] = rate / 1e9
            peak = self.peak.get(extra.get("dtype", "float32"))
            if peak:
                row["pct_peak"] = 100 * rate / peak
            chip = self.args.chip_peak.get(extra.get("dtype", "float32"))
            if chip:
                row["mfu_pct"] = 100 * rate / chip
        self.rows.append(row)
        return row

    # -- peak ---------------------------------------------------------------------
    def run_peak(self, dtypes: list[str]) -> None:
        """The peak is the best rate over repeats (the machine's capability when nothing
        else runs); workloads are reported at their median, so % peak is conservative."""
        for dtype in dtypes:
            best = 0.0
            for n in self.args.peak_n:
                a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
                ja = jnp.asarray(a, dtype)
                mm = jax.jit(lambda x, y: x @ y)
                fns = {"jnp.dot": lambda mm=mm, ja=ja: mm(ja, ja).block_until_ready()}
                if self.torch:
                    th = self.torch
                    ta = th.torch.from_numpy(a).to(th.device, th.dtype(dtype))

                    def tmm(ta=ta, th=th):
                        th.torch.mm(ta, ta)
                        th.sync()

                    fns["torch.mm"] = tmm
                times = interleaved(fns, reps=self.args.peak_reps, warmup=1)
                flops = 2.0 * n ** 3
                for k, v in times.items():
                    rate = flops / min(v)
                    self.add("peak", f"matmul {n}^3 {dtype}", k, v, flops=flops, dtype=dtype, best_gflops=rate / 1e9)
                    best = max(best, rate)
            self.peak[dtype] = best
            for row in self.rows:
                if row["section"] == "peak" and row.get("dtype") == dtype:
                    row["pct_peak"] = 100 * row["gflops"] * 1e9 / best
            self.log(f"peak {dtype}: {best / 1e9:.1f} GFLOP/s (best of repeats)")

    # -- blocks and encoders -------------------------------------------------------
    def run_size(self, size: Size, dtype: str) -> None:
        section = "block" if size.block else "encoder"
        name = f"{size.name} B{size.batch} {dtype}"
        rng = np.random.default_rng(1)
        xn = rng.standard_normal((size.batch, size.seq, size.d_model)).astype(np.float32)
        rn = rng.standard_normal((size.batch, size.seq, size.d_model)).astype(np.float32)
        x, r = jnp.asarray(xn, dtype), jnp.asarray(rn, dtype)
        fns: dict[str, Callable[[], Any]] = {}
        meta: dict[str, dict[str, Any]] = {}
        variants = [("jax", {}, True)]
        if size.target and self.args.tuned and xla_tuned():
            variants.append(("jax+xla_tuned", xla_tuned(), True))
        if not size.block:  # stacks: also the unrolled layers (scan_layers=False), same weights
            variants.append(("jax unrolled", {}, False))
        for label, opts, scan_layers in variants:
            graphdef, params, rest = jax_model(size, dtype, scan_layers=scan_layers)
            forward, train = jax_step_fns(graphdef, rest)
            cf, _, cs_f, mem_f = compile_jax(forward, params, x, options=opts)
            ct, _, cs_t, mem_t = compile_jax(train, params, x, r, options=opts)
            fns[f"{label} fwd"] = lambda cf=cf, params=params: jax.block_until_ready(cf(params, x))
            fns[f"{label} train"] = lambda ct=ct, params=params: jax.block_until_ready(ct(params, x, r))
            meta[f"{label} fwd"] = {"compile_s": cs_f, "xla_temp_bytes": mem_f}
            meta[f"{label} train"] = {"compile_s": cs_t, "xla_temp_bytes": mem_t}
        if self.torch:
            th = self.torch
            tm = th.model(size, dtype)
            tx = th.torch.from_numpy(xn).to(th.device, th.dtype(dtype))
            tr = th.torch.from_numpy(rn).to(th.device, th.dtype(dtype))
            fwd, tr_fn = th.fns(tm, tx, tr)
            fns["torch fwd"], fns["torch train"] = fwd, tr_fn
            if size.target and self.args.torch_compile:
                est = 150.0 if not self.args.quick else 60.0
                if self.clock.left() > est:
                    tmc = th.model(size, dtype)
                    tmc.load_state_dict(tm.state_dict())
                    _, ctrain = th.fns(tmc, tx, tr, compiled=True)
                    t0 = time.perf_counter()
                    ctrain()
                    meta["torch.compile train"] = {"compile_s": time.perf_counter() - t0}
                    fns["torch.compile train"] = ctrain
                else:
                    self.skipped.append(f"{name}: torch.compile (time budget)")
        for k in list(fns):
            if k.endswith("fwd") and not (self.args.fwd and size.fwd):
                del fns[k]
        times = interleaved(fns, reps=size.reps or self.args.reps, warmup=1, max_s=self.args.max_config_s)
        for k, v in times.items():
            contender, mode = k.rsplit(" ", 1)
            extra = dict(meta.get(k, {}))
            if self.torch and contender.startswith("torch") and self.torch.cuda:
                extra["peak_bytes"] = self.torch.peak_memory(fns[k])
            self.add(section, name, k, v, flops=size.flops(mode == "train"), dtype=dtype, mode=mode,
                      d_model=size.d_model, seq=size.seq, batch=size.batch, layers=size.layers, target=size.target,
                      **extra)
        for mode in ("fwd", "train"):
            for base in ("torch", "torch.compile"):
                for cont in ("jax", "jax+xla_tuned", "jax unrolled"):
                    a, b = f"{cont} {mode}", f"{base} {mode}"
                    if a in times and b in times:
                        self.ratios.append({"section": section, "name": name, "mode": mode, "ratio": f"{cont} / {base}",
                                            "target": size.target, "d_model": size.d_model, "dtype": dtype,
                                            **paired_ratio(times[a], times[b])})
            a, b = f"jax+xla_tuned {mode}", f"jax {mode}"
            if a in times and b in times:
                self.ratios.append({"section": section, "name": name, "mode": mode, "ratio": "jax+xla_tuned / jax",
                                    "target": size.target, "d_model": size.d_model, "dtype": dtype,
                                    **paired_ratio(times[a], times[b])})
        best = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        self.log(f"{name}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in best.items()))

    # -- compile time against depth -------------------------------------------------
    def run_depth(self) -> None:
        size = (Size("depth", 64, 4, 256, 32, 32, block=False) if not self.args.quick
                else Size("depth", 16, 2, 32, 2, 8, block=False))
        x = jnp.ones((size.batch, size.seq, size.d_model), jnp.float32)
        r = jnp.ones_like(x)
        for mode, depths in (("scan", self.args.scan_depths), ("unrolled", self.args.unrolled_depths)):
            for depth in depths:
                if self.clock.left() < (5 if self.args.quick else 20 if mode == "scan" else 10 * depth):
                    self.skipped.append(f"depth: {mode} {depth} layers (time budget)")
                    continue
                model = Encoder(size.cfg("float32"), num_layers=depth, scan_layers=mode == "scan", rngs=nnx.Rngs(0))
                graphdef, params, rest = nnx.split(model, nnx.Param, ...)
                _, train = jax_step_fns(graphdef, rest)
                _, lower_s, compile_s, _ = compile_jax(train, params, x, r)
                self.rows.append({"section": "depth", "name": f"encoder d{size.d_model} train step",
                                  "contender": f"{mode} {depth} layers",
                                  "mode": mode, "layers": depth, "lower_s": lower_s, "compile_s": compile_s,
                                  "total_s": lower_s + compile_s})
                self.log(f"depth {mode} {depth}: trace+lower {lower_s:.2f} s, compile {compile_s:.2f} s")

    # -- generation: cached vs re-running the prefix ----------------------------------
    def run_generate(self) -> None:
        """Greedy-style generation of a `gen_tokens`-position sequence (a start position and
        n - 1 generated, each the output at the last position fed back as the next input)
        from a LLaMA-like causal Encoder: with the cache (one jitted step, compiled once)
        against re-running the whole causal prefix every step (JAX: one jitted full-length
        call on a fixed buffer; torch: the growing prefix). Rates: generated positions/s."""
        a = self.args
        n, B = a.gen_tokens, 1
        cfg = BlockConfig(d_model=64, num_heads=4, num_kv_heads=2, d_ff=256, norm="pre", norm_type="rmsnorm",
                          mlp="swiglu", activation="silu", rope_theta=1e4, bias=False, causal=True, dropout=0.0)
        model = Encoder(cfg, num_layers=4, rngs=nnx.Rngs(0))
        x0 = jax.random.normal(jax.random.key(0), (B, 1, cfg.d_model))
        step = nnx.jit(lambda m, x, c: m(x, cache=c))

        @nnx.jit
        def prefix_step(m, buf, t):
            y = m(buf)  # the whole causal prefix again (positions past t are masked out by causality)
            return jax.lax.dynamic_update_slice(buf, jax.lax.dynamic_slice_in_dim(y, t, 1, axis=1), (0, t + 1, 0))

        def jax_cached():
            c, x = model.init_cache(B, n), x0
            for _ in range(n - 1):
                x, c = step(model, x, c)
            jax.block_until_ready(x)

        def jax_prefix():
            buf = jnp.zeros((B, n, cfg.d_model)).at[:, :1].set(x0)
            for t in range(n - 1):
                buf = prefix_step(model, buf, jnp.asarray(t))
            jax.block_until_ready(buf)

        fns = {"jax cached": jax_cached, "jax re-run prefix": jax_prefix}
        if self.torch is not None:
            torch, tb = self.torch.torch, self.torch.tb
            tmodel = tb.Encoder(cfg, num_layers=4).eval()
            tmodel.load_state_dict(tb.to_tensors(torch_state_dict(model)), strict=True)
            tx0 = torch.from_numpy(np.asarray(x0))

            def torch_cached():
                with torch.no_grad():
                    c, x = tmodel.init_cache(B, n), tx0
                    for _ in range(n - 1):
                        x, c = tmodel(x, cache=c)

            def torch_prefix():
                with torch.no_grad():
                    buf = tx0
                    for _ in range(n - 1):
                        buf = torch.cat([buf, tmodel(buf)[:, -1:]], dim=1)

            fns.update({"torch cached": torch_cached, "torch re-run prefix": torch_prefix})
        times = interleaved(fns, reps=a.gen_reps, warmup=1)
        name = f"generate {n} positions, LLaMA-like d64 L4 B{B}"
        for k, v in times.items():
            self.add("generate", name, k, v, tokens_per_s=(n - 1) / statistics.median(v))
        for fw in ("jax", "torch"):
            if f"{fw} cached" in times:
                self.ratios.append({"section": "generate", "name": name, "mode": fw, "ratio": "re-run prefix / cached",
                                    **paired_ratio(times[f"{fw} re-run prefix"], times[f"{fw} cached"])})
        self.log("generate: " + ", ".join(f"{k} {(n - 1) / statistics.median(v):.0f} tok/s" for k, v in times.items()))

    # -- rematerialisation: memory and time of the scanned train step ---------------
    def run_remat(self) -> None:
        """Encoder train step (the experiments' width) with each layer rematerialised or not:
        XLA's temp memory and the time, interleaved with torch eager on the same stack."""
        a = self.args
        base = (Size("remat", 16, 2, 32, 2, 8, block=False) if a.quick
                else Size("remat", 64, 4, 256, 32, 32, block=False))
        rng = np.random.default_rng(2)
        xn = rng.standard_normal((base.batch, base.seq, base.d_model)).astype(np.float32)
        rn = rng.standard_normal((base.batch, base.seq, base.d_model)).astype(np.float32)
        x, r = jnp.asarray(xn), jnp.asarray(rn)
        for depth in a.remat_depths:
            if self.clock.left() < (10 if a.quick else 40):
                self.skipped.append(f"remat L{depth} (time budget)")
                continue
            size = replace(base, layers=depth)
            name = f"encoder d{base.d_model} L{depth} B{base.batch} T{base.seq} float32"
            fns: dict[str, Callable[[], Any]] = {}
            meta: dict[str, dict[str, Any]] = {}
            for remat in REMAT_VARIANTS:
                model = Encoder(size.cfg("float32"), num_layers=depth, remat=remat, rngs=nnx.Rngs(0))
                graphdef, params, rest = nnx.split(model, nnx.Param, ...)
                _, train = jax_step_fns(graphdef, rest)
                ct, _, cs, mem = compile_jax(train, params, x, r)
                key = f"jax remat={remat or 'none'}"
                fns[key] = lambda ct=ct, params=params: jax.block_until_ready(ct(params, x, r))
                meta[key] = {"compile_s": cs, "xla_temp_bytes": mem, "remat": remat or "none"}
            if self.torch:
                th = self.torch
                _, fns["torch eager"] = th.fns(th.model(size, "float32"), th.torch.from_numpy(xn).to(th.device),
                                               th.torch.from_numpy(rn).to(th.device))
            times = interleaved(fns, reps=a.reps, warmup=1, max_s=a.max_config_s)
            for k, v in times.items():
                self.add("remat", name, k, v, layers=depth, flops=size.flops(True), **meta.get(k, {}))
                if k != "torch eager" and "torch eager" in times:
                    self.ratios.append({"section": "remat", "name": name, "mode": "train",
                                        "ratio": f"{k} / torch eager",
                                        "target": False, **paired_ratio(v, times["torch eager"])})
            self.log(f"remat {name}: " + ", ".join(
                f"{k} {1e3 * statistics.median(v):.1f} ms {_fmt_bytes(meta.get(k, {}).get('xla_temp_bytes'))}"
                for k, v in times.items()))

    # -- seeds under vmap -----------------------------------------------------------
    def run_seeds(self) -> None:
        a = self.args
        lm = TinyLM(layers=a.seed_layers, d_model=a.seed_d_model, vocab=32, seq=a.seed_seq, heads=4,
                    d_ff=4 * a.seed_d_model)
        S, K, B = a.seeds, a.seed_steps, a.seed_batch
        tokens = jax.random.randint(jax.random.key(0), (S, K, B, lm.seq + 1), 0, lm.vocab)
        states = [lm.init(jax.random.key(s)) for s in range(S)]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        run_one = lm.run_steps
        run_all = jax.vmap(lm.run_steps)
        c1, _, cs1, _ = compile_jax(run_one, states[0], tokens[0])
        cv, _, csv, _ = compile_jax(run_all, stacked, tokens)

        def sequential():
            out = [c1(states[s], tokens[s]) for s in range(S)]
            jax.block_until_ready(out)

        def vmapped():
            jax.block_until_ready(cv(stacked, tokens))

        times = interleaved({"sequential": sequential, "vmap": vmapped}, reps=a.seed_reps, warmup=1)
        name = f"{S} seeds x {K} Adam steps, LM d{lm.d_model} L{lm.layers} B{B} T{lm.seq}"
        for k, v in times.items():
            steps_per_s = S * K / statistics.median(v)
            self.add("seeds", name, k, v, compile_s=cs1 if k == "sequential" else csv, steps_per_s=steps_per_s,
                     tokens_per_s=steps_per_s * B * lm.seq)
        self.ratios.append({"section": "seeds", "name": name, "mode": "train",
                            "ratio": "sequential / vmap (throughput gain)",
                            "target": True, **paired_ratio(times["sequential"], times["vmap"])})
        self.log(f"seeds: sequential {statistics.median(times['sequential']):.2f} s, "
                 f"vmap {statistics.median(times['vmap']):.2f} s")


@dataclass(frozen=True)
class TinyLM:
    """Causal LM of the experiments' quick-preset shapes: embedding + positions ->
    flax_blocks.Encoder (pre-LN, causal) -> head; Adam (0.9, 0.98, 1e-9), lr 1e-3."""

    layers: int
    d_model: int
    vocab: int
    seq: int
    heads: int
    d_ff: int

    def cfg(self) -> BlockConfig:
        return BlockConfig(d_model=self.d_model, num_heads=self.heads, d_ff=self.d_ff, dropout=0.0,
                           norm="pre", causal=True, init="xavier")

    def graph(self):
        enc = Encoder(self.cfg(), num_layers=self.layers, rngs=nnx.Rngs(0))
        return nnx.split(enc, nnx.Param, ...)

    def opt(self):
        return optax.adam(1e-3, b1=0.9, b2=0.98, eps=1e-9)

    def init(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        enc = Encoder(self.cfg(), num_layers=self.layers, rngs=nnx.Rngs(k1))
        _, enc_params, _ = nnx.split(enc, nnx.Param, ...)
        params = {
            "embed": 0.7 * jax.random.normal(k2, (self.vocab, self.d_model)),
            "pos": 0.7 * jax.random.normal(k3, (self.seq, self.d_model)),
            "encoder": nnx.to_pure_dict(enc_params),
            "head": jax.random.normal(k4, (self.d_model, self.vocab)) / math.sqrt(self.d_model),
        }
        return params, self.opt().init(params)

    def run_steps(self, state, tokens):
        """state (params, opt_state); tokens (K, B, T + 1) -> (state, losses (K,))."""
        graphdef, template, rest = self.graph()
        opt = self.opt()

        def loss_fn(params, batch):
            enc_state = nnx.State(template)
            nnx.replace_by_pure_dict(enc_state, params["encoder"])
            x = params["embed"][batch[:, :-1]] + params["pos"]
            h = nnx.merge(graphdef, enc_state, rest)(x)
            logits = h @ params["head"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        def step(state, batch):
            params, opt_state = state
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        return jax.lax.scan(step, state, tokens)


# ------------------------------------------------------------------------------------
# Targets and reports
# ------------------------------------------------------------------------------------


def check_targets(b: Bench) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in b.ratios:
        if r["section"] == "block" and r["target"] and r["mode"] == "train" and r["ratio"] in (
                "jax / torch", "jax / torch.compile",
                "jax+xla_tuned / torch", "jax+xla_tuned / torch.compile"):
            out.append({"target": f"train step {r['ratio']} <= 1.0, {r['name']}", "value": r["median"],
                        "pass": r["median"] <= 1.0, "spread": f"[{r['p25']:.2f}, {r['p75']:.2f}]"})
    for row in b.rows:
        if row["section"] == "block" and row.get("d_model", 0) >= 256 and row.get("mode") == "train" \
                and row["contender"].startswith("jax") and "pct_peak" in row:
            out.append({"target": f"{row['contender']} >= 50% of matmul peak, {row['name']}",
                        "value": row["pct_peak"] / 100,
                        "pass": row["pct_peak"] >= 50, "spread": ""})
    depth = {(r["mode"], r["layers"]): r["total_s"] for r in b.rows if r["section"] == "depth"}
    scans = sorted(layers for mode, layers in depth if mode == "scan")
    if len(scans) >= 2:
        lo, hi = scans[0], scans[-1]
        ratio = depth[("scan", hi)] / depth[("scan", lo)]
        out.append({"target": f"compile {hi} layers / {lo} layers (scan) <= 1.5", "value": ratio,
                    "pass": ratio <= 1.5, "spread": ""})
    # the experiments' small deep stacks, T 512, the T 8192 memory bound, remat memory
    for r in b.ratios:
        if r["ratio"] not in JAX_VS_TORCH_EAGER or r["mode"] != "train":
            continue
        limit = 1.0 if (r["section"] == "encoder" or r["d_model"] == 64) else 1.1 if "T512" in r["name"] else None
        if limit is not None:
            out.append({"target": f"train step {r['ratio']} <= {limit}, {r['name']}", "value": r["median"],
                        "pass": r["median"] <= limit, "spread": f"[{r['p25']:.2f}, {r['p75']:.2f}]"})
    for row in b.rows:
        if (row["section"] == "block" and row.get("seq", 0) == 8192 and row["contender"] == "jax train"
                and row.get("xla_temp_bytes")):
            mib = row["xla_temp_bytes"] / 2 ** 20
            out.append({"target": f"XLA temp MiB <= 256, train step {row['name']}", "value": mib,
                        "pass": mib <= 256, "spread": ""})
    # long sequences at torch's speed (block d256 B1, T 2048 and 8192, causal and not)
    for r in b.ratios:
        if r["section"] == "block" and r["ratio"] == "jax / torch" and r["d_model"] == 256 \
                and any(f" T{t} " in f" {r['name']} " for t in (2048, 8192)):
            limit = 1.3 if r["mode"] == "train" else 1.2
            out.append({"target": f"{r['mode']} {r['ratio']} <= {limit}, {r['name']}", "value": r["median"],
                        "pass": r["median"] <= limit, "spread": f"[{r['p25']:.2f}, {r['p75']:.2f}]"})
    jt = {r["name"]: r["median_ms"] for r in b.rows if r["section"] == "block" and r["contender"] == "jax train"}
    for name, ms in jt.items():
        if " T8192 causal " in f" {name} " and name.replace(" causal", "") in jt:
            ratio = ms / jt[name.replace(" causal", "")]
            out.append({"target": f"JAX train step causal / non-causal <= 0.6, {name.replace(' causal', '')}",
                        "value": ratio, "pass": ratio <= 0.6, "spread": "(medians of two rows)"})
    temps = {(r["name"], r.get("remat")): r.get("xla_temp_bytes") for r in b.rows if r["section"] == "remat"}
    for (name, remat), temp in temps.items():
        ref = temps.get((name, "none"))
        if remat == "full" and temp and ref and " L24 " in f" {name} ":
            out.append({"target": f"XLA temp remat=full / none <= 0.33, {name}", "value": temp / ref,
                        "pass": temp / ref <= 1 / 3, "spread": ""})
    for r in b.ratios:
        if r["section"] == "seeds":
            out.append({"target": f"{r['name']}: vmap throughput / sequential >= 2", "value": r["median"],
                        "pass": r["median"] >= 2.0, "spread": f"[{r['p25']:.2f}, {r['p75']:.2f}]"})
    return out


def _fmt_bytes(n: int | None) -> str:
    if not n:
        return ""
    return f"{n / 2 ** 20:.1f} MiB"


def markdown(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [f"# Benchmark: twin blocks, JAX vs PyTorch ({m['date']})", "",
             f"Device: {m['device']} ({m['jax_backend']}), {m['cpu_count']} CPU cores; "
             f"jax {m['jax']}, flax {m['flax']}, "
             f"torch {m.get('torch', 'n/a')} ({m.get('torch_threads', '?')} threads). "
             f"Load average before / after: {m['load_before']} / {m['load_after']}. Wall time {m['wall_s']:.0f} s. "
             f"XLA_FLAGS: `{m['xla_flags'] or '(none: XLA defaults)'}`.", "",
             "Medians over interleaved repeats (IQR in brackets); ratios are medians of per-repeat ratios. "
             "FLOP/s count matmul FLOPs analytically (train = 3x forward).", ""]
    rows = result["rows"]
    peak = [r for r in rows if r["section"] == "peak"]
    if peak:
        lines += ["## Matmul peak (best of repeats; rows below use medians)", "",
                  "| matmul | contender | median ms | GFLOP/s at median | best GFLOP/s |", "|---|---|---:|---:|---:|"]
        lines += [f"| {r['name']} | {r['contender']} | {r['median_ms']:.1f} | {r['gflops']:.1f} | "
                  f"{r['best_gflops']:.1f} |" for r in peak]
        lines += ["", "Peak used for % peak: "
                  f"{', '.join(f'{k} {v / 1e9:.1f} GFLOP/s' for k, v in result['peak_flops'].items())}."]
        lines.append("")
    for section in ("block", "encoder"):
        sec = [r for r in rows if r["section"] == section]
        if not sec:
            continue
        has_mfu = any("mfu_pct" in r for r in sec)
        lines += [f"## {section.capitalize()}: forward (fwd) and train step (fwd + bwd)", "",
                  "| config | contender | median ms [IQR] | GFLOP/s | % peak |" + (" MFU % |" if has_mfu else "")
                  + " compile s | memory | steps/s |",
                  "|---|---|---:|---:|---:|" + ("---:|" if has_mfu else "") + "---:|---:|---:|"]
        for r in sec:
            cells = [r["name"], r["contender"], f"{r['median_ms']:.1f} [{r['p25_ms']:.1f}, {r['p75_ms']:.1f}]",
                     f"{r.get('gflops', 0):.1f}", f"{r.get('pct_peak', 0):.0f}"]
            if has_mfu:
                cells.append(f"{r.get('mfu_pct', 0):.1f}")
            cells += [f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "",
                      _fmt_bytes(r.get("peak_bytes") or r.get("xla_temp_bytes")), f"{1e3 / r['median_ms']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "memory: XLA's temp buffers of the compiled step (JAX); device peak (torch on GPU).", ""]
    ratios = [r for r in result["ratios"] if r["section"] in ("block", "encoder")]
    if ratios:
        lines += ["## Ratios (time / time; < 1 means the first is faster)", "",
                  "| config | mode | ratio | median [IQR] |", "|---|---|---|---:|"]
        lines += [f"| {r['name']} | {r['mode']} | {r['ratio']} | "
                  f"{r['median']:.2f} [{r['p25']:.2f}, {r['p75']:.2f}] |" for r in ratios]
        lines.append("")
    depth = [r for r in rows if r["section"] == "depth"]
    if depth:
        lines += ["## Compile time against depth (Encoder train step)", "",
                  "| layers applied by | layers | trace+lower s | compile s | total s |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['mode']} | {r['layers']} | {r['lower_s']:.2f} | {r['compile_s']:.2f} | "
                  f"{r['total_s']:.2f} |" for r in depth]
        lines.append("")
    seeds = [r for r in rows if r["section"] == "seeds"]
    if seeds:
        lines += ["## Seeds: one vmapped program vs sequential runs", "",
                  "| workload | contender | median s | steps/s (all seeds) | compile s |",
                  "|---|---|---:|---:|---:|"]
        lines += [f"| {r['name']} | {r['contender']} | {r['median_ms'] / 1e3:.2f} | {r['steps_per_s']:.1f} | "
                  f"{r['compile_s']:.1f} |" for r in seeds]
        lines.append("")
    gen = [r for r in rows if r["section"] == "generate"]
    if gen:
        lines += ["## Generation: cached decoding against re-running the prefix", "",
                  "| workload | contender | median s [IQR] | positions/s |", "|---|---|---:|---:|"]
        lines += [f"| {r['name']} | {r['contender']} | {r['median_ms'] / 1e3:.2f} [{r['p25_ms'] / 1e3:.2f}, "
                  f"{r['p75_ms'] / 1e3:.2f}] | {r['tokens_per_s']:.0f} |" for r in gen]
        lines += [f"| {r['name']} | {r['mode']}: {r['ratio']} | {r['median']:.2f} [{r['p25']:.2f}, {r['p75']:.2f}] | |"
                  for r in result["ratios"] if r["section"] == "generate"]
        lines.append("")
    remat = [r for r in rows if r["section"] == "remat"]
    if remat:
        none = {r["name"]: r.get("xla_temp_bytes") for r in remat if r.get("remat") == "none"}
        vs_torch = {(r["name"], r["ratio"].split(" / ")[0]): r for r in result["ratios"] if r["section"] == "remat"}
        lines += ["## Rematerialisation: Encoder train step, each layer recomputed in the backward or not", "",
                  "| config | contender | median ms [IQR] | / torch eager [IQR] | XLA temp | temp / none |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in remat:
            q = vs_torch.get((r["name"], r["contender"]))
            temp, ref = r.get("xla_temp_bytes"), none.get(r["name"])
            lines.append(f"| {r['name']} | {r['contender']} | "
                         f"{r['median_ms']:.1f} [{r['p25_ms']:.1f}, {r['p75_ms']:.1f}] | "
                         + (f"{q['median']:.2f} [{q['p25']:.2f}, {q['p75']:.2f}]" if q else "")
                         + f" | {_fmt_bytes(temp)} | "
                         + (f"{temp / ref:.2f}" if temp and ref else "") + " |")
        lines.append("")
    if result["targets"]:
        lines += ["## Targets (this run)", "", "| target | value | IQR | holds |",
                  "|---|---:|---|---|"]
        lines += [f"| {t['target']} | {t['value']:.2f} | {t['spread']} | {'yes' if t['pass'] else 'NO'} |"
                  for t in result["targets"]]
        lines.append("")
    if result["skipped"]:
        lines += ["Skipped: " + "; ".join(result["skipped"]), ""]
    return "\n".join(lines)


DOC = Path("docs/speed.md")  # the page holding the committed speed table
DOC_START, DOC_END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"


def doc_table(result: dict[str, Any]) -> str:
    """The speed table of docs/speed.md, made from a run's result: every JAX / torch ratio row (eager
    and torch.compile, favourable or not) with its IQR and JAX's share of the matmul peak,
    then the generation rows, then the flags and load the run had."""
    rows, ratios, m = result["rows"], result["ratios"], result["meta"]
    by_row = {(r["name"], r["contender"]): r for r in rows}
    fmt = lambda r: f"{r['median']:.2f} [{r['p25']:.2f}, {r['p75']:.2f}]"  # noqa: E731
    lines = ["| shape | step | JAX / torch eager [IQR] | JAX / torch.compile [IQR] | JAX % of matmul peak |",
             "|---|---|---|---|---|"]
    for r in ratios:
        if r["ratio"] not in JAX_VS_TORCH_EAGER or r["section"] not in ("block", "encoder"):
            continue
        unrolled = r["ratio"].startswith("jax unrolled")
        comp = None if unrolled else next((c for c in ratios if c["ratio"] == "jax / torch.compile"
                                           and c["name"] == r["name"] and c["mode"] == r["mode"]), None)
        jax_row = by_row.get((r["name"], f"{r['ratio'].split(' / ')[0]} {r['mode']}"), {})
        shape = r["name"].rsplit(" ", 1)[0] + (", unrolled (scan_layers=False)" if unrolled else "")
        # ^ without the dtype
        lines.append(f"| {shape} | {'forward' if r['mode'] == 'fwd' else 'train'} | {fmt(r)} | "
                     f"{fmt(comp) if comp else ''} | {jax_row.get('pct_peak', 0):.0f} % |")
    gen = [r for r in ratios if r["section"] == "generate"]
    if gen:
        lines += ["", "| generation | positions/s, cached | positions/s, re-running the prefix "
                  "| prefix / cached time [IQR] |",
                  "|---|---:|---:|---|"]
        for r in gen:
            fw = r["mode"]
            cached, prefix = by_row[(r["name"], f"{fw} cached")], by_row[(r["name"], f"{fw} re-run prefix")]
            lines.append(f"| {r['name']}, {fw} | {cached['tokens_per_s']:.0f} | {prefix['tokens_per_s']:.0f} | "
                         f"{fmt(r)} |")
    mem = [r for r in rows if r["section"] == "block" and r["contender"] == "jax train" and r.get("xla_temp_bytes")
           and r.get("seq", 0) >= 2048]
    notes = ["XLA temp memory of the JAX train step: " + ", ".join(
        f"{r['name'].rsplit(' ', 1)[0]} {_fmt_bytes(r['xla_temp_bytes'])}" for r in mem) + "."] if mem else []
    remat = [r for r in rows if r["section"] == "remat" and r.get("xla_temp_bytes")]
    if remat:
        rq = {(r["name"], r["ratio"].split(" / ")[0]): r["median"] for r in ratios if r["section"] == "remat"}
        for name in dict.fromkeys(r["name"] for r in remat):
            cells = [f"{r['remat']} {_fmt_bytes(r['xla_temp_bytes'])}"
                     + (f" ({rq[(name, r['contender'])]:.2f} x torch's time)" if (name, r["contender"]) in rq else "")
                     for r in remat if r["name"] == name]
            notes.append(f"Remat, {name.rsplit(' ', 1)[0]} train step, XLA temp memory: " + ", ".join(cells) + ".")
    notes.append(f"Run {m['date']}, {m['wall_s']:.0f} s, load average {m['load_before']} before / {m['load_after']} "
                 f"after; XLA_FLAGS `{m['xla_flags'] or '(none: XLA defaults)'}`; torch {m.get('torch', 'n/a')} "
                 f"with {m.get('torch_threads', '?')} threads.")
    if result.get("skipped"):
        notes.append("Skipped (time budget or not asked): " + "; ".join(result["skipped"]) + ".")
    return "\n".join(lines + [""] + notes)


def splice_doc(path: Path, table: str) -> None:
    """Replace what lies between the bench-table markers of `path` (docs/speed.md) with `table`."""
    text = path.read_text()
    if DOC_START not in text or DOC_END not in text:
        raise SystemExit(f"{path} has no {DOC_START} ... {DOC_END} markers")
    head, rest = text.split(DOC_START, 1)
    _, tail = rest.split(DOC_END, 1)
    path.write_text(f"{head}{DOC_START}\n{table}\n{DOC_END}{tail}")


# ------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------


def _peak_arg(values: list[str]) -> dict[str, float]:
    out = {}
    for v in values:
        k, _, t = v.partition("=")
        if not t:
            raise SystemExit(f"--peak-tflops wants DTYPE=TFLOPS, got {v!r}")
        out[k] = float(t) * 1e12
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (a smoke test)")
    p.add_argument("--out", type=Path, default=None, help=f"results folder (default {DEFAULT_OUT}, or .../quick)")
    p.add_argument("--sizes", choices=sorted(SIZES), default=None, help="size list (default: gpu on a GPU, else cpu)")
    p.add_argument("--dtypes", default=None, help="comma list (default float32 on CPU, float32,bfloat16 on GPU)")
    p.add_argument("--sections", default="peak,block,encoder,depth,seeds,generate,remat",
                   help="comma list of what to time: peak (matmul peak), block, encoder, depth (compile time "
                        "against depth), seeds (vmap over seeds), generate (cached decoding against re-running "
                        "the prefix), remat (the Encoder train step's memory and time with each "
                        "layer rematerialised) (default: all)")
    p.add_argument("--budget", type=float, default=None, help="seconds; lower-priority work is skipped past it")
    p.add_argument("--reps", type=int, default=None, help="timed repeats per row (default: 7; --quick: 3)")
    p.add_argument("--no-torch", action="store_true", help="time JAX only (no torch rows)")
    p.add_argument("--no-torch-compile", dest="torch_compile", action="store_false",
                   help="skip the torch.compile rows (and their compile time)")
    p.add_argument("--tuned", action="store_true", help="add JAX rows compiled with the XLA_TUNED_CPU options")
    p.add_argument("--cpu-dot-flag", action="store_true",
                   help=f"set {CPU_DOT_FLAG} (XLA's Eigen dots; not the default: see CPU_DOT_FLAG)")
    p.add_argument("--xla-defaults", action="store_true", help="XLA's CPU flags at their defaults (the default)")
    p.add_argument("--no-fwd", dest="fwd", action="store_false", help="time train steps only")
    p.add_argument("--peak-tflops", action="append", default=[], metavar="DTYPE=TFLOPS",
                   help="the chip's datasheet peak, for MFU (e.g. bfloat16=989)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--doc", type=Path, default=None, metavar="FILE",
                   help=f"after the run, write its speed table into this file between the bench-table markers "
                        f"(the committed one: {DOC})")
    p.add_argument("--from-json", type=Path, default=None,
                   help="with --doc: take the table from this bench.json instead of running")
    p.add_argument("--opt-level", type=int, default=None,
                   help="XLA CPU backend optimisation level for every JAX compile (default: XLA's; --quick: 0)")
    a = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    a.chip_peak = _peak_arg(a.peak_tflops)
    a.sizes = a.sizes or ("quick" if a.quick else "gpu" if gpu else "cpu")
    a.dtypes = (a.dtypes or ("float32,bfloat16" if gpu else "float32")).split(",")
    a.sections = a.sections.split(",")
    a.budget = a.budget or (200.0 if a.quick else 480.0)
    a.reps = a.reps or (3 if a.quick else 7)
    a.max_config_s = 8.0 if a.quick else 25.0
    a.peak_n = (256,) if a.quick else ((4096, 8192) if gpu else (1024, 2048))
    a.peak_reps = 3 if a.quick else 7
    a.scan_depths = (1, 2) if a.quick else (6, 96)
    a.unrolled_depths = (1,) if a.quick else (3, 6)
    a.seeds = 2 if a.quick else 8
    a.seed_steps = 2 if a.quick else 3
    a.seed_layers = 1 if a.quick else 6
    a.seed_d_model = 16 if a.quick else 64
    a.seed_seq = 16 if a.quick else 32
    a.seed_batch = 4 if a.quick else 32
    a.seed_reps = 3
    a.gen_tokens = 16 if a.quick else 256
    a.gen_reps = 2 if a.quick else 3
    a.remat_depths = (2,) if a.quick else (6, 24)
    if a.quick:
        a.torch_compile = False
        a.tuned = False
        if a.opt_level is None:
            a.opt_level = 0
    a.out = a.out or (DEFAULT_OUT / "quick" if a.quick else DEFAULT_OUT)
    return a


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    configure_xla("--cpu-dot-flag" not in (sys.argv[1:] if argv is None else argv))
    args = parse_args(argv)
    if args.from_json is not None:
        if args.doc is None:
            raise SystemExit("--from-json needs --doc")
        result = json.loads(args.from_json.read_text())
        splice_doc(args.doc, doc_table(result))
        print(f"wrote the speed table of {args.from_json} into {args.doc}")
        return result
    clock = Clock(args.budget)
    BASE_OPTIONS.clear()
    if args.opt_level is not None and jax.default_backend() == "cpu":
        BASE_OPTIONS["xla_backend_optimization_level"] = args.opt_level
    torch_side = None
    if not args.no_torch:
        try:
            torch_side = Torch(None)
            if args.torch_threads:
                torch_side.torch.set_num_threads(args.torch_threads)
        except ImportError as e:
            print(f"torch unavailable ({e}); JAX only", file=sys.stderr)
    meta: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:] if argv is None else argv,
        "device": str(jax.devices()[0].device_kind), "jax_backend": jax.default_backend(), "cpu_count": os.cpu_count(),
        "platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__,
        "flax": __import__("flax").__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "xla_tuned": xla_tuned(), "xla_base_options": dict(BASE_OPTIONS), "load_before": _load(), "quick": args.quick,
    }
    if torch_side:
        meta.update(torch=torch_side.torch.__version__, torch_threads=torch_side.torch.get_num_threads(),
                    torch_device=torch_side.device)
    b = Bench(args, clock, torch_side)
    b.log(f"sizes={args.sizes} dtypes={args.dtypes} budget={args.budget:.0f}s load {meta['load_before']}")
    sizes = SIZES[args.sizes]
    # priority order: peak, target sizes, seeds, depth, the other sizes
    if "peak" in args.sections:
        b.run_peak(args.dtypes)
    else:
        b.skipped.append("peak (not requested)")
    want = [s for s in sizes if ("block" if s.block else "encoder") in args.sections]
    plan = [s for s in want if s.target] + [None] + [s for s in want if not s.target]
    for size in plan:
        if size is None:
            if "seeds" in args.sections:
                b.run_seeds() if clock.left() > 30 else b.skipped.append("seeds (time budget)")
            if "depth" in args.sections:
                b.run_depth()
            if "generate" in args.sections:
                b.run_generate() if clock.left() > 20 else b.skipped.append("generate (time budget)")
            if "remat" in args.sections:
                b.run_remat()
            continue
        for dtype in args.dtypes:
            if clock.left() < (15 if args.quick else 25):
                b.skipped.append(f"{size.name} {dtype} (time budget)")
                continue
            b.run_size(size, dtype)
    meta["load_after"] = _load()
    meta["wall_s"] = clock.elapsed()
    order = {"peak": 0, "block": 1, "encoder": 2, "depth": 3, "seeds": 4, "generate": 5, "remat": 6}
    b.rows.sort(key=lambda r: order.get(r["section"], 9))
    result = {"meta": meta, "peak_flops": b.peak, "rows": b.rows, "ratios": b.ratios, "skipped": b.skipped}
    result["targets"] = check_targets(b)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    (args.out / "bench.md").write_text(md)
    print(md)
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.md'} in {meta['wall_s']:.0f} s")
    if args.doc is not None:
        splice_doc(args.doc, doc_table(result))
    return result


if __name__ == "__main__":
    main()
