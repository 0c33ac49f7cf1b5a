"""Acceptance: stock torch.nn.TransformerEncoderLayer / TransformerEncoder state dicts load with
strict=True into torch_blocks.TransformerBlock / Encoder and reproduce the stock outputs to
<= 2e-6 in float32 (stock runs SDPA, ours the explicit softmax), in train mode (dropout 0), in
eval with autograd on, and on the stock eval + no_grad fast path; with and without key-padding and attention masks.

torch's mask convention throughout: True = may NOT attend, True in a key-padding mask = padding.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import torch_blocks as tb
from flax_blocks.core.config import BlockConfig

torch.set_num_threads(1)

E, H, FF, B, T = 24, 4, 40, 3, 7  # heads (4) != head_dim (6)
# relative: max |ours - stock| / max |stock| (the parity suite's measure). Stock's attention runs
# SDPA, ours the explicit softmax (the rule both twins share: dense on a CPU below 1024 keys), and
# stock's own fused fast path (eval + no_grad) other kernels again: two kernels differ by up to
# 1.2e-6 on these cases (3-layer encoders with gelu, measured; stock's fast path against its eager
# path 1.05e-6), so the suite's float32 forward tolerance applies (test_mismatch_is_detected: a
# wrong twin lands above 10 * TOL)
TOL = 2e-6
FAST_TOL = TOL


def stock_layer(norm_first: bool, activation: str = "relu", bias: bool = True, eps: float = 1e-5, seed: int = 0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(
        E, H, FF, dropout=0.0, activation=activation, layer_norm_eps=eps,
        batch_first=True, norm_first=norm_first, bias=bias,
    )
    _perturb(layer, seed)
    return layer


def _perturb(module: nn.Module, seed: int) -> None:
    """Move every parameter off its default (LayerNorm 1/0, zero biases) so that swapped or
    dropped parameters show up in the outputs."""
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))


def cfg_for(norm_first: bool, activation: str = "relu", bias: bool = True, **kw) -> BlockConfig:
    return BlockConfig(d_model=E, num_heads=H, d_ff=FF, dropout=0.0, activation=activation,
                       norm="pre" if norm_first else "post", bias=bias, **kw)


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, E, generator=g)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[0, 5:] = True  # batch 0: last two tokens are padding
    kpm[2, 3:] = True
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = may NOT attend
    return x, kpm, causal


MASKS = ["none", "padding", "causal", "both"]


def mask_kwargs(kind: str, kpm, causal, names=("src_mask", "src_key_padding_mask")):
    return {
        "none": {},
        "padding": {names[1]: kpm},
        "causal": {names[0]: causal},
        "both": {names[0]: causal, names[1]: kpm},
    }[kind]


@contextlib.contextmanager
def fast_path_calls():
    """Record calls of torch's fused encoder-layer kernel (the stock eval + no_grad fast path)."""
    calls: list[int] = []
    original = torch._transformer_encoder_layer_fwd

    def wrapped(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    torch._transformer_encoder_layer_fwd = wrapped
    try:
        yield calls
    finally:
        torch._transformer_encoder_layer_fwd = original


def compare(stock, ours, x, kw, kpm, mode):
    """Max abs difference between the stock and our module relative to the stock output's
    largest magnitude, on the non-padded positions.
    mode: "train" (dropout 0), "eval_grad" (eval, autograd on) or "fastpath" (eval + no_grad)."""
    for m in (stock, ours):
        m.train(mode == "train")
    ctx = torch.no_grad() if mode == "fastpath" else contextlib.nullcontext()
    with ctx:
        with fast_path_calls() as calls:
            want = stock(x, **kw)
        got = ours(x, **kw)
    # the stock fused kernel runs exactly when expected (it needs biases)
    layer = stock.layers[0] if isinstance(stock, nn.TransformerEncoder) else stock
    assert bool(calls) == (mode == "fastpath" and layer.self_attn.in_proj_bias is not None)
    assert got.shape == want.shape == x.shape and got.dtype == torch.float32
    keep = ~kpm if any("padding" in k for k in kw) else torch.ones(x.shape[:2], dtype=torch.bool)
    assert torch.isfinite(got).all()
    return ((got - want)[keep].abs().max() / want[keep].abs().max()).item()


def test_state_dict_keys_are_the_stock_keys():
    for norm_first in (False, True):
        for bias in (True, False):
            stock = stock_layer(norm_first, bias=bias)
            ours = tb.TransformerBlock(cfg_for(norm_first, bias=bias))
            assert list(ours.state_dict()) == list(stock.state_dict())
            for k, v in stock.state_dict().items():
                assert ours.state_dict()[k].shape == v.shape, k


@pytest.mark.parametrize("mode", ["train", "eval_grad", "fastpath"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("norm_first,activation,bias", [
    (False, "relu", True), (True, "relu", True), (False, "gelu", True), (True, "gelu", True),
    (False, "relu", False), (True, "gelu", False),
])
def test_stock_encoder_layer_loads_and_matches(norm_first, activation, bias, mask, mode):
    stock = stock_layer(norm_first, activation, bias)
    ours = tb.TransformerBlock(cfg_for(norm_first, activation, bias))
    ours.load_state_dict(stock.state_dict(), strict=True)
    x, kpm, causal = inputs()
    assert compare(stock, ours, x, mask_kwargs(mask, kpm, causal), kpm, mode) <= (
        FAST_TOL if mode == "fastpath" else TOL)


@pytest.mark.parametrize("mode", ["train", "fastpath"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("norm_first,activation,final_norm", [
    (True, "relu", True), (True, "gelu", False), (False, "relu", False), (False, "gelu", True),
])
def test_stock_encoder_loads_and_matches(norm_first, activation, final_norm, mask, mode):
    layer = stock_layer(norm_first, activation)
    stock = nn.TransformerEncoder(layer, num_layers=3, norm=nn.LayerNorm(E) if final_norm else None,
                                  enable_nested_tensor=False)
    _perturb(stock, seed=7)  # the stock layers are deep copies: make them differ, so a layer mix-up shows
    ours = tb.Encoder(cfg_for(norm_first, activation), num_layers=3, final_norm=final_norm)
    assert list(ours.state_dict()) == list(stock.state_dict())
    ours.load_state_dict(stock.state_dict(), strict=True)
    x, kpm, causal = inputs(1)
    kw = mask_kwargs(mask, kpm, causal, names=("mask", "src_key_padding_mask"))
    assert compare(stock, ours, x, kw, kpm, mode) <= (FAST_TOL if mode == "fastpath" else TOL)


def test_gradients_match_stock():
    stock = stock_layer(False, "gelu")
    ours = tb.TransformerBlock(cfg_for(False, "gelu"))
    ours.load_state_dict(stock.state_dict(), strict=True)
    x, kpm, causal = inputs()
    r = torch.randn(B, T, E, generator=torch.Generator().manual_seed(3))  # random cotangent
    for m in (stock, ours):
        (m(x, src_mask=causal, src_key_padding_mask=kpm) * r * (~kpm)[..., None]).sum().backward()
    for (name, p), q in zip(stock.named_parameters(), ours.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * max(1.0, p.grad.abs().max().item()), name


def test_unbatched_input_matches_stock():
    stock = stock_layer(True, "gelu")
    ours = tb.TransformerBlock(cfg_for(True, "gelu"))
    ours.load_state_dict(stock.state_dict(), strict=True)
    x, _, causal = inputs()
    assert (stock(x[1], src_mask=causal) - ours(x[1], src_mask=causal)).abs().max() <= TOL


def test_default_config_is_the_default_stock_layer():
    stock = nn.TransformerEncoderLayer(64, 4, batch_first=True)
    cfg = BlockConfig(d_model=64, num_heads=4)
    ours = tb.TransformerBlock(cfg)
    ours.load_state_dict(stock.state_dict(), strict=True)
    assert stock.linear1.out_features == cfg.d_ff and stock.dropout.p == cfg.dropout
    assert stock.norm1.eps == cfg.layer_norm_eps and stock.norm_first is (cfg.norm == "pre")
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    stock.eval(), ours.eval()
    assert (stock(x) - ours(x)).abs().max() <= TOL


# ------------------------------------------------------------------------------------
# Negative tests: the comparison above does catch the classic mismatches (above 10 * TOL)
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mismatch", ["eps", "gelu_tanh", "norm_first", "layer_order"])
def test_mismatch_is_detected(mismatch):
    norm_first, act, eps = False, "gelu", 1e-5
    stock = stock_layer(norm_first, act, eps=1e-6 if mismatch == "eps" else eps)
    cfg = cfg_for(norm_first if mismatch != "norm_first" else not norm_first,
                  "gelu_tanh" if mismatch == "gelu_tanh" else act)
    x, kpm, causal = inputs()
    x = x * 0.05  # small activations, so that the LayerNorm eps matters
    if mismatch == "layer_order":
        stock = nn.TransformerEncoder(stock, num_layers=2, enable_nested_tensor=False)
        _perturb(stock, seed=9)
        ours = tb.Encoder(cfg, num_layers=2)
        sd = stock.state_dict()
        swapped = {k.replace("layers.0.", "layers.X.").replace("layers.1.", "layers.0.")
                   .replace("layers.X.", "layers.1."): v
                   for k, v in sd.items()}
        ours.load_state_dict(swapped, strict=True)
    else:
        ours = tb.TransformerBlock(cfg)
        ours.load_state_dict(stock.state_dict(), strict=True)
    assert compare(stock, ours, x, {}, kpm, "train") > 10 * TOL
