"""The numpy float64 reference (parity_tests/twins/reference.py): first proved right against
implementations outside this project (stock torch modules and functional pieces, hand
formulas), then every parity case checked against it, each twin on its own.

Errors are relative: max|a - b| / max|b| (harness.rel_err), 1e-12 in float64 throughout.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import replace
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx
from torch import nn

from flax_blocks.core.config import BlockConfig

from . import reference as ref
from .cases import CASES
from .harness import DECODERS, KINDS, STACKS, Case, flax_twin, make_inputs, precision, rel_err, torch_twin

TOL = 1e-12
E, H, FF, B, T = 12, 2, 20, 3, 6  # heads (2) != head_dim (6)


def ns(**kw) -> SimpleNamespace:
    """A config as the reference reads it (plain attributes), independent of BlockConfig's
    current fields, so the reference's own tests do not wait for the library's options."""
    base = dict(d_model=E, num_heads=H, d_ff=FF, activation="relu", layer_norm_eps=1e-5, bias=True,
                norm="post", residual="add", scaling="none", deepnorm_alpha=None, causal=False,
                norm_type="layernorm", mlp="dense", num_kv_heads=None, qk_norm=False, rope_theta=None,
                qkv_bias=None)
    return SimpleNamespace(**{**base, **kw})


def perturb(module: nn.Module, seed: int, scale: float = 0.2) -> nn.Module:
    """Move every parameter off its default (norms at 1/0, zero biases): all of them matter."""
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module.eval()


def state(module: nn.Module, prefix: str = "") -> dict[str, np.ndarray]:
    return {prefix + k: v.detach().numpy() for k, v in module.state_dict().items()}


def rand(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def masks(seed: int = 0):
    """attn_mask (B, T, T) and key_padding_mask (B, T), torch convention; no row loses every
    key (stock torch gives NaN there)."""
    g = torch.Generator().manual_seed(seed)
    attn = torch.rand(B, T, T, generator=g) < 0.3
    attn[..., 0] = False
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, 4:] = True
    return attn, kpm


# ----------------------------------------------------------------------------------------
# (a) The reference against implementations outside this project
# ----------------------------------------------------------------------------------------

ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


STOCK_LAYERS = [(nf, act, True, 1e-5) for nf in (True, False) for act in ACTIVATIONS] + [
    (nf, act, bias, eps) for nf in (True, False)
    for act, bias, eps in (("gelu", True, 1e-3), ("relu", False, 1e-12), ("gelu_tanh", False, 1e-3))]


@pytest.mark.parametrize("norm_first,activation,bias,eps", STOCK_LAYERS)
def test_reference_matches_stock_encoder_layer(norm_first, activation, bias, eps):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, 0.0, ACTIVATIONS[activation], eps, batch_first=True,
                                       norm_first=norm_first, bias=bias, dtype=torch.float64)
    perturb(layer, 0)
    x, (attn, kpm) = rand(B, T, E), masks()
    cfg = ns(activation=activation, bias=bias, layer_norm_eps=eps, norm="pre" if norm_first else "post")
    sd = state(layer)
    with torch.no_grad():
        assert rel_err(ref.forward("TransformerBlock", cfg, sd, x), layer(x)) <= TOL
        want = layer(x, src_mask=attn.repeat_interleave(H, 0), src_key_padding_mask=kpm)
        assert rel_err(ref.forward("TransformerBlock", cfg, sd, x, attn_mask=attn, key_padding_mask=kpm), want) <= TOL
        want = layer(x, src_mask=nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64), is_causal=True)
        assert rel_err(ref.forward("TransformerBlock", replace_ns(cfg, causal=True), sd, x), want) <= TOL


def replace_ns(cfg: SimpleNamespace, **kw) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(cfg), **kw})


def test_reference_eps_is_not_silently_fixed():
    """eps 1e-3 and 1e-5 differ far beyond the tolerance on this input: the eps tests above bite."""
    x = rand(B, T, E) * 0.05  # small variance makes eps matter
    w = np.ones(E)
    assert rel_err(ref.layer_norm(x.numpy(), w, None, 1e-3), ref.layer_norm(x.numpy(), w, None, 1e-5)) > 1e-3
    torch_ln = nn.LayerNorm(E, eps=1e-3, dtype=torch.float64)
    assert rel_err(ref.layer_norm(x.numpy(), w, np.zeros(E), 1e-3), torch_ln(x).detach()) <= TOL


@pytest.mark.parametrize("norm_first,final", [(True, True), (False, False), (False, True)])
def test_reference_matches_stock_encoder(norm_first, final):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, 0.0, "gelu", 1e-3, batch_first=True, norm_first=norm_first,
                                       dtype=torch.float64)
    norm = nn.LayerNorm(E, eps=1e-3, dtype=torch.float64) if final else None
    model = perturb(nn.TransformerEncoder(layer, 3, norm=norm, enable_nested_tensor=False), 1)  # layers now differ
    x, (attn, kpm) = rand(B, T, E, seed=2), masks(1)
    cfg = ns(activation="gelu", layer_norm_eps=1e-3, norm="pre" if norm_first else "post")
    with torch.no_grad():
        want = model(x, mask=attn[0], src_key_padding_mask=kpm)
    got = ref.forward("Encoder", cfg, state(model), x, attn_mask=attn[0].numpy(), key_padding_mask=kpm.numpy())
    assert rel_err(got, want) <= TOL


def test_reference_attention_weights_match_stock_mha():
    mha = perturb(nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64), 2)
    ln = perturb(nn.LayerNorm(E, dtype=torch.float64), 3)
    x, (attn, kpm) = rand(B, T, E, seed=3), masks(2)
    with torch.no_grad():
        out, w = mha(x, x, x, attn_mask=attn.repeat_interleave(H, 0), key_padding_mask=kpm,
                     average_attn_weights=False)
    sd = {**state(mha, "mha."), **state(ln, "norm.")}
    y, extra = ref.forward("ResidualMHA", ns(), sd, x, attn_mask=attn, key_padding_mask=kpm, return_intermediates=True)
    assert rel_err(extra["attention_weights"], w) <= TOL
    assert rel_err(y, ln(x + out).detach()) <= TOL


def test_reference_fully_masked_rows_are_zero():
    """A query whose keys are all masked: zero weights and a zero attention output (bias
    included), so the residual passes x through (where stock torch gives NaN)."""
    mha = perturb(nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64), 4)
    x = rand(B, T, E, seed=4)
    attn = torch.zeros(T, T, dtype=torch.bool)
    attn[2] = True  # query 2 may attend nothing
    sd = state(mha, "mha.")
    y, extra = ref.forward("ResidualMHA", ns(norm="none"), sd, x, attn_mask=attn, return_intermediates=True)
    np.testing.assert_array_equal(extra["attention_weights"][:, :, 2], 0.0)
    np.testing.assert_array_equal(y[:, 2], x[:, 2].numpy())
    with torch.no_grad():
        out, _ = mha(x, x, x, attn_mask=attn)
    keep = [i for i in range(T) if i != 2]
    assert rel_err(y[:, keep], (x + out)[:, keep]) <= TOL


@pytest.mark.parametrize("norm_first", [True, False])
def test_reference_matches_stock_decoder_layer(norm_first):
    torch.manual_seed(0)
    layer = perturb(nn.TransformerDecoderLayer(E, H, FF, 0.0, "gelu", 1e-4, batch_first=True,
                                               norm_first=norm_first, dtype=torch.float64), 5)
    x, memory = rand(B, T, E, seed=5), rand(B, T + 2, E, seed=6)
    mkpm = torch.zeros(B, T + 2, dtype=torch.bool)
    mkpm[0, -3:] = True
    with torch.no_grad():
        want = layer(x, memory, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64),
                     tgt_is_causal=True, memory_key_padding_mask=mkpm)
    cfg = ns(activation="gelu", layer_norm_eps=1e-4, norm="pre" if norm_first else "post", causal=True)
    got = ref.forward("DecoderBlock", cfg, state(layer), x, memory=memory, memory_key_padding_mask=mkpm)
    assert rel_err(got, want) <= TOL


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # stock's note on norm_first
def test_reference_matches_stock_transformer():
    """nn.Transformer (encoder.*, decoder.*, final norms), its layers made distinct, with
    key-padding masks and a causal target; and its decoder alone as an nn.TransformerDecoder."""
    torch.manual_seed(0)
    model = perturb(nn.Transformer(E, H, 2, 3, FF, 0.0, "gelu", batch_first=True, norm_first=True,
                                   layer_norm_eps=1e-4, dtype=torch.float64), 11)
    src, tgt = rand(B, T + 1, E, seed=11), rand(B, T, E, seed=12)
    skpm = torch.zeros(B, T + 1, dtype=torch.bool)
    skpm[2, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    with torch.no_grad():
        want = model(src, tgt, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=skpm,
                     memory_key_padding_mask=skpm)
        memory = model.encoder(src, src_key_padding_mask=skpm)
        want_dec = model.decoder(tgt, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=skpm)
    cfg = ns(activation="gelu", layer_norm_eps=1e-4, norm="pre", causal=True)
    got = ref.transformer(cfg, state(model), src, tgt, src_key_padding_mask=skpm.numpy(),
                          memory_key_padding_mask=skpm.numpy())
    assert rel_err(got, want) <= TOL
    got = ref.forward("Decoder", cfg, state(model.decoder), tgt, memory=memory, memory_key_padding_mask=skpm)
    assert rel_err(got, want_dec) <= TOL


def test_reference_rmsnorm_matches_torch():
    """norm_type="rmsnorm": a stock encoder layer with its LayerNorms swapped for nn.RMSNorm."""
    layer = nn.TransformerEncoderLayer(E, H, FF, 0.0, F.silu, batch_first=True, norm_first=True, bias=False,
                                       dtype=torch.float64)
    layer.norm1 = nn.RMSNorm(E, eps=1e-3, dtype=torch.float64)
    layer.norm2 = nn.RMSNorm(E, eps=1e-3, dtype=torch.float64)
    perturb(layer, 6)
    x = rand(B, T, E, seed=7)
    cfg = ns(norm="pre", norm_type="rmsnorm", activation="silu", bias=False, layer_norm_eps=1e-3)
    with torch.no_grad():
        assert rel_err(ref.forward("TransformerBlock", cfg, state(layer), x), layer(x)) <= TOL


def test_reference_gemma_norm_matches_hf():
    """norm_weight_offset=1: HF's GemmaRMSNorm (x.float() normalised, times 1 + w.float()),
    its weight w stored as is. HF computes it in float32 whatever the dtype (x.float()), so the
    check is to float32 rounding (w in place of 1 + w misses by ~0.3)."""
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    norm = gemma.GemmaRMSNorm(E, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    x = rand(B, T, E, seed=9)
    cfg = ns(norm_type="rmsnorm", norm_weight_offset=1.0, layer_norm_eps=1e-6)
    p = ref.Params(state(norm))
    with torch.no_grad():
        assert rel_err(ref._norm(cfg, p, "", x.numpy()), norm(x)) <= 1e-6
    p.check_all_used()


def test_reference_softcap_and_query_scale_match_hf_gemma2():
    """attn_logit_softcapping and query_pre_attn_scalar: HF Gemma 2's eager attention (soft-cap
    of the scaled logits, then the additive mask), causal; its softmax runs in float32."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    q, k, v = (rand(2, 4, T, 6, seed=s) * 2 for s in (12, 13, 14))  # (B, H, T, hd): logits of a few units
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    additive = torch.zeros(T, T, dtype=torch.float64).masked_fill(causal, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=1, training=False, head_dim=6)
    want, _ = gemma2.eager_attention_forward(module, q, k, v, additive, scaling=3.0 ** -0.5, softcap=2.0)
    got, _, _ = ref.softmax_attention(q.numpy(), k.numpy(), v.numpy(), causal.numpy()[None], 3.0 ** -0.5, 2.0)
    assert rel_err(got.transpose(0, 2, 1, 3), want) <= 1e-6
    uncapped, _, _ = ref.softmax_attention(q.numpy(), k.numpy(), v.numpy(), causal.numpy()[None], 3.0 ** -0.5)
    assert rel_err(uncapped.transpose(0, 2, 1, 3), want) > 1e-2  # (the cap bends these logits)


def test_reference_and_core_alibi_are_hf_falcons_build_alibi_tensor():
    """ALiBi's biases, bit for bit: the reference's (written from the formula) and the blocks'
    slopes (flax_blocks.core.alibi) against HF Falcon's build_alibi_tensor, for head counts that
    are and are not powers of two, over a left-padded and a mid-padded row of 600 keys (positions
    past 256, where bfloat16 rounds the ranks themselves)."""
    falcon = pytest.importorskip("transformers.models.falcon.modeling_falcon")
    from flax_blocks.core.alibi import alibi_slopes, round_bfloat16

    mask = torch.ones(2, 600, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    mask[1, 100:140] = 0  # padding mid-row: the keys after it are ranked 40 lower
    masked = ~mask.bool().numpy()[:, None, :]  # (B, 1, S): no query may attend a padded key
    for h in (1, 3, 4, 6, 8, 12, 32, 71):
        want = falcon.build_alibi_tensor(mask, h, torch.float64).reshape(2, h, 1, 600).numpy()
        got = ref.alibi(h, masked, 600)
        real = mask.bool().numpy()[:, None, None, :].repeat(h, 1)
        assert np.array_equal(got[real], want[real]), h
        ranks = round_bfloat16(np.arange(600, dtype=np.float32))
        ours = round_bfloat16(alibi_slopes(h)[:, None] * ranks[None, :]).astype(np.float64)
        assert np.array_equal(ours, falcon.build_alibi_tensor(torch.ones(1, 600, dtype=torch.long), h,
                                                              torch.float64).reshape(h, 600).numpy()), h
    assert not np.array_equal(ref.alibi(3, None, 600)[0, :, 0], ref.alibi(3, None, 600)[0, ::-1, 0])


@pytest.mark.parametrize("layer,local", [(1, True), (2, False), (3, True)])
def test_reference_sliding_window_is_hfs(layer, local):
    """sliding_window W = 3 with global layers every 2nd (Gemma 2): a local layer's weights are
    non-zero exactly where HF's sliding_window_causal_mask_function allows (i - W < j <= i), a
    global layer's where the causal mask does."""
    masking = pytest.importorskip("transformers.masking_utils")
    t = 7
    g = np.random.default_rng(layer)
    sd = {"in_proj_weight": g.normal(size=(3 * E, E)), "in_proj_bias": g.normal(size=3 * E),
          "out_proj.weight": g.normal(size=(E, E)), "out_proj.bias": g.normal(size=E)}
    cfg = ns(causal=True, sliding_window=3, sliding_window_pattern=2)
    _, w, _ = ref.attention(cfg, ref.Params(sd), "", g.normal(size=(1, t, E)), ref.build_mask(True, 1, t, t),
                            layer=layer)
    fn = masking.sliding_window_causal_mask_function(3) if local else masking.causal_mask_function
    i, j = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
    hf = fn(torch.tensor(0), torch.tensor(0), i, j).numpy()
    assert ((w[0] > 0) == hf[None]).all()


@pytest.mark.parametrize("pad", [0, 2])
def test_reference_chunks_are_hfs(pad):
    """attention_chunk_size 3 over 9 keys, the row left-padded by `pad`: the keys the reference's chunked
    mask leaves are exactly those HF's chunked_causal_mask_function (with its left_padding) and the key
    mask leave (the chunks counted from the first real key)."""
    masking = pytest.importorskip("transformers.masking_utils")
    t = 9
    keys = np.arange(t)[None] < pad  # True: padding
    ours = ~ref._chunked(ref.build_mask(True, 1, t, t, None, keys), 3, t, t)[0]
    i, j = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
    hf = masking.chunked_causal_mask_function(3, torch.tensor([pad]))(torch.tensor(0), torch.tensor(0), i, j)
    assert (ours == (hf.numpy() & (np.arange(t) >= pad)[None])).all()


def _torch_attention(sd: dict[str, torch.Tensor], x: torch.Tensor, h: int, k: int, *, qk_norm: str | None,
                     theta: float | None, bias: bool, eps: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention with GQA, QK-norm and rotary from torch's functional pieces: F.rms_norm /
    F.layer_norm, rotary as a complex rotation of the (i, i + hd/2) pairs, and
    F.scaled_dot_product_attention(enable_gqa=True). mask: True = may attend."""
    b, t, e = x.shape
    hd = e // h
    w, bi = sd["in_proj_weight"], sd.get("in_proj_bias")
    qkv = F.linear(x, w, bi)
    q, kk, v = qkv.split([h * hd, k * hd, k * hd], dim=-1)
    q, kk, v = (a.reshape(b, t, -1, hd).transpose(1, 2) for a in (q, kk, v))
    if qk_norm == "rmsnorm":
        q, kk = F.rms_norm(q, (hd,), sd["q_norm.weight"], eps), F.rms_norm(kk, (hd,), sd["k_norm.weight"], eps)
    elif qk_norm == "layernorm":
        q = F.layer_norm(q, (hd,), sd["q_norm.weight"], sd.get("q_norm.bias"), eps)
        kk = F.layer_norm(kk, (hd,), sd["k_norm.weight"], sd.get("k_norm.bias"), eps)
    if theta is not None:
        freqs = torch.outer(torch.arange(t, dtype=torch.float64),
                            1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        rot = torch.polar(torch.ones_like(freqs), freqs)  # e^{i pos f}, (T, hd/2)

        def rope(a):
            c = torch.complex(a[..., : hd // 2], a[..., hd // 2:]) * rot
            return torch.cat([c.real, c.imag], dim=-1)

        q, kk = rope(q), rope(kk)
    o = F.scaled_dot_product_attention(q, kk, v, attn_mask=mask, enable_gqa=True)
    return F.linear(o.transpose(1, 2).reshape(b, t, e), sd["out_proj.weight"], sd.get("out_proj.bias"))


@pytest.mark.parametrize("kv,qk_norm,theta,causal", [
    (2, None, None, False), (1, None, None, True), (4, None, None, False),  # GQA, MQA, MHA
    (4, "rmsnorm", None, False), (2, "layernorm", None, True),  # QK-norm
    (4, None, 10000.0, False), (2, "rmsnorm", 500.0, True),  # rotary (after QK-norm)
])
def test_reference_attention_matches_torch_functional(kv, qk_norm, theta, causal):
    h, e, t = 4, 16, 7  # head_dim 4
    g = torch.Generator().manual_seed(kv)
    hd = e // h
    sd = {"in_proj_weight": torch.randn((h + 2 * kv) * hd, e, generator=g, dtype=torch.float64) * 0.5,
          "in_proj_bias": torch.randn((h + 2 * kv) * hd, generator=g, dtype=torch.float64),
          "out_proj.weight": torch.randn(e, e, generator=g, dtype=torch.float64) * 0.3,
          "out_proj.bias": torch.randn(e, generator=g, dtype=torch.float64)}
    if qk_norm:
        for n in ("q_norm", "k_norm"):
            sd[f"{n}.weight"] = 1 + 0.3 * torch.randn(hd, generator=g, dtype=torch.float64)
    x = torch.randn(2, t, e, generator=g, dtype=torch.float64)
    kpm = torch.zeros(2, t, dtype=torch.bool)
    kpm[1, -2:] = True
    masked = (torch.ones(t, t, dtype=torch.bool).triu(1) if causal
              else torch.zeros(t, t, dtype=torch.bool)) | kpm[:, None, :]
    want = _torch_attention(sd, x, h, kv, qk_norm=qk_norm, theta=theta, bias=True, eps=1e-4,
                            mask=~masked[:, None])
    cfg = ns(d_model=e, num_heads=h, num_kv_heads=kv, qk_norm=qk_norm is not None, rope_theta=theta,
             norm_type=qk_norm or "layernorm", causal=causal, layer_norm_eps=1e-4)
    p = ref.Params({k: v.numpy() for k, v in sd.items()})
    got, _, _ = ref.attention(cfg, p, "", x.numpy(), ref.build_mask(causal, 2, t, t, None, kpm.numpy()))
    p.check_all_used()
    assert rel_err(got, want) <= TOL


def test_reference_rotary_relative_positions():
    """Rotary makes logits depend on positions only through their difference."""
    g = np.random.default_rng(0)
    q, k = g.normal(size=(1, 1, 1, 8)), g.normal(size=(1, 1, 1, 8))
    dots = []
    for shift in (0, 3):
        qs = ref.rotary(np.repeat(q, 9, axis=2), 100.0)[0, 0, 2 + shift]
        ks = ref.rotary(np.repeat(k, 9, axis=2), 100.0)[0, 0, 5 + shift]
        dots.append(qs @ ks)
    assert abs(dots[0] - dots[1]) <= 1e-12 * abs(dots[0])
    assert abs(dots[0] - q.ravel() @ k.ravel()) > 1e-3  # and the rotation does change it


def test_reference_partial_rotary_matches_hf_gpt_neox():
    """partial_rotary_factor 0.5 of head_dim 8: HF GPT-NeoX's rotary embedding and
    apply_rotary_pos_emb (angles in float32 there, so to float32 rounding)."""
    neox = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    from transformers import GPTNeoXConfig

    config = GPTNeoXConfig(hidden_size=32, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5})
    q, k = rand(2, 4, T, 8, seed=10), rand(2, 4, T, 8, seed=11)  # (B, H, T, hd)
    cos, sin = neox.GPTNeoXRotaryEmbedding(config)(q, torch.arange(T)[None])
    want_q, want_k = neox.apply_rotary_pos_emb(q, k, cos, sin)
    assert rel_err(ref.rotary(q.numpy(), 100.0, 0.5), want_q) <= 1e-6
    assert rel_err(ref.rotary(k.numpy(), 100.0, 0.5), want_k) <= 1e-6
    assert rel_err(ref.rotary(q.numpy(), 100.0), want_q) > 1e-2  # (the full rotary differs)


@pytest.mark.parametrize("mlp,act", [("swiglu", "silu"), ("geglu", "gelu"), ("geglu", "gelu_tanh")])
def test_reference_gated_mlp_matches_torch(mlp, act):
    lin1, gate, lin2 = (nn.Linear(E, FF, dtype=torch.float64), nn.Linear(E, FF, dtype=torch.float64),
                        nn.Linear(FF, E, dtype=torch.float64))
    ln = perturb(nn.LayerNorm(E, dtype=torch.float64), 7)
    fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda a: F.gelu(a, approximate="tanh")}[act]
    x = rand(B, T, E, seed=8)
    with torch.no_grad():
        want = x + lin2(fn(gate(ln(x))) * lin1(ln(x)))
    sd = {**state(lin1, "linear1."), **state(gate, "linear_gate."), **state(lin2, "linear2."), **state(ln, "norm.")}
    assert rel_err(ref.forward("FeedForward", ns(norm="pre", mlp=mlp, activation=act), sd, x), want) <= TOL


def test_reference_peri_and_gates_by_hand():
    """peri x + s Norm_out(F(Norm_in(x))) with a LayerScale gate, and DeepNorm's alpha, by hand
    from stock modules."""
    lin1, lin2 = nn.Linear(E, FF, dtype=torch.float64), nn.Linear(FF, E, dtype=torch.float64)
    n_in, n_out = (perturb(nn.RMSNorm(E, eps=1e-6, dtype=torch.float64), 8),
                   perturb(nn.RMSNorm(E, eps=1e-6, dtype=torch.float64), 9))
    gate = rand(E, seed=9)
    x = rand(B, T, E, seed=10)
    ff = lambda a: lin2(F.relu(lin1(a)))  # noqa: E731
    sd = {**state(lin1, "linear1."), **state(lin2, "linear2."), **state(n_in, "norm."), **state(n_out, "norm_out."),
          "scale": gate.numpy()}
    cfg = ns(norm="peri", norm_type="rmsnorm", scaling="layerscale", layer_norm_eps=1e-6)
    with torch.no_grad():
        assert rel_err(ref.forward("FeedForward", cfg, sd, x), x + gate * n_out(ff(n_in(x)))) <= TOL
        ln = perturb(nn.LayerNorm(E, dtype=torch.float64), 10)
        sd = {**state(lin1, "linear1."), **state(lin2, "linear2."), **state(ln, "norm.")}
        alpha = (2 * 1) ** 0.25
        assert rel_err(ref.forward("FeedForward", ns(scaling="deepnorm"), sd, x), ln(alpha * x + ff(x))) <= TOL
        assert rel_err(ref.forward("FeedForward", ns(residual="none"), sd, x), ln(ff(x))) <= TOL
        sd["scale"] = np.array(0.7)
        del sd["norm.weight"], sd["norm.bias"]
        assert rel_err(ref.forward("FeedForward", ns(norm="none", scaling="rezero"), sd, x), x + 0.7 * ff(x)) <= TOL


def test_reference_activations_by_formula():
    v = np.linspace(-8, 8, 1001)
    assert rel_err(ref.activation("gelu", v), F.gelu(torch.from_numpy(v))) <= TOL
    assert rel_err(ref.activation("gelu_tanh", v), F.gelu(torch.from_numpy(v), approximate="tanh")) <= TOL
    assert rel_err(ref.activation("silu", v), F.silu(torch.from_numpy(v))) <= TOL
    assert rel_err(ref.activation("gelu", v), ref.activation("gelu_tanh", v)) > 1e-5  # the two GELUs differ (5.9e-5)
    assert ref.erf(np.array([0.5]))[0] == math.erf(0.5)


def test_reference_refuses_unexplained_or_misshapen_parameters():
    layer = nn.TransformerEncoderLayer(E, H, FF, 0.0, batch_first=True, dtype=torch.float64)
    sd = state(layer)
    x = rand(B, T, E)
    with pytest.raises(ValueError, match="does not explain.*extra"):
        ref.forward("TransformerBlock", ns(), {**sd, "extra": np.zeros(1)}, x)
    with pytest.raises(ValueError, match=r"linear1.weight has shape \(20, 12\), expected \(21, 12\)"):
        ref.forward("TransformerBlock", ns(d_ff=FF + 1), sd, x)
    with pytest.raises(KeyError, match="norm1.bias"):
        ref.forward("TransformerBlock", ns(), {k: v for k, v in sd.items() if k != "norm1.bias"}, x)


# ----------------------------------------------------------------------------------------
# (b) Every parity case against the reference, each twin on its own, in float64
# ----------------------------------------------------------------------------------------


def twin_runs(case: Case):
    """Eval-mode float64 forward of both twins of `case` (weights made once in torch and
    moved with the converter, as the harness does), and the reference on the same torch
    state dict and inputs. Returns (torch, flax, reference, run_reference): each of the first
    three is (y, {intermediate name: array}); run_reference(change) reruns the reference on
    the same inputs with change(cfg, state_dict) -> (cfg, state_dict) (for diagnoses)."""
    with precision("float64"):
        tmod = torch_twin(case, "float64")
        fmod = flax_twin(case, tmod, "float64")
        inp = make_inputs(case)
        invert = lambda m: None if m is None else ~m  # noqa: E731  (torch's convention)
        torch_masks = [invert(m) for m in (inp.attention_mask, inp.key_mask, inp.memory_key_mask)]
        decoder = case.kind in DECODERS
        # weights and residuals where the block returns them (a forced blocked / fused path does not)
        intermediates = case.kind != "FeedForward" and case.cfg.attention not in ("blocked", "fused")
        as_t = lambda a: None if a is None else torch.from_numpy(a)  # noqa: E731
        with torch.no_grad():  # train mode, dropout 0: not torch's fast path
            if decoder:
                args = [as_t(inp.memory), as_t(torch_masks[0]), None, as_t(torch_masks[1]), as_t(torch_masks[2])]
            else:
                args = [] if case.kind == "FeedForward" else [as_t(m) for m in torch_masks[:2]]
            kw = {"return_intermediates": True} if intermediates else {}
            out = tmod(torch.from_numpy(inp.x), *args, **kw)
            t = (out[0].numpy(), {k: v.numpy() for k, v in out[1].items()}) if intermediates else (out.numpy(), {})
        opt = lambda m: None if m is None else jnp.asarray(m)  # noqa: E731
        fkw = {} if case.kind == "FeedForward" else {"attention_mask": opt(inp.attention_mask),
                                                     "key_mask": opt(inp.key_mask)}
        if decoder:
            fkw["memory_key_mask"] = opt(inp.memory_key_mask)
        fmod.eval()
        # one compiled program per case: 40% less time over CASES than op-by-op dispatch; a
        # fresh function, so it is traced anew and sees the code as it is now (test_mutations)
        call = nnx.jit(lambda m, args, masks: m(*args, **masks,
                                                **({"return_intermediates": True} if intermediates else {})))
        out = call(fmod, (jnp.asarray(inp.x),) + ((jnp.asarray(inp.memory),) if decoder else ()), fkw)
        f = ((np.asarray(out[0]), {k: np.asarray(v) for k, v in out[1].items()}) if intermediates
             else (np.asarray(out), {}))
    sd = {k: v.numpy() for k, v in tmod.state_dict().items()}
    final_norm = case.final_norm if case.final_norm is not None else case.cfg.norm in ("pre", "peri", "out")

    def run_reference(change=lambda c, d: (c, d)):
        cfg, state_dict = change(case.cfg, sd)
        return ref.forward(case.kind, cfg, state_dict, inp.x, attn_mask=torch_masks[0],
                           key_padding_mask=torch_masks[1], memory=inp.memory, memory_key_padding_mask=torch_masks[2],
                           num_layers=case.num_layers if case.kind in STACKS else None,
                           final_norm=final_norm if case.kind in STACKS else None, return_intermediates=True)

    return t, f, run_reference(), run_reference


def _q_rows_scaled(cfg, sd: dict, factor: float) -> dict:
    """The state dict with every attention's q projection (weight rows and bias) times factor."""
    out = dict(sd)
    q = cfg.num_heads * cfg.head_width
    for k, v in sd.items():
        if k.endswith("in_proj_weight") or k.endswith("in_proj_bias"):
            out[k] = v.copy()
            out[k][:q] = v[:q] * factor
    return out


def _pre_norms_scaled(cfg, sd: dict) -> dict:
    """The state dict with layer l's (from 1) norm1 / norm2 / norm3 weight and bias times
    1 / sqrt(l): each pre-norm's output then carries 1 / l under LayerNorm Scaling (exactly, for
    LayerNorm, RMSNorm and DyT, all linear in their weight and bias)."""
    out = dict(sd)
    for k, v in sd.items():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.norm\d\.(weight|bias)$", k)
        if m:
            out[k] = v / math.sqrt(int(m.group(1)) + 1)
    return out


# Classic mistakes, as a change of the reference's config or weights: when a twin misses the
# reference, the check reruns it with each and names those that the twin matches.
SUSPECTS = [
    ("ignores layer_norm_eps (uses torch's 1e-5)", lambda c, sd: (replace(c, layer_norm_eps=1e-5), sd),
     lambda c: c.layer_norm_eps != 1e-5),
    ("ignores layer_norm_eps (uses flax's 1e-6)", lambda c, sd: (replace(c, layer_norm_eps=1e-6), sd),
     lambda c: c.layer_norm_eps != 1e-6),
    ("computes tanh GELU where exact GELU is asked", lambda c, sd: (replace(c, activation="gelu_tanh"), sd),
     lambda c: c.activation == "gelu"),
    ("computes exact GELU where tanh GELU is asked", lambda c, sd: (replace(c, activation="gelu"), sd),
     lambda c: c.activation == "gelu_tanh"),
    ("drops DeepNorm's alpha (skip weight 1)", lambda c, sd: (replace(c, deepnorm_alpha=1.0), sd),
     lambda c: c.scaling == "deepnorm"),
    ("scales attention logits by 1/head_dim instead of 1/sqrt(head_dim)",
     lambda c, sd: (c, _q_rows_scaled(c, sd, 1 / math.sqrt(c.head_width))), lambda c: not getattr(c, "qk_norm", False)),
    ("multiplies by w where Gemma's (1 + w) is meant", lambda c, sd: (replace(c, norm_weight_offset=0.0), sd),
     lambda c: getattr(c, "norm_weight_offset", 0.0) != 0.0),
    ("runs the parallel residual's branches one after the other",
     lambda c, sd: (replace(c, parallel_residual="none"), sd),
     lambda c: getattr(c, "parallel_residual", "none") == "two_norms"),
    ("ignores the causal flag", lambda c, sd: (replace(c, causal=False), sd), lambda c: c.causal),
    ("scales layer l's pre-norms by 1/l instead of 1/sqrt(l)", lambda c, sd: (c, _pre_norms_scaled(c, sd)),
     lambda c: getattr(c, "layernorm_scaling", False)),
]


def diagnose(case: Case, y: np.ndarray, run_reference) -> list[str]:
    """The SUSPECTS whose reference output the twin's output `y` matches within TOL."""
    found = []
    for what, change, applies in SUSPECTS:
        if applies(case.cfg):
            err = rel_err(y, run_reference(change)[0])
            if err <= TOL:
                found.append(f"{what} (then within {err:.0e})")
    return found


def reference_errors(case: Case, diagnoses: dict | None = None) -> dict[str, dict[str, float]]:
    """{twin: {"output" or intermediate name: rel error against the reference}}, float64.
    Fills `diagnoses` (if given) with {twin: matching SUSPECTS} for twins that miss."""
    t, f, r, run_reference = twin_runs(case)
    errors = {}
    for twin, (y, extras) in (("torch", t), ("flax", f)):
        errors[twin] = {"output": rel_err(y, r[0])}
        errors[twin].update({name: rel_err(v, r[1][name]) for name, v in extras.items() if name in r[1]})
        if diagnoses is not None and max(errors[twin].values()) > TOL:
            diagnoses[twin] = diagnose(case, y, run_reference)
    return errors


def check_against_reference(case: Case, errors: dict | None = None, diagnoses: dict | None = None) -> None:
    """Assert each twin's float64 output (and attention weights / per-layer residuals where
    the block returns them) is within TOL of the reference; the message names the twin and,
    where one of SUSPECTS explains the miss, the mistake. errors and diagnoses: those of
    `reference_errors` when already computed."""
    if errors is None:
        diagnoses = {}
        errors = reference_errors(case, diagnoses)
    diagnoses = diagnoses or {}
    bad = []
    for twin, errs in errors.items():
        for what, err in errs.items():
            if not err <= TOL:
                bad.append(f"{twin} twin vs numpy reference, {case.name}: {what} rel err {err:.2e} > {TOL:.0e}")
        if diagnoses.get(twin):
            bad.append(f"the {twin} twin matches the reference if it {' / '.join(diagnoses[twin])}")
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_case_matches_reference(case):
    check_against_reference(case)


def _eps_cases() -> list[Case]:
    """Non-default eps wherever a norm sits: the first block case of each (norm placement,
    norm type, QK-norm) and one Encoder (its final norm), at eps 1e-3 and 1e-12 in turn,
    unless CASES already has that combination at a non-default eps (the kinds share their
    norm code, so blocks stand for them)."""
    def key(c: Case):
        if c.kind == "Encoder":
            return ("Encoder",)
        return (c.cfg.norm, getattr(c.cfg, "norm_type", ""), getattr(c.cfg, "qk_norm", False))

    have = {key(c) for c in CASES if c.cfg.layer_norm_eps != 1e-5}
    picked = []
    for c in CASES:
        wanted = c.kind == "TransformerBlock" or (c.kind == "Encoder" and c.cfg.norm == "pre")
        has_norm = c.cfg.norm != "none" or getattr(c.cfg, "qk_norm", False)
        if wanted and has_norm and key(c) not in have and c.batch > 1 and c.seq > 1:
            have.add(key(c))
            eps = (1e-3, 1e-12)[len(picked) % 2]
            picked.append(replace(c, cfg=replace(c.cfg, layer_norm_eps=eps)))
    return picked


EPS_CASES = _eps_cases()


@pytest.mark.parametrize("case", EPS_CASES, ids=lambda c: f"eps{c.cfg.layer_norm_eps:g}/{c.name}")
def test_case_with_non_default_eps_matches_reference(case):
    check_against_reference(case)


# Cases beyond the parity matrix that the reference alone checks (options the matrix leaves
# at one value).
EXTRA_CASES = [
    Case("TransformerBlock", replace(CASES[0].cfg, norm="post", scaling="deepnorm", deepnorm_alpha=1.7)),
]


@pytest.mark.parametrize("case", EXTRA_CASES, ids=lambda c: c.name)
def test_extra_case_matches_reference(case):
    check_against_reference(case)


# ----------------------------------------------------------------------------------------
# (c) Coverage: every BlockConfig field is handled, every value of it is checked
# ----------------------------------------------------------------------------------------


def test_reference_declares_every_config_field():
    fields = {f.name for f in dataclasses.fields(BlockConfig)}
    undeclared = fields - ref.HANDLED - set(ref.NOT_FORWARD)
    assert not undeclared, (f"BlockConfig fields the numpy reference does not declare: {sorted(undeclared)}; "
                            "implement them in parity_tests/twins/reference.py and add them to HANDLED (or to "
                            "NOT_FORWARD with the reason they do not change the eval forward)")
    assert not ref.HANDLED & set(ref.NOT_FORWARD)
    stale = (ref.HANDLED | set(ref.NOT_FORWARD)) - fields
    assert not stale, f"the reference declares fields BlockConfig no longer has: {sorted(stale)}"


def _values_needed(name: str, hint) -> list | None:
    """The values of field `name` that reference-checked cases must reach: every Literal
    value, both bools, None and a number for optional fields; None for plain numbers (then
    two distinct values are needed)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return list(args)
    if hint is bool:
        return [False, True]
    if type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return [None, "not None"] + (["True", "False"] if inner == [bool] else [])
    return None


def test_every_option_value_is_checked_against_reference():
    """Each value of each handled field (and each block kind) occurs in a case that
    test_case_*_matches_reference runs: a new option or value needs a case."""
    cases = CASES + EPS_CASES + EXTRA_CASES
    hints = typing.get_type_hints(BlockConfig)
    missing = []
    for f in dataclasses.fields(BlockConfig):
        if f.name not in ref.HANDLED:
            continue
        seen = [getattr(c.cfg, f.name) for c in cases]
        needed = _values_needed(f.name, hints[f.name])
        if needed is None:
            if len(set(seen)) < 2:
                missing.append(f"{f.name}: only {sorted(set(seen))}")
            continue
        for v in needed:
            hit = (any(s is not None for s in seen) if v == "not None"
                   else any(s is (v == "True") for s in seen) if v in ("True", "False")
                   else any(s == v and type(s) is type(v) for s in seen))
            if not hit:
                missing.append(f"{f.name}={v}")
    kinds = {c.kind for c in cases}
    missing += [f"kind {k}" for k in (*KINDS, *DECODERS) if k not in kinds]
    assert not missing, f"options with no case checked against the numpy reference: {missing}"


# ----------------------------------------------------------------------------------------
# Low precision against the reference: the same (rounded) weights and input in float64
# ----------------------------------------------------------------------------------------

LOW = [  # (torch param dtype or None, Flax param_dtype, Flax dtype, input dtype); measured rel err
    ("bfloat16", "bfloat16", None, "bfloat16"),  # torch 4.1e-3, flax 4.1e-3
    (None, "float32", "bfloat16", "float32"),  # flax 6.7e-3 (the torch twin has no computation dtype)
    ("float16", "float16", None, "float16"),  # torch 3.0e-4, flax 4.8e-4
]


@pytest.mark.parametrize("torch_dtype,param_dtype,dtype,x_dtype", LOW)
def test_low_precision_against_reference(torch_dtype, param_dtype, dtype, x_dtype):
    """bf16 / f16 parameters, or a bf16 computation dtype: each twin within a few times the
    error measured against the float64 reference on the same rounded weights and input, and
    well above float32's (so the low precision is really used)."""
    case = next(c for c in CASES if c.kind == "TransformerBlock")
    tmod = torch_twin(case, param_dtype)
    sd = {k: v.detach().double().numpy() for k, v in tmod.state_dict().items()}
    x = torch.from_numpy(make_inputs(case).x).to(getattr(torch, x_dtype))
    want = ref.forward("TransformerBlock", case.cfg, sd, x.double().numpy())
    errs = {}
    if torch_dtype is not None:
        with torch.no_grad():
            errs["torch"] = rel_err(tmod(x).double().numpy(), want)
    fmod = flax_twin(case, tmod, param_dtype, cfg=replace(case.cfg, dtype=dtype))
    y = nnx.jit(lambda m, x: m(x))(fmod, jnp.asarray(x.float().numpy()).astype(x_dtype))
    assert y.dtype == jnp.dtype(dtype or x_dtype)
    errs["flax"] = rel_err(np.asarray(y.astype(jnp.float32)), want)
    bound = {"bfloat16": 0.02, "float16": 0.0015}[dtype or x_dtype]  # about 3x the worst measured
    for twin, err in errs.items():
        assert bound / 100 < err <= bound, f"{twin} twin, params {param_dtype}, dtype {dtype}: rel err {err:.1e}"
