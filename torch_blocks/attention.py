"""Multi-head attention in PyTorch (twin of `flax_blocks.attention`), owning every option:
masks, causal, grouped-query heads, QK-norm, rotary positions and the attention weights. The
twins hold the same helpers under the same names in the same order, on the same layouts:
queries (B, H, T, hd), keys and values (B, K, S, hd); query head h reads key/value head h // G.
An attention call takes the input x (B, T, E) and one `AttentionCall` (mask, path, cache,
positions, layer; `flax_blocks.core.context`).

The paths (`AttentionCall.path`): "dense" (the explicit softmax: weights, every mask),
"blocked" (an online softmax over key blocks, O(T * block) memory) and "fused" (one
library kernel); BlockConfig.attention chooses, and `attention_path` resolves "auto" from
static facts of the call (no global state) by the rule both twins share
(`flax_blocks.core.attention_paths`). torch serves "blocked" and "fused" with SDPA.

Masks follow torch's convention: True means "may NOT attend"; a float mask is added to the
logits (-inf entries masked), as stock torch takes it. Rows in which every key is masked
give a zero attention output (bias included) and zero weights, as in flax_blocks (torch's
own MultiheadAttention gives NaN there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flax_blocks.core import declarations, rope
from flax_blocks.core.alibi import alibi_slopes
from flax_blocks.core.attention_paths import choose_path, lacks
from flax_blocks.core.config import (
    BlockConfig,
    check_attention_call,
    chunk_start,
    has_rotary,
    is_chunked,
    is_local,
    query_temperature,
    same_chunk,
    warn_fully_masked,
)
from flax_blocks.core.context import AttentionCall
from flax_blocks.core.rope import RopeScaling

from .layers import Norm, create_params

PATHS = ("dense", "fused")


def attention_path(cfg: BlockConfig, seq: Any = None, *, need_weights: bool, explicit_mask: bool = False,
                   dropout_active: bool = False, cached_or_cross: bool = False, platform: str = "cpu",
                   check: bool = True) -> str:
    """The path of an attention call over `seq` keys by the rule both twins share
    (`flax_blocks.core.attention_paths.choose_path`, whose docstring states it): "dense" when
    the call needs the weights or `seq` is not a concrete int (None: unknown); else "fused" on a
    GPU and "blocked" from AUTO_MIN_KEYS keys on, each where the twin's kernel computes the
    call; else "dense". With `check` (an uncached self-attention, as the Flax twin's), a forced
    "blocked" or "fused" that the call cannot honour raises the same ValueError in
    both twins (`check_attention_call`), so a call fails alike on both sides.
    torch's SDPA serves "blocked" and "fused" (masks, dropout, caches and memories included)
    where it computes the options (no soft-capped logits, sliding windows or sinks), else the
    path is "dense". platform: the device type ("cuda": a GPU)."""
    if check:
        check_attention_call(cfg, need_weights=need_weights, explicit_mask=explicit_mask,
                             dropout_active=dropout_active)
    path = choose_path(cfg, "torch", seq, need_weights=need_weights, explicit_mask=explicit_mask,
                       dropout_active=dropout_active, cached_or_cross=cached_or_cross, gpu=platform == "cuda")
    return "dense" if path == "dense" or need_weights or lacks("sdpa", cfg) else "fused"


class Mask(NamedTuple):
    """A prepared attention mask. masked (B|1, H|1, T, S) bool, True = may NOT attend (rows
    without any key opened up); rows (B|1, H|1, T, 1), True where a query has a key in that
    head (None: all have); bias (B|1, H|1, T, S) float added to the logits (stock torch's
    float masks)."""

    masked: Tensor | None
    rows: Tensor | None = None
    bias: Tensor | None = None
    causal: bool = False  # masked is exactly the causal mask (the fused path hands SDPA is_causal instead)


def _check_mask(name: str, mask: Tensor, shapes: Sequence[tuple[int, ...]]) -> tuple[Tensor, Tensor | None]:
    """(masked, bias) from a boolean mask (True = may NOT attend) or a float mask, which
    is added to the logits as stock torch does (-inf entries are the masked ones)."""
    if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        raise TypeError(
            f"{name} must be a boolean tensor (True = may NOT attend) or a float mask added to the "
            f"logits (-inf = may NOT attend), got dtype {mask.dtype}"
        )
    if tuple(mask.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, dict.fromkeys(shapes)))}, "
                         f"got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask, None
    masked = torch.isneginf(mask)
    return masked, mask.masked_fill(masked, 0.0)


def build_mask(
    cfg: BlockConfig, batch: int, seq: int, attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None, device: Any = None, *, keys: int | None = None,
    causal: bool | None = None,
) -> Mask | None:
    """Combine the causal flag and the user's masks (True = may NOT attend, or float masks
    added to the logits, as stock torch takes them).

    attn_mask: (seq, keys), (batch, seq, keys), or per head (batch * heads, seq, keys) as
    nn.MultiheadAttention takes it (row b * heads + h: element b, head h);
    key_padding_mask: (batch, keys), True = padding; keys: default seq (a
    cross-attention's memory length); causal: default cfg.causal.
    Returns None (nothing masked) or a `Mask` of (batch or 1, heads or 1, seq, keys) tensors.
    Batch elements left without any key warn (`FullyMaskedWarning`; CPU eager calls).
    """
    keys = seq if keys is None else keys
    h = cfg.num_heads
    masked = bias = None
    if cfg.causal if causal is None else causal:
        masked = torch.ones(seq, keys, dtype=torch.bool, device=device).triu(1)[None, None]
    if attn_mask is None and key_padding_mask is None:
        return None if masked is None else Mask(masked, causal=True)

    def attn_view(t: Tensor) -> Tensor:
        n = t.shape[0] if t.dim() == 3 else 1
        return t.reshape(n // h, h, seq, keys) if n == batch * h and h > 1 else t.reshape(-1, 1, seq, keys)

    for name, m, shapes, view in (
        ("attn_mask", attn_mask, [(seq, keys), (batch, seq, keys), (batch * h, seq, keys)], attn_view),
        ("key_padding_mask", key_padding_mask, [(batch, keys)], lambda t: t[:, None, None, :]),
    ):
        if m is None:
            continue
        m_masked, m_bias = _check_mask(name, m, shapes)
        masked = view(m_masked) if masked is None else masked | view(m_masked)
        if m_bias is not None:
            bias = view(m_bias) if bias is None else bias + view(m_bias)
    assert masked is not None  # one of the masks was given
    masked = masked.expand(-1, -1, seq, keys)  # a key-padding mask alone is (batch, 1, 1, keys)
    rows = ~masked.all(dim=-1, keepdim=True)
    _warn_if_fully_masked(rows, batch)
    return Mask(masked & rows, rows, bias)


def cache_mask(index: int, seq: int, valid: Tensor) -> Mask:
    """The causal mask of a chunk of `seq` queries at positions index .. index+seq-1 over a
    cache of L keys, `valid` (B, L) marking the keys written and not padding: its mask
    (B, 1, seq, L) and rows (B, 1, seq, 1) as `build_mask` returns them."""
    positions = index + torch.arange(seq, device=valid.device)
    keys = torch.arange(valid.shape[1], device=valid.device)
    allowed = (keys[None, :] <= positions[:, None])[None, None] & valid[:, None, None, :]  # (B, 1, seq, L)
    rows = allowed.any(dim=-1, keepdim=True)
    return Mask(~allowed & rows, rows)


def _within(masked: Tensor | None, rows: Tensor | None, outside: Tensor) -> tuple[Tensor, Tensor]:
    """masked (True: may not attend) and rows narrowed to the keys not `outside` (B|1, 1, T, S); a query
    left without a key has none (rows False, its mask opened up). masked None: `outside` alone."""
    m = outside if masked is None else masked | outside
    has = ~m.all(dim=-1, keepdim=True)
    return m & has, (has if rows is None else rows & has)


def _warn_if_fully_masked(rows: Tensor, batch: int) -> None:
    """CPU eager calls only: elsewhere the check would cost a device sync."""
    if rows.device.type != "cpu" or torch.compiler.is_compiling():
        return
    has_key = rows.reshape(rows.shape[0], -1).any(dim=1).expand(batch)
    warn_fully_masked(torch.nonzero(~has_key).flatten().tolist(), batch, "torch")


def rotary(x: Tensor, positions: Tensor, theta: float, dim: int | None = None,
           scaling: RopeScaling | None = None, interleaved: bool = False) -> Tensor:
    """Rotary position embedding, rotate-half convention (HF LLaMA / GPT-NeoX).

    x (B, T, heads, hd), positions (T,) or per batch row (B, T): dims i and i + hd/2 rotate
    together by the angle position * theta^(-2i/hd). Angles in float32 at least (float64
    under float64).
    dim: rotate only the first `dim` dims, hd read as dim above, and pass the rest through
    (partial rotary, HF GPT-NeoX); an odd dim rotates dim + 1 dims, the frequencies still
    theta^(-2i/dim), as HF's rotary does; None: all.
    scaling: a scaled rotary (`flax_blocks.core.rope`): its frequencies, with the sequence
    length max(positions) + 1 where the type reads one, and its factor on cos and sin.
    interleaved: dims 2i and 2i + 1 rotate together instead (GPT-J, Cohere): rotate-half on the
    rotated dims reordered evens first (`flax_blocks.core.rope.interleave_order`)."""
    dim = x.shape[-1] if dim is None else dim
    width = dim + dim % 2  # HF's cos and sin cover ceil(dim / 2) frequencies, twice
    if width < x.shape[-1]:
        rotated = rotary(x[..., :width], positions, theta, dim, scaling, interleaved)
        return torch.cat([rotated, x[..., width:]], dim=-1)
    if interleaved:
        order, inverse = rope.interleave_order(width)
        rotated = rotary(x[..., torch.from_numpy(order).to(x.device)], positions, theta, dim, scaling)
        return rotated[..., torch.from_numpy(inverse).to(x.device)]
    dt = torch.promote_types(x.dtype, torch.float32)
    base: float | Tensor = theta
    if scaling is not None and scaling.rope_type == "dynamic":  # the base grows past max_position_embeddings
        length = torch.clamp(positions.max() + 1, min=scaling.max_length).to(dt)
        base = rope.dynamic_theta(scaling, theta, dim, length)
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=dt, device=x.device) / dim)  # (width/2,)
    if scaling is not None and scaling.rope_type != "dynamic":
        short, long = rope.multipliers(scaling, float(theta), dim)
        m = torch.tensor(short, dtype=dt, device=x.device)
        if long is not None:  # longrope: the long factors once the sequence passes the original length
            m = torch.where(positions.max() + 1 > scaling.original, torch.tensor(long, dtype=dt, device=x.device), m)
        inv_freq = inv_freq * m
    angles = positions.to(dt)[..., None] * inv_freq  # (T, width/2) or (B, T, width/2)
    angles = torch.cat([angles, angles], dim=-1)[..., None, :]  # (T, 1, width) or (B, T, 1, width)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if scaling is not None and (factor := rope.attention_factor(scaling)) != 1.0:  # yarn, longrope
        cos, sin = cos * factor, sin * factor
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., : width // 2], x[..., width // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _head_product(q: Tensor, k: Tensor, dtype: torch.dtype) -> Tensor:
    """q (B, K, R, hd) . k (B, K, S, hd) over hd -> (B, K, R, S), batched over (B, K)."""
    return q.to(dtype) @ k.to(dtype).transpose(-1, -2)


def _cache_write(cache: dict[str, Tensor], k: Tensor, v: Tensor, index: int) -> tuple:
    """A cached self-attention's keys and values (B, K, L, hd) with the chunk's k, v (B, K, T, hd)
    at positions index .. index+T-1: (keys, values, cache), the cache a copy."""
    k_all, v_all = cache["k"].clone(), cache["v"].clone()
    k_all[:, :, index:index + k.shape[2]], v_all[:, :, index:index + k.shape[2]] = k, v
    return k_all, v_all, {"k": k_all, "v": v_all}


class _Projection(Protocol):
    """What `create_params` makes of the dotted names out_proj.weight / out_proj.bias: a
    plain nn.Module holding the two parameters (bias None when the option is off)."""

    weight: nn.Parameter
    bias: nn.Parameter | None


class Attention(nn.Module):
    """Self-attention with one packed q/k/v projection (see `declarations.attention`): K key/value
    heads, G = H / K query heads per key/value head, q_norm / k_norm (Norm over hd), sinks (H,).

    Parameters: in_proj_weight ((H+2K)*hd, E) with rows [q heads; k heads; v heads],
    in_proj_bias, out_proj.weight (E, H*hd), out_proj.bias. With K = H these are
    nn.MultiheadAttention's names and shapes, so its weights load.
    """

    # Registered from the declarations (declarations.attention) by create_params and __init__;
    # annotated here so that type checkers and IDEs see them. None: an option that is off.
    in_proj_weight: nn.Parameter
    in_proj_bias: nn.Parameter | None
    out_proj: _Projection
    q_norm: Norm | None
    k_norm: Norm | None
    sinks: nn.Parameter | None

    def __init__(self, cfg: BlockConfig, component: declarations.Component | None = None, *,
                 generator: torch.Generator | None = None):
        super().__init__()
        component = component or declarations.attention(cfg)
        self.cfg = cfg
        create_params(self, component, cfg, generator)
        for name, child in component.children:
            setattr(self, name, Norm(cfg, child, generator=generator))
        for owner, name in ((self, "in_proj_bias"), (self.out_proj, "bias"), (self, "q_norm"), (self, "k_norm"),
                            (self, "sinks")):
            if not hasattr(owner, name):  # options that are off
                setattr(owner, name, None)

    def qk_normed(self, norm: Norm, a: Tensor) -> Tensor:
        """QK-norm of a (B, T, heads, hd): over each head, or (qk_norm_over="projection", OLMo 2)
        over all of a token's heads at once, the projection's rows in order."""
        if self.cfg.qk_norm_over == "projection":
            return norm(a.reshape(*a.shape[:2], -1)).reshape(a.shape)
        return norm(a)

    def l2_normed(self, a: Tensor) -> Tensor:
        """Llama 4's L2 norm (qk_l2_norm) of a (B, T, heads, hd) over each head: a * rsqrt(mean(a^2) +
        eps), no weight, in float32 at least."""
        x = a.to(torch.promote_types(a.dtype, torch.float32))
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.layer_norm_eps)).to(a.dtype)

    def tempered(self, q: Tensor, index: int, rope: bool) -> Tensor:
        """Llama 4's query temperature (`query_temperature`) on q (B, H, T, hd) of a layer without
        rotary (`rope` False, or a traced one), at the slots index .. index + T - 1; q elsewhere."""
        if self.cfg.query_temperature_floor is None or rope is True:
            return q
        dt = torch.promote_types(q.dtype, torch.float32)
        slots = index + torch.arange(q.shape[2], device=q.device, dtype=dt)
        return (q * query_temperature(self.cfg, slots, torch)[:, None]).to(q.dtype)

    def position_qk(self, q: Tensor, k: Tensor, positions: Tensor, local: bool = False,
                    rope: bool = True) -> tuple[Tensor, Tensor]:
        """QK-norm, then rotary positions (OLMo 2 / Gemma 3 order). q (B, T, H, hd),
        k (B, T, K, hd), positions (T,) or (B, T); local: a sliding-window layer's (a bool, traced
        in a Flax layer scan), whose rotary base is rope_local_theta when given (Gemma 3); rope:
        whether this layer rotates (`has_rotary`: a bool, traced in a Flax layer scan; False in
        SmolLM3's NoPE layers, Cohere 2's global layers)."""
        if self.q_norm is not None:
            assert self.k_norm is not None  # declared together (cfg.qk_norm)
            q, k = self.qk_normed(self.q_norm, q), self.qk_normed(self.k_norm, k)
        if self.cfg.rope_theta is None or rope is False:
            return q, k
        rq, rk = self.rotated(q, k, positions, local)
        if self.cfg.qk_l2_norm:  # Llama 4: the rotary layers' q and k over their RMS, after rotary
            rq, rk = self.l2_normed(rq), self.l2_normed(rk)
        return rq, rk

    def rotated(self, q: Tensor, k: Tensor, positions: Tensor, local: bool) -> tuple[Tensor, Tensor]:
        """q and k rotated at positions, at rope_local_theta in a local layer when given."""
        assert self.cfg.rope_theta is not None
        theta: float = self.cfg.rope_theta
        dim, local_theta = self.cfg.rotary_dim, self.cfg.rope_local_theta
        scaling, pairs = self.cfg.rope_scaling, self.cfg.rope_interleaved
        if local_theta is not None and local is not False:
            theta, scaling = local_theta, None
        return rotary(q, positions, theta, dim, scaling, pairs), rotary(k, positions, theta, dim, scaling, pairs)

    def windowed(self, masked: Tensor | None, rows: Tensor | None, index: int, t: int, s: int,
                 local: bool, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        """A local layer's mask and rows (`local`: a bool, traced in a Flax layer scan): query i (at
        position index + i) sees key j (position j) only when |i - j| < W (under the causal mask:
        i - W < j); a query whose keys all lie outside its window has none (rows False, its mask
        opened up). masked None: no other mask (a bidirectional window, ModernBERT)."""
        window = self.cfg.sliding_window
        assert window is not None  # only a local layer is windowed
        qpos, kpos = index + torch.arange(t, device=device), torch.arange(s, device=device)
        outside = ((kpos[None, :] - qpos[:, None]).abs() >= window)[None, None]  # (1, 1, T, S)
        return _within(masked, rows, outside)

    def chunked(self, masked: Tensor | None, rows: Tensor | None, index: int, t: int, s: int,
                chunked: bool, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        """A chunked layer's mask and rows (`chunked`: a bool, traced in a Flax layer scan): query i (slot
        index + i) sees key j (slot j) only in its chunk of attention_chunk_size, the chunks counted from each
        row's first key some query may attend (its left padding: `chunk_start`, HF's left_padding_tokens), so
        cached decoding keeps the prefill's chunks. masked None: no padding, the chunks from slot 0."""
        size = self.cfg.attention_chunk_size
        assert size is not None  # only a chunked layer is chunked
        allowed = None if masked is None else ~masked if rows is None else ~masked & rows
        start = torch.zeros(1, dtype=torch.long, device=device) if allowed is None else chunk_start(allowed)
        slots = torch.arange(s, device=device)
        outside = ~same_chunk(size, index + torch.arange(t, device=device), slots, start)[:, None]  # (B|1, 1, T, S)
        return _within(masked, rows, outside)

    def alibi_bias(self, masked: Tensor | None, rows: Tensor | None, s: int) -> Tensor:
        """ALiBi's biases (B|1, H, 1, S) in float32 (`flax_blocks.core.alibi`): slope_h times key j's
        position among the real keys (those some query may attend, from masked (B|1, H|1, T, S) and
        rows; all S when masked is None), each rounded to bfloat16 as Falcon's build_alibi_tensor."""
        device = None if masked is None else masked.device
        if masked is None:
            pos = torch.arange(s, device=device)[None]
        else:
            allowed = ~masked if rows is None else ~masked & rows
            valid = allowed[:, 0].any(dim=1)  # (B|1, S)
            pos = (valid.cumsum(-1) - 1) * valid
        slopes = torch.from_numpy(alibi_slopes(self.cfg.num_heads)).to(device=device, dtype=torch.bfloat16)
        return (slopes[None, :, None, None] * pos.to(torch.bfloat16)[:, None, None, :]).float()

    def logits(self, qk: Tensor, masked: Tensor | None, bias: Tensor | None) -> Tensor:
        """The dense path's logits from q.k (B, H, T, S): scaled by 1 / sqrt(head_dim) (or
        query_pre_attn_scalar ** -0.5, Gemma), in float32 at least, soft-capped c tanh(s / c)
        (attn_logit_softcapping, Gemma 2), then a float mask added and the masked pairs -inf."""
        a = self.cfg.query_pre_attn_scalar
        logits = qk / math.sqrt(self.cfg.head_width) if a is None else qk * float(a) ** -0.5
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # never softmax in bf16
        c = self.cfg.attn_logit_softcapping
        if c is not None:
            logits = c * torch.tanh(logits / c)
        if bias is not None:
            logits = logits + bias
        return logits if masked is None else logits.masked_fill(masked, float("-inf"))

    def softmax(self, logits: Tensor) -> Tensor:
        """The dense path's softmax over the keys of logits (B, H, T, S); with attn_sinks (GPT-OSS) each
        head's sink logit joins as one more column, dropped after the softmax."""
        if self.sinks is None:
            return torch.softmax(logits, dim=-1)
        sink = self.sinks.to(logits.dtype)[:, None, None].expand(*logits.shape[:-1], 1)
        return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]

    def _project(self, x: Tensor, part: str) -> list[Tensor]:
        """x (B, T, E) through the in-projection's `part` ("qkv", "q" or "kv"): its tensors
        (B, T, heads, hd) (q: H heads; k, v: K), from one matmul over its rows of in_proj_weight."""
        cfg = self.cfg
        n, m = cfg.num_heads * cfg.head_width, cfg.kv_heads * cfg.head_width  # rows [q heads; k heads; v heads]
        first = {"qkv": 0, "q": 0, "kv": n}[part]
        last = {"qkv": n + 2 * m, "q": n, "kv": n + 2 * m}[part]
        bias = None if self.in_proj_bias is None else self.in_proj_bias[first:last]
        y = F.linear(x, self.in_proj_weight[first:last], bias)
        sizes = {"qkv": [n, m, m], "q": [n], "kv": [m, m]}[part]
        return [a.reshape(*x.shape[:2], -1, cfg.head_width) for a in y.split(sizes, dim=-1)]

    def memory_kv(self, memory: Tensor) -> dict[str, Tensor]:
        """Cross-attention keys and values of `memory` (B, S, E), computed once for cached
        decoding: {"k": (B, K, S, hd), "v": (B, K, S, hd)} (k after k_norm, no rotary), head-major
        as a decoding cache."""
        k, v = self._project(memory, "kv")
        k = k if self.k_norm is None else self.qk_normed(self.k_norm, k)
        return {"k": k.swapaxes(1, 2), "v": v.swapaxes(1, 2)}

    def forward(self, x: Tensor, call: AttentionCall | None = None, need_weights: bool = False,
                ) -> tuple[Tensor, Tensor | None, Tensor | None, dict[str, Tensor] | None]:
        """Self-attention of x (B, T, E), or (call.cross) cross-attention to call.memory (B, S, E).

        call (`AttentionCall`): mask, the prepared mask from `build_mask` / `cache_mask` (a head
        with no key gives no output; a query with none in any head none at all). cache: for
        self-attention {"k", "v"} (B, K, L, hd), head-major: x is the chunk at positions
        index .. index+T-1 (rotary continues from index); its keys and values are written there
        and the queries attend to all L cached positions (the mask hides the rest). For
        cross-attention, the memory's keys and values from `memory_kv`. positions: the rotary
        positions of x's tokens, (B, T) per batch row (HF's position_ids); None: index ..
        index+T-1 for every row. layer: this block's index in its stack (from 1; traced in a
        Flax layer scan): whether a self-attention is local (sliding_window,
        sliding_window_pattern) and which rotary base it takes. path: "dense" (the explicit
        softmax: every mask, weights, dropout) or a faster kernel (`attention_path`):
        "fused" (SDPA, which takes masks and dropout but returns no weights); None: `attention_path`
        (unchecked) from cfg, the keys and need_weights.

        Returns (out (B, T, E), attention weights (B, H, T, S), the largest pre-softmax logit over
        unmasked pairs (), the updated cache or None); weights and logit only when need_weights."""
        call = call or AttentionCall()  # (None: an uncached self-attention, no mask)
        masked, rows, bias, causal_only = (None, None, None, False) if call.mask is None else call.mask
        b, t, _ = x.shape
        local = False if call.cross else is_local(self.cfg, call.layer)  # a sliding-window layer (traced in a scan)
        cache = call.cache
        if call.cross:  # queries from x, keys and values from the memory (or its cache)
            q, k, v = self._cross_qkv(x, call.memory, cache)
        else:  # (B, T) per-row rotary positions (HF's position_ids), else index onwards
            positions = call.index + torch.arange(t, device=x.device) if call.positions is None else call.positions
            rope = has_rotary(self.cfg, call.layer, local)  # a layer with rotary (traced in a scan)
            q, k, v = self._self_qkv(x, positions, local, rope)
            q = self.tempered(q, call.index, rope)
            if cache is not None:
                k, v, cache = _cache_write(cache, k, v, call.index)
        path = call.path or attention_path(self.cfg, k.shape[2], need_weights=need_weights, check=False,
                                           cached_or_cross=call.cross or cache is not None, platform=x.device.type)
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if path != "dense" and need_weights:
            raise ValueError("the fused path (SDPA) returns no attention weights: take path='dense'")
        if local is not False:  # a sliding-window layer
            masked, rows = self.windowed(masked, rows, call.index, t, k.shape[2], local, x.device)
        if not call.cross and (chunks := is_chunked(self.cfg, call.layer)) is not False:  # Llama 4's chunks
            masked, rows = self.chunked(masked, rows, call.index, t, k.shape[2], chunks, x.device)
            causal_only = False
        p = self.cfg.dropout if self.training else 0.0
        weights = logit_max = None
        if path != "dense":
            out = self._efficient(path, q, k, v, Mask(masked, rows, bias, causal_only), p)
        else:
            alibi = self.alibi_bias(masked, rows, k.shape[2]) if self.cfg.alibi and not call.cross else None
            out, weights, logit_max = self._dense(q, k, v, masked, rows, bias, p, alibi)
        out = self._out(out)
        if rows is not None:  # a query with no key (in any head) gets no attention output, bias included
            out = torch.where(rows.any(dim=1), out, 0.0)
        return out, (weights if need_weights else None), (logit_max if need_weights else None), cache

    def _self_qkv(self, x: Tensor, positions: Tensor, local: bool,
                  rope: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's q (B, H, T, hd) and k, v (B, K, T, hd) of x (B, T, E), QK-norm and
        rotary (at positions, (T,) or (B, T), where `rope`) applied."""
        q, k, v = self._project(x, "qkv")
        q, k = self.position_qk(q, k, positions, local, rope)
        return q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)

    def _cross_qkv(self, x: Tensor, memory: Tensor | None,
                   cache: dict[str, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """Cross-attention's q (B, H, T, hd) of x (B, T, E) and the memory's keys and values
        (B, K, S, hd), computed from memory (B, S, E) or read from its cache (`memory_kv`)."""
        (q,) = self._project(x, "q")
        if self.q_norm is not None:
            q = self.qk_normed(self.q_norm, q)
        mem = self.memory_kv(memory) if memory is not None else cache
        assert mem is not None  # the blocks pass a memory or a cache made with one
        return q.swapaxes(1, 2), mem["k"], mem["v"]

    def _efficient(self, path: str, q: Tensor, k: Tensor, v: Tensor, mask: Mask, p: float) -> Tensor:
        """The fused path (SDPA) over q (B, H, T, hd) and k, v (B, K, S, hd) -> out (B, H, T, hd);
        masked rows were opened up by build_mask, so none is empty."""
        masked, rows, bias, causal_only = mask
        sdpa_mask, is_causal = None, False
        if causal_only and q.shape[2] == k.shape[2]:  # SDPA's own causal kernel: no (T, S) mask
            is_causal = True
        elif bias is not None:
            assert masked is not None  # build_mask sets it beside every bias
            sdpa_mask = bias.to(q.dtype).masked_fill(masked, float("-inf"))
        elif masked is not None:
            sdpa_mask = ~masked  # SDPA's boolean convention: True = may attend
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=p, is_causal=is_causal,
                                             enable_gqa=k.shape[1] != q.shape[1], scale=self.cfg.attention_scale)
        if rows is not None and rows.shape[1] > 1:  # a head with no key (per-head masks) gives no output
            out = torch.where(rows, out, 0.0)
        return out

    def _dense(self, q: Tensor, k: Tensor, v: Tensor, masked: Tensor | None, rows: Tensor | None,
               bias: Tensor | None, p: float, alibi: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The explicit softmax over q (B, H, T, hd) and k, v (B, K, S, hd) (ALiBi's biases
        (B|1, H, 1, S) added to q.k before the scale): (out (B, H, T, hd), weights (B, H, T, S), the
        largest unmasked logit ()).

        Batched matmuls over (B, K), a key/value head's G query heads as G*T rows (query head h =
        kv * G + g): no copy of k and v per query head."""
        b, h, t, d = q.shape
        kv, s = k.shape[1], k.shape[2]
        q = q.reshape(b, kv, -1, d)  # (B, K, G*T, hd)
        dt = torch.promote_types(q.dtype, k.dtype)
        scores = _head_product(q, k, dt)  # (B, K, G*T, S)
        heads = scores.reshape(b, h, t, s)
        if alibi is not None:  # ALiBi's biases, added before the scale (Falcon)
            heads = heads + alibi.to(heads.dtype)
        logits = self.logits(heads, masked, bias)
        logit_max = logits.max() if rows is None else logits.masked_fill(~rows, float("-inf")).max()
        weights = self.softmax(logits)
        if rows is not None:
            weights = torch.where(rows, weights, 0.0)
        weights = weights.to(v.dtype)
        dropped = F.dropout(weights, p, self.training).reshape(b, kv, -1, s)
        out = dropped @ v
        return out.reshape(b, h, t, -1), weights, logit_max

    def _out(self, out: Tensor) -> Tensor:
        """The heads' outputs (B, H, T, hd) through the output projection -> (B, T, E)."""
        b, h, t, d = out.shape
        return F.linear(out.swapaxes(1, 2).reshape(b, t, h * d), self.out_proj.weight, self.out_proj.bias)
