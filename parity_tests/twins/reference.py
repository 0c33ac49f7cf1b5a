"""An independent float64 reference of every residual block, in plain numpy.

Written from the papers' formulas, sharing no code with `flax_blocks` or `torch_blocks`:
it reads a torch-named state dict ({name: array}, names as torch's nn.TransformerEncoderLayer
/ nn.TransformerEncoder / nn.TransformerDecoderLayer) and the config's fields (read as
plain attributes, so any object with those attributes will do), and computes the eval-mode
forward output. Every parameter shape is asserted from the config, and every parameter of
the state dict must be used: a twin with a missing, extra or misshapen parameter fails.

Semantics (torch's mask convention: a True entry means "may NOT attend"):
  Norm       layernorm: (x - mean) / sqrt(var + eps) * w + b   (biased variance, two-pass)
             rmsnorm:   x / sqrt(mean(x^2) + eps) * w
             every w above is (offset + w) with norm_weight_offset (Gemma: x / rms(x) * (1 + w))
  Attention  q = x Wq^T + bq, k, v from the keys' input (x, or the decoder's memory), each head
             head_dim wide (d_model / heads unless given), the output map (E, H head_dim);
             QK-norm per head over head_dim (weight only; OLMo 2: over the whole projection
             before the split into heads), then rotary (rotate-half), then
             scaled rotary (rope_scaling: linear, dynamic, yarn, longrope, llama3, as transformers'
             ROPE_INIT_FUNCTIONS, with yarn's and longrope's factor on cos and sin);
             a local layer (sliding_window; every layer, or l % pattern != 0, (l - 1) % pattern != 0
             with pattern_global_first) masks key j where |i - j| >= W and takes rope_local_theta
             (plain rotary); no rotary in layer l when l - 1 is in
             nope_layers (SmolLM3) or, with rope_local_only (Cohere 2), when l is not local; a chunked layer
             (attention_chunk_size, l - 1 not in unchunked_layers: Llama 4) masks key j unless (j - pad) // C ==
             (i - pad) // C, pad the row's left padding (HF's chunked_overlay); without rotary
             (Llama 4) q times log1p(floor((i + 1) / floor)) * scale + 1 at position i with
             query_temperature_floor; in the rotary layers with qk_l2_norm q and k over their RMS
             per head after rotary (Llama 4);
             softmax(q k^T / sqrt(head_dim)) v (Gemma: / sqrt(query_pre_attn_scalar); Gemma 2's
             soft-cap c tanh(logit / c) before the mask), query head h reading kv head h // (H / K);
             a query row with every key masked gives zero weights and a zero output; with attn_sinks
             (GPT-OSS) exp(sink_h) joins each row's denominator; with alibi (Falcon-RW) q.k + b_hj before
             the scale, b_hj = bf16(bf16(m_h) bf16(p_j)), m_h = 2^(-8(h+1)/n) for the largest power of two
             n <= H, then every other slope of 2n; p_j key j's rank among the keys some query may attend.
  MLP        dense: W2 act(W1 x);  gated (swiglu / geglu): W2 (act(Wg x) * W1 x).
  Experts    p = softmax(x R^T + b_R) over all X experts (b_R and the experts' biases with
             experts_bias, GPT-OSS); the k largest (ties: the lowest index), divided by their sum
             with norm_topk_prob; y = sum over the k of p_x MLP_x(x) (+ sigmoid(x g) MLP_shared(x));
             token by token; swiglu_limit L: the gated hidden (clip(u, -L, L) + 1) g sigmoid(alpha g),
             g = min(gate, L) (GPT-OSS). Layer l (from 1) runs them iff decoder_sparse_step
             divides l and l - 1 is not in mlp_only_layers, else the dense MLP.
  Latent     DeepSeek's multi-head latent attention (kv_lora_rank): q = x Wq^T or Wqb RMSNorm(Wqa x);
             [c; k_rot] = Wkva x; c = RMSNorm(c) (eps latent_norm_eps); [k_nope_h; v_h] = Wkvb c per head;
             rotary on q's last qk_rope_head_dim dims and on k_rot (shared by the heads), adjacent pairs
             with rope_interleave; softmax(q [k_nope; k_rot]^T * s) v, s = (dn + dr)^-0.5, times
             (0.1 mscale_all_dim ln(factor) + 1)^2 under a scaled rotary with mscale_all_dim.
  Routing    deepseek_v2: p = softmax, groups ranked by their best p; deepseek_v3: p = sigmoid, choice
             p + e_score_correction_bias, groups ranked by their two best choices; the topk_group best
             groups kept (others 0 / -inf), the top k choices; weights p of those (/ (sum + 1e-20) with
             norm_topk_prob) * routed_scaling_factor. A shared expert without gate with shared_expert_gate
             False. llama4: the k largest logits, weights their sigmoid; with routing_weights_on
             "input" y = sum over the k of MLP_x(w_x x) (Llama 4), not w_x MLP_x(x).
  Parallel   x + s1 Attn(Norm1(x)) + s2 MLP(Norm2(x)) (GPT-NeoX), Norm2 = Norm1 with shared_norm (StableLM)
  Residual   post: Norm(alpha x + s F(x));  pre: x + s F(Norm(x)) (the first layer's attention: x + s F(x)
             with first_attn_norm False, ModernBERT);
             peri: x + s Norm_out(F(Norm(x)));  out: x + s Norm(F(x)) (OLMo 2);  none: x + s F(x);
             residual "none" drops
             the skip term; alpha is DeepNorm's (2N)^(1/4) (Wang et al. 2022) for an
             encoder of N layers, s the ReZero / LayerScale gate read from the state dict.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# The config fields whose forward semantics this module implements. test_reference.py
# compares this set (with NOT_FORWARD) to dataclasses.fields(BlockConfig): a new field
# fails that test until the reference handles it or says why it has no forward meaning.
HANDLED = frozenset({
    "d_model", "num_heads", "d_ff", "activation", "layer_norm_eps", "bias", "norm", "residual",
    "scaling", "deepnorm_alpha", "causal",
    "norm_type", "norm_weight_offset", "mlp", "num_kv_heads", "head_dim", "qk_norm", "qk_norm_over", "rope_theta",
    "partial_rotary_factor", "attn_logit_softcapping", "query_pre_attn_scalar", "sliding_window",
    "sliding_window_pattern", "pattern_global_first", "first_attn_norm", "rope_local_theta", "rope_scaling",
    "rope_interleaved", "rope_local_only", "nope_layers", "query_temperature_floor", "query_temperature_scale",
    "qk_l2_norm", "attention_chunk_size", "unchunked_layers",
    "qkv_bias", "mlp_bias", "norm_bias", "layernorm_scaling", "residual_multiplier",
    "parallel_residual", "num_experts", "num_experts_per_tok", "expert_d_ff", "norm_topk_prob", "shared_expert_d_ff",
    "decoder_sparse_step", "mlp_only_layers", "experts_bias", "swiglu_limit", "swiglu_alpha", "attn_sinks",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
    "latent_norm_eps", "routing", "n_group", "topk_group", "routed_scaling_factor", "shared_expert_gate",
    "routing_weights_on",
    "alibi",
})
NOT_FORWARD = {
    "dropout": "identity in eval mode; train-mode statistics are tested in test_dropout_placement.py",
    "deepnorm_beta": "an init gain only; the reference reads the weights, not their distribution",
    "layerscale_init": "the gate's initial value only; the reference reads the gate itself",
    "dyt_alpha_init": "DyT's initial alpha only; the reference reads each norm's alpha",
    "init": "weight distributions only; the reference reads the weights",
    "dtype": "the reference computes in float64 (the twins' float64 runs are compared with it)",
    "param_dtype": "the reference casts every parameter to float64",
    "attention": "which implementation computes the same softmax attention (blocked cases are checked against it)",
    "attention_block": "the blocked path's block size: the same values in another order of summation",
}


# ----------------------------------------------------------------------------------------
# Primitives
# ----------------------------------------------------------------------------------------

_erf = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    """Elementwise erf in float64 (math.erf; numpy has none)."""
    return np.asarray(_erf(np.asarray(x, np.float64)), np.float64)


def activation(name: str, x: np.ndarray) -> np.ndarray:
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "gelu":  # exact: x Phi(x)
        return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":  # Hendrycks & Gimpel's tanh approximation
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "silu":  # x sigmoid(x), with sigmoid(x) = (1 + tanh(x / 2)) / 2 (no overflow)
        return x * 0.5 * (1.0 + np.tanh(0.5 * x))
    raise ValueError(f"reference: unknown activation {name!r}")


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float) -> np.ndarray:
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * weight
    return y if bias is None else y + bias


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * weight


def rotary(x: np.ndarray, theta: float, fraction: float = 1.0, scaling: Any = None,
           interleaved: bool = False) -> np.ndarray:
    """Rotary positions, rotate-half convention (HF LLaMA / GPT-NeoX).

    x: (B, H, T, hd), positions 0..T-1; dims i and i + hd/2 rotate together by pos * theta^(-2i/hd).
    fraction < 1 (GPT-NeoX rotary_pct, StableLM partial_rotary_factor): only the first
    r = int(hd * fraction) dims rotate, as above with r for hd; the others pass unchanged.
    scaling: a scaled rotary (an object with HF's rope_parameters as attributes): the
    frequencies and the factor on cos and sin of `scaled_frequencies`.
    interleaved (GPT-J's rotate_every_two, Cohere): dims 2i and 2i + 1 rotate together by frequency i,
    written out as GPT-J writes it (sin and cos repeat-interleaved).
    """
    r = int(x.shape[-1] * fraction)  # HF's rotary dim: an odd r rotates r + 1 dims at theta^(-2i/r)
    t = x.shape[-2]
    inv_freq = theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)  # (ceil(r/2),)
    factor = 1.0
    if scaling is not None:
        inv_freq, factor = scaled_frequencies(scaling, theta, r, t)
    w = 2 * len(inv_freq)
    angle = np.arange(t, dtype=np.float64)[:, None] * inv_freq[None, :]  # (T, w/2)
    cos = np.concatenate([np.cos(angle)] * 2, axis=-1) * factor  # (T, w)
    sin = np.concatenate([np.sin(angle)] * 2, axis=-1) * factor
    if interleaved:  # out[2i] = x[2i] cos_i - x[2i+1] sin_i, out[2i+1] = x[2i+1] cos_i + x[2i] sin_i
        cos, sin = np.repeat(cos[:, : w // 2], 2, axis=-1), np.repeat(sin[:, : w // 2], 2, axis=-1)
        pairs = x[..., :w].reshape(*x.shape[:-1], w // 2, 2)
        turned = np.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(*x.shape[:-1], w)
        return np.concatenate([x[..., :w] * cos + turned * sin, x[..., w:]], axis=-1)
    x1, x2 = x[..., : w // 2], x[..., w // 2: w]
    rotated = x[..., :w] * cos + np.concatenate([-x2, x1], axis=-1) * sin
    return np.concatenate([rotated, x[..., w:]], axis=-1)


def scaled_frequencies(s: Any, base: float, dim: int, seq_len: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies (dim/2,), factor on cos and sin) of a scaled rotary for a sequence of
    seq_len positions: transformers 5.24's _compute_<type>_parameters written out in float64."""
    f = s.factor
    if s.rope_type == "linear":
        return base ** (-np.arange(0, dim, 2) / dim) / f, 1.0
    if s.rope_type == "dynamic":  # NTK: a larger base past max_position_embeddings
        n = max(seq_len, s.max_position_embeddings)
        base = base * ((f * n / s.max_position_embeddings) - (f - 1)) ** (dim / (dim - 2))
        return 1.0 / base ** (np.arange(0, dim, 2) / dim), 1.0
    original = s.original_max_position_embeddings
    if f is None:
        f = s.max_position_embeddings / original
    if s.rope_type == "llama3":
        inv = 1.0 / base ** (np.arange(0, dim, 2) / dim)
        low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > low_wavelen, inv / f, inv)
        smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, (1 - smooth) * out / f + smooth * out, out), 1.0
    if s.rope_type == "longrope":
        ext = np.asarray(s.long_factor if seq_len > original else s.short_factor, np.float64)
        factor = s.attention_factor
        if factor is None:
            factor = 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(original))
        return 1.0 / (ext * base ** (np.arange(0, dim, 2) / dim)), factor
    assert s.rope_type == "yarn", s.rope_type

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = s.attention_factor
    if factor is None:
        factor = mscale(f, s.mscale) / mscale(f, s.mscale_all_dim) if s.mscale and s.mscale_all_dim else mscale(f)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast or 32), correction_dim(s.beta_slow or 1)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (np.arange(0, dim, 2) / dim)
    extrapolation = 1 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    inv = (1.0 / (f * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, factor


def bfloat16(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bfloat16 value (ties to even), as float64: the float32 bits'
    low 16 rounded away."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)


def alibi(num_heads: int, masked: np.ndarray | None, s: int) -> np.ndarray:
    """Falcon's ALiBi biases (B|1, H, 1, S) over s keys (HF build_alibi_tensor): slopes of the
    largest power of two n <= H, 2^(-8/n) to the powers 1..n, then 2^(-4/n) to the odd powers for
    the heads left; times each key's rank among the keys some query may attend (masked (B|1, T,
    S) True = may NOT attend); slopes, ranks and products rounded to bfloat16."""
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [np.float32(2.0 ** (-8.0 / n)) ** np.float32(i) for i in range(1, n + 1)]
    slopes += [np.float32(2.0 ** (-4.0 / n)) ** np.float32(i) for i in range(1, 2 * (num_heads - n), 2)][:n]
    valid = np.ones((1, s), bool) if masked is None else ~masked.all(axis=1)
    rank = (np.cumsum(valid, axis=-1) - 1) * valid
    return bfloat16(bfloat16(np.array(slopes))[None, :, None, None] * bfloat16(rank)[:, None, None, :])


def softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, masked: np.ndarray | None,
                      scale: float | None = None, softcap: float | None = None, sinks: np.ndarray | None = None,
                      bias: np.ndarray | None = None):
    """q (B, H, T, hd), k and v (B, H, S, hd), masked (B|1, T, S) True = may NOT attend.
    Logits q.k * scale (default 1 / sqrt(hd)); with softcap c (Gemma 2) c * tanh(logit / c),
    before the mask; sinks (H,) (GPT-OSS): exp(sink_h) added to each row's denominator.

    Returns (out (B, H, T, hd), weights (B, H, T, S), the largest scaled logit over the
    pairs that may attend ()); rows with no key give zeros."""
    qk = np.einsum("bhtd,bhsd->bhts", q, k) + (0.0 if bias is None else bias)  # ALiBi: before the scale
    logits = qk * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    if masked is not None:
        logits = np.where(masked[:, None], -np.inf, logits)
    top = logits.max(-1, keepdims=True)
    empty = ~np.isfinite(top)  # every key masked
    if sinks is not None:  # the sink is one more logit of the row: the shift takes it too
        top = np.where(empty, top, np.maximum(top, sinks[None, :, None, None]))
    e = np.exp(logits - np.where(empty, 0.0, top))
    denom = e.sum(-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sinks[None, :, None, None] - np.where(empty, 0.0, top))
    w = e / np.where(empty, 1.0, denom)  # exp(-inf) = 0: empty rows stay 0
    return np.einsum("bhts,bhsd->bhtd", w, v), w, logits.max()


def build_mask(causal: bool, batch: int, t: int, s: int, attn_mask: Any = None,
               key_padding_mask: Any = None) -> np.ndarray | None:
    """Combine causal, attn_mask (T, S) or (B, T, S), key_padding_mask (B, S) into (B|1, T, S);
    True = may NOT attend."""
    masked = np.triu(np.ones((t, s), bool), 1)[None] if causal else None
    if attn_mask is not None:
        m = np.asarray(attn_mask, bool).reshape(-1, t, s)
        masked = m if masked is None else masked | m
    if key_padding_mask is not None:
        m = np.asarray(key_padding_mask, bool).reshape(batch, 1, s)
        masked = m if masked is None else masked | m
    return None if masked is None else np.broadcast_to(masked, (masked.shape[0], t, s))


# ----------------------------------------------------------------------------------------
# Parameters: shapes asserted from the config, every one used
# ----------------------------------------------------------------------------------------


class Params:
    """A torch-named state dict as float64 arrays; records which names were read."""

    def __init__(self, state_dict: dict[str, Any]):
        self.arrays = {k: np.asarray(_numpy(v), np.float64) for k, v in state_dict.items()}
        self.used: set[str] = set()

    def __call__(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.arrays:
            raise KeyError(f"reference: parameter {name!r} missing from the state dict")
        a = self.arrays[name]
        if a.shape != tuple(shape):
            raise ValueError(f"reference: {name} has shape {a.shape}, expected {tuple(shape)}")
        self.used.add(name)
        return a

    def check_all_used(self) -> None:
        extra = sorted(set(self.arrays) - self.used)
        if extra:
            raise ValueError(f"reference: parameters the config does not explain: {extra}")


def _numpy(v: Any) -> Any:
    if hasattr(v, "detach"):  # a torch tensor
        return v.detach().cpu().double().numpy()
    return v


def _opt(cfg: Any, name: str, default: Any) -> Any:
    """A config field, or its default where the config predates the field."""
    return getattr(cfg, name, default)


def _norm(cfg: Any, p: Params, prefix: str, x: np.ndarray, bias: bool = True) -> np.ndarray:
    """The config's norm over the last axis; a LayerNorm has a bias when the norms have biases
    (norm_bias, else bias) and `bias`."""
    nb = _opt(cfg, "norm_bias", None)
    bias = bias and (cfg.bias if nb is None else nb)
    n = x.shape[-1]
    w = p(prefix + "weight", (n,)) + _opt(cfg, "norm_weight_offset", 0.0)  # Gemma's RMSNorm: times (1 + w)
    kind = _opt(cfg, "norm_type", "layernorm")
    if kind == "rmsnorm":
        return rms_norm(x, w, cfg.layer_norm_eps)
    if kind == "dyt":  # Zhu et al. 2025: weight * tanh(alpha * x) + bias, no statistics
        y = w * np.tanh(p(prefix + "alpha", ()) * x)
        return y + p(prefix + "bias", (n,)) if bias else y
    return layer_norm(x, w, p(prefix + "bias", (n,)) if bias else None, cfg.layer_norm_eps)


def _linear(p: Params, prefix: str, x: np.ndarray, n_out: int, bias: bool) -> np.ndarray:
    y = x @ p(prefix + "weight", (n_out, x.shape[-1])).T
    return y + p(prefix + "bias", (n_out,)) if bias else y


# ----------------------------------------------------------------------------------------
# Sublayers
# ----------------------------------------------------------------------------------------


def _local(cfg: Any, layer: int) -> bool:
    """A sliding-window layer: every layer (no pattern: Mistral), or layer l (from 1) with
    l % pattern != 0 (HF layer_types "sliding_attention" iff (i + 1) % pattern, i from 0)."""
    if _opt(cfg, "sliding_window", None) is None:
        return False
    n = _opt(cfg, "sliding_window_pattern", None)
    first = _opt(cfg, "pattern_global_first", False)  # ModernBERT: layer_id % n == 0 (from 0) is global
    return n is None or (layer - 1 if first else layer) % n != 0


def _chunked(masked: np.ndarray | None, chunk: int, t: int, s: int) -> np.ndarray:
    """HF's chunked_overlay over `masked` (B|1, T, S) (True: may NOT attend): key j hidden from query i unless
    (j - pad) // chunk == (i - pad) // chunk, pad the row's left padding (the leading keys every query of the
    row is denied, HF's left_padding_tokens)."""
    denied = np.zeros((1, t, s), bool) if masked is None else masked
    pad = np.array([next((j for j in range(s) if not row[:, j].all()), s) for row in denied])  # (B|1,)
    i, j = np.arange(t)[None, :, None] - pad[:, None, None], np.arange(s)[None, None, :] - pad[:, None, None]
    return denied | (np.floor_divide(j, chunk) != np.floor_divide(i, chunk))


def attention(cfg: Any, p: Params, prefix: str, x: np.ndarray, masked: np.ndarray | None,
              memory: np.ndarray | None = None, positions: bool = True, layer: int = 1):
    """Multi-head attention of x (B, T, E) over itself or over `memory` (B, S, E).

    Params: {prefix}in_proj_weight ((H + 2K) hd, E) rows [q heads; k heads; v heads],
    in_proj_bias, out_proj.{weight, bias}, q_norm.*, k_norm.*.
    Returns (out (B, T, E), weights (B, H, T, S), largest scaled logit over unmasked pairs ())."""
    kv = x if memory is None else memory
    b, t, e = x.shape
    s = kv.shape[1]
    h = cfg.num_heads
    k_heads = _opt(cfg, "num_kv_heads", None) or h
    hd = _opt(cfg, "head_dim", None) or e // h  # Qwen3 / Gemma give it explicitly
    w_in = p(prefix + "in_proj_weight", ((h + 2 * k_heads) * hd, e))
    q = x @ w_in[: h * hd].T
    k = kv @ w_in[h * hd: (h + k_heads) * hd].T
    v = kv @ w_in[(h + k_heads) * hd:].T
    qkv_bias = _opt(cfg, "qkv_bias", None)
    if (cfg.bias if qkv_bias is None else qkv_bias):
        b_in = p(prefix + "in_proj_bias", ((h + 2 * k_heads) * hd,))
        q, k, v = q + b_in[: h * hd], k + b_in[h * hd: (h + k_heads) * hd], v + b_in[(h + k_heads) * hd:]
    if _opt(cfg, "qk_norm", False) and _opt(cfg, "qk_norm_over", "head") == "projection":
        q = _norm(cfg, p, prefix + "q_norm.", q, bias=False)  # OLMo 2: over all H * hd (K * hd) at once
        k = _norm(cfg, p, prefix + "k_norm.", k, bias=False)
    q = q.reshape(b, t, h, hd).transpose(0, 2, 1, 3)  # (B, H, T, hd)
    k = k.reshape(b, s, k_heads, hd).transpose(0, 2, 1, 3)  # (B, K, S, hd)
    v = v.reshape(b, s, k_heads, hd).transpose(0, 2, 1, 3)
    # scale-only (OLMo 2, Gemma 3): no bias whatever cfg.bias says
    if _opt(cfg, "qk_norm", False) and _opt(cfg, "qk_norm_over", "head") == "head":
        q = _norm(cfg, p, prefix + "q_norm.", q, bias=False)
        k = _norm(cfg, p, prefix + "k_norm.", k, bias=False)
    theta = _opt(cfg, "rope_theta", None)
    local = positions and _local(cfg, layer)  # (a self-attention: positions; cross-attention has none)
    scaling = _opt(cfg, "rope_scaling", None)
    if local and _opt(cfg, "rope_local_theta", None) is not None:
        theta, scaling = cfg.rope_local_theta, None  # Gemma 3's local layers: plain rotary
    if local:  # query i sees key j only if |i - j| < W (under the causal mask: HF's sliding_window_overlay i - W < j)
        window = np.abs(np.arange(s)[None, :] - np.arange(t)[:, None]) >= cfg.sliding_window
        masked = window[None] if masked is None else masked | window[None]
    chunk = _opt(cfg, "attention_chunk_size", None)
    if positions and chunk is not None and layer - 1 not in _opt(cfg, "unchunked_layers", ()):  # Llama 4's chunks
        masked = _chunked(masked, chunk, t, s)
    rotates = (local or not _opt(cfg, "rope_local_only", False)) and layer - 1 not in _opt(cfg, "nope_layers", ())
    if theta is not None and positions and rotates:  # Cohere 2: local layers alone; SmolLM3: not its NoPE layers
        fraction = _opt(cfg, "partial_rotary_factor", 1.0)
        pairs = _opt(cfg, "rope_interleaved", False)
        q, k = rotary(q, theta, fraction, scaling, pairs), rotary(k, theta, fraction, scaling, pairs)
        if _opt(cfg, "qk_l2_norm", False):  # Llama 4: over each head's RMS, no weight, after rotary
            q, k = (a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + cfg.layer_norm_eps) for a in (q, k))
    elif positions and _opt(cfg, "query_temperature_floor", None) is not None:  # Llama 4's NoPE layers
        slots = np.arange(t, dtype=np.float64)
        q = q * (np.log1p(np.floor((slots + 1) / cfg.query_temperature_floor)) * cfg.query_temperature_scale + 1)[
            :, None]
    k = np.repeat(k, h // k_heads, axis=1)  # query head j reads kv head j // (H / K)
    v = np.repeat(v, h // k_heads, axis=1)
    a = _opt(cfg, "query_pre_attn_scalar", None)  # Gemma: q.k / sqrt(a)
    sinks = p(prefix + "sinks", (h,)) if _opt(cfg, "attn_sinks", False) else None
    bias = alibi(h, masked, s) if positions and _opt(cfg, "alibi", False) else None  # self-attention only
    o, w, logit_max = softmax_attention(q, k, v, masked, None if a is None else 1 / math.sqrt(a),
                                        _opt(cfg, "attn_logit_softcapping", None), sinks, bias)
    out = _linear(p, prefix + "out_proj.", o.transpose(0, 2, 1, 3).reshape(b, t, h * hd), e, cfg.bias)
    if masked is not None:  # a query with no key gets no output, bias included
        out = np.where(masked.all(-1)[..., None], 0.0, out)
    return out, w, logit_max


def rotary_pairs(x: np.ndarray, theta: float, scaling: Any = None) -> np.ndarray:
    """Rotary on adjacent pairs (x_2i, x_2i+1) of x (B, H, T, d) at positions 0..T-1, pair i by
    pos * theta^(-2i/d) (or a scaled rotary's frequencies and factor): DeepSeek V2's complex
    rotation, in place."""
    d, t = x.shape[-1], x.shape[-2]
    inv_freq, factor = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d), 1.0
    if scaling is not None:
        inv_freq, factor = scaled_frequencies(scaling, theta, d, t)
    angle = np.arange(t, dtype=np.float64)[:, None] * inv_freq[None, :]  # (T, d/2)
    cos, sin = np.cos(angle) * factor, np.sin(angle) * factor
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


def latent_attention(cfg: Any, p: Params, prefix: str, x: np.ndarray, masked: np.ndarray | None):
    """DeepSeek's multi-head latent attention of x (B, T, E), HF's parameter names (q_proj or
    q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj).
    Returns (out (B, T, E), weights (B, H, T, T), largest scaled logit ())."""
    b, t, e = x.shape
    h, r, dn, dr, dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    qkv_bias = _opt(cfg, "qkv_bias", None)
    bias = cfg.bias if qkv_bias is None else qkv_bias
    eps = cfg.latent_norm_eps
    if cfg.q_lora_rank is None:
        q = _linear(p, prefix + "q_proj.", x, h * (dn + dr), False)
    else:
        qa = _linear(p, prefix + "q_a_proj.", x, cfg.q_lora_rank, bias)
        qa = rms_norm(qa, p(prefix + "q_a_layernorm.weight", (cfg.q_lora_rank,)), eps)
        q = _linear(p, prefix + "q_b_proj.", qa, h * (dn + dr), False)
    q = q.reshape(b, t, h, dn + dr).transpose(0, 2, 1, 3)  # (B, H, T, dn + dr)
    kva = _linear(p, prefix + "kv_a_proj_with_mqa.", x, r + dr, bias)
    c = rms_norm(kva[..., :r], p(prefix + "kv_a_layernorm.weight", (r,)), eps)
    k_rot = kva[..., r:][:, None]  # (B, 1, T, dr)
    kv = _linear(p, prefix + "kv_b_proj.", c, h * (dn + dv), False).reshape(b, t, h, dn + dv).transpose(0, 2, 1, 3)
    scaling = _opt(cfg, "rope_scaling", None)
    turn = (lambda a: rotary_pairs(a, cfg.rope_theta, scaling)) if cfg.rope_interleave else (
        lambda a: rotary(a, cfg.rope_theta, 1.0, scaling))
    q = np.concatenate([q[..., :dn], turn(q[..., dn:])], axis=-1)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(turn(k_rot), (b, h, t, dr))], axis=-1)
    scale = (dn + dr) ** -0.5
    if scaling is not None and getattr(scaling, "mscale_all_dim", None) and scaling.factor > 1:
        scale *= (0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0) ** 2
    o, w, logit_max = softmax_attention(q, k, kv[..., dn:], masked, scale)
    out = _linear(p, prefix + "o_proj.", o.transpose(0, 2, 1, 3).reshape(b, t, h * dv), e, bias)
    if masked is not None:  # a query with no key gets no output, bias included
        out = np.where(masked.all(-1)[..., None], 0.0, out)
    return out, w, logit_max


def mlp(cfg: Any, p: Params, prefix: str, x: np.ndarray, layer: int = 1,
        extras: dict | None = None) -> np.ndarray:
    """dense: linear2(act(linear1 x)); gated: linear2(act(linear_gate x) * linear1 x); or the
    experts (`moe_layer`), their router logits in extras["router_logits"] (zeros in a dense layer
    of a mixed stack)."""
    x_count = _opt(cfg, "num_experts", 0)
    if x_count:
        moe = moe_layer(cfg, layer)
        if moe:
            y, logits = experts(cfg, p, prefix + "experts.", x)
        else:
            y, logits = dense_mlp(cfg, p, prefix, x, cfg.d_ff), np.zeros((*x.shape[:-1], x_count))
        if extras is not None:
            extras["router_logits"] = logits
        return y
    return dense_mlp(cfg, p, prefix, x, cfg.d_ff)


def dense_mlp(cfg: Any, p: Params, prefix: str, x: np.ndarray, f: int, names=("linear1.", "linear_gate.", "linear2."),
              bias: bool | None = None) -> np.ndarray:
    """The dense or gated MLP of width f on x (..., E), its linear maps named `names`."""
    mb = _opt(cfg, "mlp_bias", None)
    mb = (cfg.bias if mb is None else mb) if bias is None else bias  # HF LLaMA's mlp_bias beside attention_bias
    hid = _linear(p, prefix + names[0], x, f, mb)
    if _opt(cfg, "mlp", "dense") == "dense":
        hid = activation(cfg.activation, hid)
    else:
        hid = activation(cfg.activation, _linear(p, prefix + names[1], x, f, mb)) * hid
    return _linear(p, prefix + names[2], hid, cfg.d_model, mb)


def moe_layer(cfg: Any, layer: int) -> bool:
    """Layer `layer` (from 1) runs the experts: HF Qwen2-MoE's (layer_idx + 1) % decoder_sparse_step == 0
    and layer_idx not in mlp_only_layers, layer_idx = layer - 1."""
    return layer % _opt(cfg, "decoder_sparse_step", 1) == 0 and layer - 1 not in _opt(cfg, "mlp_only_layers", ())


def deepseek_route(cfg: Any, logits: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek V2's / V3's routing of one token's logits (X,) -> (weights (k,), experts (k,))."""
    n = cfg.num_experts // cfg.n_group
    if cfg.routing == "deepseek_v2":
        scores = np.exp(logits - logits.max())
        scores /= scores.sum()
        choice = scores.copy()
        ranks = np.array([choice[j * n:(j + 1) * n].max() for j in range(cfg.n_group)])
    else:
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + bias
        ranks = np.array([np.sort(choice[j * n:(j + 1) * n])[-2:].sum() for j in range(cfg.n_group)])
    kept = np.argsort(-ranks, kind="stable")[:cfg.topk_group]
    for j in range(cfg.n_group):
        if j not in kept:
            choice[j * n:(j + 1) * n] = 0.0 if cfg.routing == "deepseek_v2" else -np.inf
    chosen = np.argsort(-choice, kind="stable")[:cfg.num_experts_per_tok]
    w = scores[chosen]
    if cfg.norm_topk_prob:
        w = w / (w.sum() + 1e-20)
    return w * cfg.routed_scaling_factor, chosen


def route(cfg: Any, logits: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Router logits (X,) of one token -> (weights (k,), experts (k,)): the k largest softmax
    probabilities (ties: the lowest index; Llama 4's routing: the k largest logits, weights their
    sigmoid), renormalised with norm_topk_prob; DeepSeek's routings in `deepseek_route`."""
    routing = _opt(cfg, "routing", "softmax")
    if routing == "llama4":  # the k largest logits, each weighted by its sigmoid
        chosen = np.argsort(-logits, kind="stable")[:cfg.num_experts_per_tok]
        w = 1 / (1 + np.exp(-logits[chosen]))
        return (w / w.sum() if cfg.norm_topk_prob else w), chosen
    if routing != "softmax":
        return deepseek_route(cfg, logits, bias)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    chosen = np.argsort(-probs, kind="stable")[:cfg.num_experts_per_tok]
    w = probs[chosen]
    return (w / w.sum() if cfg.norm_topk_prob else w), chosen


def experts(cfg: Any, p: Params, prefix: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The experts MLP on x (..., E) -> (y (..., E), router logits (..., X)), token by token."""
    e, n, f = cfg.d_model, cfg.num_experts, cfg.expert_d_ff or cfg.d_ff
    router = p(prefix + "router", (n, e))
    up, down = p(prefix + "up", (n, f, e)), p(prefix + "down", (n, e, f))
    gate = None if _opt(cfg, "mlp", "dense") == "dense" else p(prefix + "gate", (n, f, e))
    biased = _opt(cfg, "experts_bias", False)  # GPT-OSS: the router and every expert projection
    zeros = {"router": np.zeros(n), "up": np.zeros((n, f)), "gate": np.zeros((n, f)), "down": np.zeros((n, e))}
    b = {name: p(prefix + name + "_bias", zeros[name].shape) if biased and (name != "gate" or gate is not None)
         else zeros[name] for name in zeros}
    t = x.reshape(-1, e)
    logits = t @ router.T + b["router"]
    bias = p(prefix + "e_score_correction_bias", (n,)) if _opt(cfg, "routing", "softmax") == "deepseek_v3" else None
    y = np.zeros_like(t)
    on_input = _opt(cfg, "routing_weights_on", "output") == "input"  # Llama 4: MLP_j(w x), not w MLP_j(x)
    for i in range(t.shape[0]):
        for w, j in zip(*route(cfg, logits[i], bias), strict=True):
            x_in = w * t[i] if on_input else t[i]
            h = up[j] @ x_in + b["up"][j]
            h = activation(cfg.activation, h) if gate is None else gated_hidden(cfg, h, gate[j] @ x_in + b["gate"][j])
            y[i] += (1.0 if on_input else w) * (down[j] @ h + b["down"][j])
    if cfg.shared_expert_d_ff:
        s = dense_mlp(cfg, p, prefix, t, cfg.shared_expert_d_ff, ("shared_up.", "shared_gate.", "shared_down."))
        y += s / (1 + np.exp(-(t @ p(prefix + "shared_expert_gate", (1, e)).T))) if _opt(
            cfg, "shared_expert_gate", True) else s  # DeepSeek's shared experts: no gate
    return y.reshape(x.shape), logits.reshape(*x.shape[:-1], n)


def gated_hidden(cfg: Any, up: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """An expert's gated hidden layer: act(gate) * up, or GPT-OSS's clamped SwiGLU with swiglu_limit L
    and swiglu_alpha a: g = min(gate, L), (clip(up, -L, L) + 1) * g * sigmoid(a g)."""
    limit = _opt(cfg, "swiglu_limit", None)
    if limit is None:
        return activation(cfg.activation, gate) * up
    g = np.minimum(gate, limit)
    return (np.clip(up, -limit, limit) + 1) * g / (1 + np.exp(-cfg.swiglu_alpha * g))


def residual(cfg: Any, p: Params, x: np.ndarray, f, norm: str, norm_out: str, gate: str,
             alpha: float, layer: int = 1, bare: bool = False) -> np.ndarray:
    """One residual sublayer around f (x -> F(x)) in layer `layer` (from 1) of a stack; norm,
    norm_out, gate: parameter prefixes. LayerNorm Scaling (Sun et al. 2025): the pre-norm's
    output times 1 / sqrt(layer). bare: F reads x, not the pre-norm's output (which is still
    computed, its weights read)."""
    s = _gate(cfg, p, gate, x.shape[-1])
    if cfg.norm in ("pre", "peri"):
        h = _norm(cfg, p, norm, x)
        if bare:
            h = x  # ModernBERT: layer 0's attn_norm is nn.Identity (its weights held, unused)
        if _opt(cfg, "layernorm_scaling", False):
            h = h / math.sqrt(layer)
        h = f(h)
        if cfg.norm == "peri":
            h = _norm(cfg, p, norm_out, h)
    elif cfg.norm == "out":  # OLMo 2: x + Norm(F(x))
        h = _norm(cfg, p, norm, f(x))
    else:
        h = f(x)
    y = s * h * _opt(cfg, "residual_multiplier", 1.0) + (alpha * x if cfg.residual == "add" else 0.0)
    return _norm(cfg, p, norm, y) if cfg.norm == "post" else y


def _gate(cfg: Any, p: Params, gate: str, e: int):
    """The ReZero scalar or LayerScale vector of a sublayer, else 1."""
    if cfg.scaling == "rezero":
        return p(gate, ())
    if cfg.scaling == "layerscale":
        return p(gate, (e,))
    return 1.0


def deepnorm_alpha(cfg: Any, num_layers: int) -> float:
    """The skip weight: DeepNorm's alpha = (2N)^(1/4) for N encoder layers (or the config's), else 1."""
    if cfg.scaling != "deepnorm":
        return 1.0
    return cfg.deepnorm_alpha if cfg.deepnorm_alpha is not None else (2 * num_layers) ** 0.25


# ----------------------------------------------------------------------------------------
# Blocks and stacks
# ----------------------------------------------------------------------------------------

# Each block's residual sublayers in order: (function, module prefix, norm, output norm, gate),
# with torch's names (nn.TransformerEncoderLayer / nn.TransformerDecoderLayer).
SUBLAYERS = {
    "ResidualMHA": [("attention", "mha.", "norm.", "norm_out.", "scale")],
    "FeedForward": [("mlp", "", "norm.", "norm_out.", "scale")],
    "TransformerBlock": [("attention", "self_attn.", "norm1.", "norm1_out.", "scale1"),
                         ("mlp", "", "norm2.", "norm2_out.", "scale2")],
    "DecoderBlock": [("attention", "self_attn.", "norm1.", "norm1_out.", "scale1"),
                     ("cross_attention", "multihead_attn.", "norm2.", "norm2_out.", "scale2"),
                     ("mlp", "", "norm3.", "norm3_out.", "scale3")],
}
STACKS = {"Encoder": "TransformerBlock", "Decoder": "DecoderBlock"}
KINDS = (*SUBLAYERS, *STACKS)


def block(cfg: Any, p: Params, kind: str, prefix: str, x: np.ndarray, masked, alpha: float,
          memory: np.ndarray | None = None, memory_masked=None, layer: int = 1) -> tuple[np.ndarray, dict]:
    """One block -> (y (B, T, E), {"attention_weights", "attention_logits_max" and, with a
    cross-attention, "cross_attention_weights", "cross_attention_logits_max"}).
    Cross-attention: queries from the stream, keys and values from `memory`, no rotary."""
    extras: dict[str, np.ndarray] = {}
    branches = []  # a parallel residual's sublayers: (F, norm prefix, gate)
    for fn, module, norm, norm_out, gate in SUBLAYERS[kind]:
        def f(h, fn=fn, module=module):
            if fn == "mlp":
                return mlp(cfg, p, prefix + module, h, layer, extras)
            cross = fn == "cross_attention"
            if not cross and _opt(cfg, "kv_lora_rank", None) is not None:  # DeepSeek's latent attention
                out, extras[f"{fn}_weights"], extras[f"{fn}_logits_max"] = latent_attention(
                    cfg, p, prefix + module, h, masked)
                return out
            out, extras[f"{fn}_weights"], extras[f"{fn}_logits_max"] = attention(
                cfg, p, prefix + module, h, memory_masked if cross else masked,
                memory if cross else None, positions=not cross, layer=layer)
            return out

        if _opt(cfg, "parallel_residual", "none") != "none":
            branches.append((f, prefix + norm, prefix + gate))
            continue
        bare = fn == "attention" and layer == 1 and not _opt(cfg, "first_attn_norm", True)  # ModernBERT's layer 0
        x = residual(cfg, p, x, f, prefix + norm, prefix + norm_out, prefix + gate, alpha, layer, bare)
    if branches:  # GPT-NeoX: x + Attn(LN1(x)) + MLP(LN2(x)); StableLM / GPT-J: LN1 for both
        shared = _opt(cfg, "parallel_residual", "none") == "shared_norm"
        y = x
        for f, norm, gate in branches:
            h = _norm(cfg, p, branches[0][1] if shared else norm, x)
            if _opt(cfg, "layernorm_scaling", False):
                h = h / math.sqrt(layer)
            y = y + _gate(cfg, p, gate, x.shape[-1]) * f(h) * _opt(cfg, "residual_multiplier", 1.0)
        x = y
    return x, extras


def stack(cfg: Any, p: Params, kind: str, prefix: str, x: np.ndarray, masked, num_layers: int | None,
          final_norm: bool | None, memory=None, memory_masked=None) -> tuple[np.ndarray, dict]:
    """An Encoder or Decoder: {prefix}layers.{i}.* blocks then an optional {prefix}norm.
    num_layers None: counted from the state dict; final_norm None: the state dict has one.
    Returns (y, {"residual": (L, B, T, E), each block intermediate stacked on L})."""
    if num_layers is None:
        num_layers = len({k[len(prefix):].split(".")[1] for k in p.arrays if k.startswith(prefix + "layers.")})
    alpha = deepnorm_alpha(cfg, num_layers)
    per_layer: dict[str, list] = {"residual": []}
    for i in range(num_layers):
        x, extras = block(cfg, p, STACKS[kind], f"{prefix}layers.{i}.", x, masked, alpha, memory, memory_masked,
                          layer=i + 1)
        per_layer["residual"].append(x)
        for k, v in extras.items():
            per_layer.setdefault(k, []).append(v)
    if final_norm is None:
        final_norm = prefix + "norm.weight" in p.arrays
    if final_norm:
        x = _norm(cfg, p, prefix + "norm.", x)
    return x, {k: np.stack(v) for k, v in per_layer.items()}


def forward(kind: str, cfg: Any, state_dict: dict[str, Any], x: Any, *, attn_mask: Any = None,
            key_padding_mask: Any = None, num_layers: int | None = None, final_norm: bool | None = None,
            memory: Any = None, memory_mask: Any = None, memory_key_padding_mask: Any = None,
            return_intermediates: bool = False):
    """The eval-mode output of block `kind` with parameters `state_dict` on x (B, T, E) or (T, E).

    kind: ResidualMHA, FeedForward, TransformerBlock, DecoderBlock, Encoder or Decoder.
    Masks in torch's convention (True = may NOT attend): attn_mask (T, T) or (B, T, T) and
    key_padding_mask (B, T) on the self-attention (causal when cfg.causal); for decoders
    memory (B, S, E) or (S, E), memory_mask (T, S) or (B, T, S) and memory_key_padding_mask (B, S).
    num_layers: a stack's depth (default: counted from the state dict's layers.{i}.);
    final_norm: whether a stack has its final `norm.` (default: the state dict has one).
    With return_intermediates, also {"attention_weights": (B, H, T, T), "attention_logits_max":
    () (the largest scaled logit over batch, heads and unmasked pairs), for decoders the same
    with "cross_" for the cross-attention (B, H, T, S)}, for a stack with a leading layer
    axis L and "residual": (L, B, T, E)}.
    """
    if kind not in KINDS:
        raise ValueError(f"reference: unknown block kind {kind!r}")
    x = np.asarray(_numpy(x), np.float64)
    unbatched = x.ndim == 2
    expand = lambda m: None if m is None else np.asarray(_numpy(m))[None]  # noqa: E731
    if unbatched:
        x, key_padding_mask, memory_key_padding_mask = (x[None], expand(key_padding_mask),
                                                        expand(memory_key_padding_mask))
        memory = None if memory is None else np.asarray(_numpy(memory), np.float64)[None]
        attn_mask = attn_mask if attn_mask is None or np.ndim(attn_mask) == 2 else expand(attn_mask)
        memory_mask = memory_mask if memory_mask is None or np.ndim(memory_mask) == 2 else expand(memory_mask)
    b, t, e = x.shape
    if e != cfg.d_model:
        raise ValueError(f"reference: input width {e} != d_model {cfg.d_model}")
    p = Params(state_dict)
    masked = None if kind == "FeedForward" else build_mask(
        cfg.causal, b, t, t, _numpy(attn_mask), _numpy(key_padding_mask))
    memory_masked = None
    if kind in ("DecoderBlock", "Decoder"):
        if memory is None:
            raise ValueError(f"reference: a {kind} needs a memory")
        memory = np.asarray(_numpy(memory), np.float64)
        memory_masked = build_mask(False, b, t, memory.shape[1], _numpy(memory_mask), _numpy(memory_key_padding_mask))
    if kind in STACKS:
        y, extras = stack(cfg, p, kind, "", x, masked, num_layers, final_norm, memory, memory_masked)
    else:
        y, extras = block(cfg, p, kind, "", x, masked, deepnorm_alpha(cfg, 1), memory, memory_masked)
    p.check_all_used()
    if unbatched:
        y = y[0]
        extras = {k: v if k.endswith("logits_max") else v[:, 0] if kind in STACKS else v[0] for k, v in extras.items()}
    return (y, extras) if return_intermediates else y


class _NotCausal:
    """The config with causal=False (nn.Transformer's encoder is never causal)."""

    def __init__(self, cfg: Any):
        self._cfg = cfg

    def __getattr__(self, name: str) -> Any:
        return False if name == "causal" else getattr(self._cfg, name)


def transformer(cfg: Any, state_dict: dict[str, Any], src: Any, tgt: Any, *, src_mask: Any = None,
                tgt_mask: Any = None, memory_mask: Any = None, src_key_padding_mask: Any = None,
                tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None) -> np.ndarray:
    """nn.Transformer (encoder.*, decoder.*): the encoder (never causal) on src (B, S, E), the
    decoder (causal when cfg.causal) on tgt (B, T, E) over the encoder's output. Torch masks."""
    p = Params(state_dict)
    src, tgt = np.asarray(_numpy(src), np.float64), np.asarray(_numpy(tgt), np.float64)
    b, s, _ = src.shape
    t = tgt.shape[1]
    memory, _ = stack(_NotCausal(cfg), p, "Encoder", "encoder.", src,
                      build_mask(False, b, s, s, _numpy(src_mask), _numpy(src_key_padding_mask)), None, None)
    y, _ = stack(cfg, p, "Decoder", "decoder.", tgt,
                 build_mask(cfg.causal, b, t, t, _numpy(tgt_mask), _numpy(tgt_key_padding_mask)), None, None,
                 memory, build_mask(False, b, t, s, _numpy(memory_mask), _numpy(memory_key_padding_mask)))
    p.check_all_used()
    return y
