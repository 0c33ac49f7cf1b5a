"""Which path an attention call takes: one rule for both twins, framework-free.

The paths: "dense" (the explicit softmax: every mask, the attention weights, dropout on them,
float64 exact), "blocked" (an online softmax over key blocks, O(T * block) memory) and
"fused" (one library kernel). The kernels that serve them (`KERNELS`):

    path      Flax (flax_blocks/flash.py)                 torch
    dense     explicit softmax                            explicit softmax
    blocked   blocked_attention ("blocked")               F.scaled_dot_product_attention ("sdpa")
    fused     jax.nn.dot_product_attention ("xla")        F.scaled_dot_product_attention ("sdpa")

The rule of BlockConfig.attention = "auto" (`choose_path`), the same in both twins:
1. "dense" when the call asks for the attention weights, when its key count is not a concrete
   int (a symbolic dimension of jax.export), or for multi-head latent attention.
2. On a GPU, "fused" when the twin's fused kernel computes the call (`lacks`).
3. From AUTO_MIN_KEYS keys on, "blocked" when the twin's memory-efficient kernel computes it.
4. Else "dense": on a CPU below AUTO_MIN_KEYS keys both twins run the explicit softmax.
The twins differ only where their kernels do (`lacks`): torch's SDPA takes explicit masks and
dropout and serves cached and cross-attention, Flax's kernels serve an uncached
self-attention with causal and key masks only. ALiBi's biases (Falcon) and a window without
causal (ModernBERT) take the dense path in both; chunked attention (Llama 4's attention_chunk_size)
the dense path or Flax's blocked kernel (not jax.nn.dot_product_attention, not SDPA). A forced
cfg.attention is taken as it is (`config.check_attention_call` refuses a call it cannot serve;
torch runs a forced path SDPA cannot compute densely).
"""

from __future__ import annotations

from typing import Any

PATHS = ("dense", "blocked", "fused")
AUTO_MIN_KEYS = 1024  # from this many keys on, "auto" takes a memory-efficient kernel on any platform

KERNELS: dict[str, dict[str, str]] = {  # twin -> {path: the kernel serving it}
    "flax": {"blocked": "blocked", "fused": "xla"},
    "torch": {"blocked": "sdpa", "fused": "sdpa"},
}


def lacks(kernel: str, cfg: Any, *, explicit_mask: bool = False, dropout_active: bool = False,
          cached_or_cross: bool = False) -> str | None:
    """What of a call `kernel` ("blocked", "xla", "sdpa") cannot compute, in words, or None.

    cfg: the BlockConfig; explicit_mask: an attention mask beyond causal and key padding;
    dropout_active: dropout on the attention weights; cached_or_cross: a cached decoding step
    or a cross-attention."""
    if cfg.alibi:  # (Falcon's ALiBi: the dense path alone adds the biases)
        return "ALiBi's biases"
    if cfg.attention_chunk_size is not None and kernel != "blocked":  # (Llama 4's chunks: dense and Flax's blocked)
        return "chunked attention"
    if kernel in ("blocked", "xla"):  # Flax's kernels: causal and key masks, uncached self-attention
        if explicit_mask or dropout_active or cached_or_cross:
            return "an explicit mask, dropout on the weights, a cache or a memory"
        if cfg.sliding_window is not None and not cfg.causal:  # ModernBERT's |i - j| < W
            return "a window without causal"
        if kernel == "blocked":
            return None  # soft-capping, windows and sinks included
        if cfg.attn_logit_softcapping is not None or cfg.attn_sinks or cfg.sliding_window_pattern is not None:
            return "soft-capped logits, sinks or alternating windows"
        return None
    if kernel == "sdpa":
        if cfg.attn_logit_softcapping is not None or cfg.attn_sinks or cfg.sliding_window is not None:
            return "soft-capped logits, sinks or sliding windows"
        return None
    raise ValueError(f"kernel must be one of 'blocked', 'xla', 'sdpa', got {kernel!r}")


def choose_path(cfg: Any, twin: str, keys: Any, *, need_weights: bool, explicit_mask: bool = False,
                dropout_active: bool = False, cached_or_cross: bool = False, gpu: bool = False) -> str:
    """The path ("dense", "blocked" or "fused") of an attention call over `keys` keys by the
    module docstring's rule; twin: "flax" or "torch" (whose `KERNELS` serve the paths); gpu:
    the call runs on a GPU. A forced cfg.attention is returned as it is; multi-head latent
    attention (cfg.latent) is always "dense"."""
    if cfg.latent:
        return "dense"
    if cfg.attention != "auto":
        return cfg.attention
    if need_weights or not isinstance(keys, int):
        return "dense"
    kernels = KERNELS[twin]
    facts = {"explicit_mask": explicit_mask, "dropout_active": dropout_active, "cached_or_cross": cached_or_cross}
    if gpu and lacks(kernels["fused"], cfg, **facts) is None:
        return "fused"
    if keys >= AUTO_MIN_KEYS and lacks(kernels["blocked"], cfg, **facts) is None:
        return "blocked"
    return "dense"
