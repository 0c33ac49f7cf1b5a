"""A stack mixing dense and experts layers (issue 58 item 2), measured on whichever flax_blocks is
imported first: parameters and AdamW state held, and a jitted training step's compile and step
time. Run it on two trees side by side to compare layouts (one MLP per layer against both):

    PYTHONPATH=. python -m experiments.bench.mixed_stack
    PYTHONPATH=/path/to/older/tree python experiments/bench/mixed_stack.py

Counts at Qwen1.5-MoE-A2.7B's widths are taken abstractly (nnx.eval_shape, no memory); the timed
stack is small (float32, CPU by default). Prints one JSON line per row.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flax_blocks as fb

QWEN15_MOE = fb.BlockConfig(d_model=2048, num_heads=16, d_ff=5632, mlp="swiglu", activation="silu", bias=False,
                            qkv_bias=True, norm="pre", norm_type="rmsnorm", rope_theta=1e6, causal=True,
                            num_experts=60, num_experts_per_tok=4, expert_d_ff=1408, shared_expert_d_ff=5632)
TIMED = fb.BlockConfig(d_model=128, num_heads=4, d_ff=512, mlp="swiglu", activation="silu", bias=False, norm="pre",
                       norm_type="rmsnorm", rope_theta=1e4, causal=True, num_experts=8, num_experts_per_tok=2,
                       expert_d_ff=128, shared_expert_d_ff=256, dropout=0.0)
MIXINGS = {"sparse_step_2": dict(decoder_sparse_step=2), "sparse_step_4": dict(decoder_sparse_step=4),
           "first_dense": dict(mlp_only_layers=(0,)), "all_experts": {}}


def _size(tree) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))


def counts(cfg: fb.BlockConfig, layers: int) -> tuple[int, int]:
    """(parameters, AdamW state) of an Encoder, abstractly."""
    def build():
        m = fb.Encoder(cfg, num_layers=layers, rngs=nnx.Rngs(0))
        return m, nnx.Optimizer(m, optax.adamw(1e-3), wrt=nnx.Param)

    m, opt = nnx.eval_shape(build)
    return _size(nnx.state(m, nnx.Param)), _size(nnx.state(opt, nnx.optimizer.OptState))


def hf_count(cfg: fb.BlockConfig, layers: int) -> int:
    """What HF's Qwen2-MoE layers hold: each layer attention, two norms and its own MLP, plus the final norm."""
    e, h = cfg.d_model, cfg.head_width * cfg.num_heads
    kv = cfg.head_width * cfg.kv_heads
    attn = e * h + 2 * e * kv + h * e + (h + 2 * kv if cfg.has_qkv_bias else 0)
    dense = 3 * e * cfg.d_ff
    experts = e * cfg.num_experts + 3 * cfg.num_experts * e * cfg.experts_width + 3 * e * cfg.shared_expert_d_ff + e
    moe = [fb.core.config.is_moe_layer(cfg, i) for i in range(1, layers + 1)]
    return sum(attn + 2 * e + (experts if m else dense) for m in moe) + e


def timed(cfg: fb.BlockConfig, layers: int, steps: int = 20) -> dict:
    """Compile seconds (the first call less a step) and median step milliseconds of a jitted AdamW
    step on sum(y * r)."""
    m = fb.Encoder(cfg, num_layers=layers, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(m, optax.adamw(1e-3), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    x, r = (jnp.asarray(rng.normal(size=(4, 128, cfg.d_model)), jnp.float32) for _ in range(2))

    @nnx.jit
    def step(m, opt, x, r):
        loss, g = nnx.value_and_grad(lambda m: jnp.sum(m(x) * r))(m)
        opt.update(m, g)
        return loss

    t0 = time.perf_counter()
    jax.block_until_ready(step(m, opt, x, r))  # trace, compile and one step
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(step(m, opt, x, r))
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    return {"compile_s": round(first - step_s, 2), "step_ms": round(1e3 * step_s, 2)}


def main() -> None:
    for name, mixing in MIXINGS.items():
        cfg = replace(QWEN15_MOE, **mixing)
        p, o = counts(cfg, 24)
        print(json.dumps({"row": "qwen1.5-moe widths, 24 layers", "mixing": name, "params": p,
                          "hf_params": hf_count(cfg, 24), "ratio": round(p / hf_count(cfg, 24), 3), "adamw_state": o}))
    for name in ("sparse_step_2", "first_dense"):
        cfg = replace(TIMED, **MIXINGS[name])
        p, _ = counts(cfg, 8)
        print(json.dumps({"row": "timed d128 8 layers, B4 T128, float32", "mixing": name, "params": p,
                          "hf_params": hf_count(cfg, 8), **timed(cfg, 8)}), flush=True)


if __name__ == "__main__":
    main()
