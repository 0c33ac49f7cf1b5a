"""Dropout placement against stock torch: in train mode at p = 0.3, each twin's output
distribution must match stock nn.TransformerEncoderLayer / nn.TransformerEncoder /
nn.TransformerDecoderLayer with the same weights (random streams differ, so statistics are compared, not samples).

One call on a batch of N copies of one sequence gives N independent dropout draws (masks
are elementwise). Compared per output position: the mean (its offset from the eval output
shows where dropout sits relative to the nonlinearities: norms, softmax, relu) and the
standard deviation; and, with every dropout but the attention weights' off, the same again,
so dropout on the attention weights is tested on its own.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

import flax_blocks as fb
import torch_blocks as tb

P, N = 0.3, 8000
E, H, FF, T = 8, 2, 16, 4


def _perturb(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))


def _stock(kind: str, norm_first: bool) -> nn.Module:
    torch.manual_seed(0)
    if kind == "DecoderBlock":
        layer = nn.TransformerDecoderLayer(E, H, FF, P, "relu", batch_first=True, norm_first=norm_first)
        _perturb(layer, 1)
        return layer
    layer = nn.TransformerEncoderLayer(E, H, FF, P, "relu", batch_first=True, norm_first=norm_first)
    if kind == "Encoder":
        layer = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E) if norm_first else None,
                                      enable_nested_tensor=False)
    _perturb(layer, 1)  # after the deep copy: the Encoder's layers differ
    return layer


ATTENTIONS = ("self_attn", "multihead_attn")  # the attention modules, by torch's names


def only_attention_dropout_torch(module: nn.Module) -> None:
    """Every dropout off except those on the attention weights (inside the attentions)."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Dropout) and not set(name.split(".")) & set(ATTENTIONS):
            sub.p = 0.0


def only_attention_dropout_flax(module) -> None:
    for path, sub in nnx.iter_graph(module):
        if isinstance(sub, nnx.Dropout) and not set(map(str, path)) & set(ATTENTIONS):
            sub.rate = 0.0


def _stats(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return y.mean(0), y.std(0)


def _samples(kind: str, norm_first: bool, attention_only: bool):
    """(eval output (T, E), {side: samples (N, T, E)}) for stock, torch twin, flax twin."""
    stock = _stock(kind, norm_first)
    cfg = fb.BlockConfig(d_model=E, num_heads=H, d_ff=FF, dropout=P, activation="relu",
                         norm="pre" if norm_first else "post")
    kw = {"num_layers": 2} if kind == "Encoder" else {}
    twin = getattr(tb, kind)(cfg, **kw)
    twin.load_state_dict(stock.state_dict(), strict=True)
    flax = fb.from_torch(getattr(fb, kind), cfg, stock, seed=3, **kw)
    if attention_only:
        only_attention_dropout_torch(stock)
        only_attention_dropout_torch(twin)
        only_attention_dropout_flax(flax)
    x1 = np.random.default_rng(0).normal(size=(1, T, E)).astype(np.float32)
    pad = np.zeros((1, T), bool)
    pad[0, -1] = True  # torch convention: the last key is padding
    x, pad_n = np.repeat(x1, N, 0), np.repeat(pad, N, 0)
    if kind == "DecoderBlock":  # a memory of S = T + 1 whose first key is padding
        m1 = np.random.default_rng(1).normal(size=(1, T + 1, E)).astype(np.float32)
        mpad = np.zeros((1, T + 1), bool)
        mpad[0, 0] = True
        mem, mpad_n = np.repeat(m1, N, 0), np.repeat(mpad, N, 0)

    def run_torch(module, stock_names, x, pad, mem=None, mpad=None):
        x, pad = torch.from_numpy(x), torch.from_numpy(pad)
        if kind != "DecoderBlock":
            return module(x, src_key_padding_mask=pad) if stock_names else module(x, None, pad)
        mem, mpad = torch.from_numpy(mem), torch.from_numpy(mpad)
        if stock_names:
            return module(x, mem, tgt_key_padding_mask=pad, memory_key_padding_mask=mpad)
        return module(x, mem, None, None, pad, mpad)

    dec = kind == "DecoderBlock"
    torch.manual_seed(5)
    with torch.no_grad():
        stock.eval()
        want_eval = run_torch(stock, True, x1, pad, *((m1, mpad) if dec else ())).numpy()[0]
        stock.train()
        s = run_torch(stock, True, x, pad_n, *((mem, mpad_n) if dec else ())).numpy()
        t = run_torch(twin.train(), False, x, pad_n, *((mem, mpad_n) if dec else ())).numpy()
    if dec:
        call = nnx.jit(lambda m, x, k, mem, mk: m(x, mem, key_mask=k, memory_key_mask=mk))
        f = call(flax, jnp.asarray(x), jnp.asarray(~pad_n), jnp.asarray(mem), jnp.asarray(~mpad_n))
    else:
        f = nnx.jit(lambda m, x, k: m(x, key_mask=k))(flax, jnp.asarray(x), jnp.asarray(~pad_n))
    return want_eval, {"stock": s, "torch twin": t, "flax twin": np.asarray(f)}


def assert_same_distribution(samples: dict[str, np.ndarray], what: str) -> None:
    m_s, sd_s = _stats(samples["stock"])
    for side in ("torch twin", "flax twin"):
        m, sd = _stats(samples[side])
        se = np.sqrt(sd**2 + sd_s**2) / np.sqrt(N)
        worst = float((np.abs(m - m_s) / (se + 1e-7)).max())
        assert worst < 5, f"{what}: {side} mean differs from stock by {worst:.1f} standard errors"
        ratio = sd / np.maximum(sd_s, 1e-7)
        assert np.abs(ratio - 1).max() < 0.1, (f"{what}: {side} std / stock std in "
                                               f"[{ratio.min():.3f}, {ratio.max():.3f}]")


@pytest.mark.parametrize("kind,norm_first", [("TransformerBlock", True), ("TransformerBlock", False), ("Encoder", True),
                                             ("DecoderBlock", False)])
def test_dropout_statistics_match_stock(kind, norm_first):
    want_eval, samples = _samples(kind, norm_first, attention_only=False)
    assert_same_distribution(samples, f"{kind} norm_first={norm_first}, p={P} everywhere")
    m_s, sd_s = _stats(samples["stock"])
    assert sd_s.min() > 0.05  # dropout does act on every position
    assert np.abs(m_s - want_eval).max() > 10 * (sd_s / np.sqrt(N)).max()  # the mean is biased by the nonlinearities


@pytest.mark.parametrize("kind", ["TransformerBlock", "DecoderBlock"])
def test_attention_weight_dropout_matches_stock(kind):
    want_eval, samples = _samples(kind, True, attention_only=True)
    assert_same_distribution(samples, f"{kind}, p={P} on the attention weights only")
    m_s, sd_s = _stats(samples["stock"])
    assert sd_s.min() > 0.01  # the attention weights' dropout alone moves every output
