"""torch's own fast path (stock TransformerEncoderLayer / TransformerEncoder in eval mode
under no_grad runs fused kernels) against flax_blocks with the same weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_blocks as fb
from flax_blocks.core.config import invert_mask

from .harness import precision, rel_err


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_stock_fast_path_matches_flax(norm_first, activation):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(12, 2, 20, dropout=0.0, activation=activation, batch_first=True,
                                             norm_first=norm_first)
    stock = torch.nn.TransformerEncoder(layer, 3, norm=torch.nn.LayerNorm(12) if norm_first else None,
                                        enable_nested_tensor=False).eval()
    with torch.no_grad():
        for p in stock.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    cfg = fb.BlockConfig(d_model=12, num_heads=2, d_ff=20, dropout=0.0, activation=activation,
                         norm="pre" if norm_first else "post")
    keys = np.ones((2, 6), bool)
    keys[1, 4:] = False
    x = np.random.default_rng(0).normal(size=(2, 6, 12)).astype(np.float32)
    with precision("float32"):
        enc = fb.from_torch(fb.Encoder, cfg, stock, num_layers=3)
        y = np.asarray(enc(jnp.asarray(x), key_mask=jnp.asarray(keys)))
        with torch.no_grad():
            fast = stock(torch.from_numpy(x), src_key_padding_mask=invert_mask(torch.from_numpy(keys))).numpy()
        stock.train()
        slow = stock(torch.from_numpy(x), src_key_padding_mask=invert_mask(torch.from_numpy(keys))).detach().numpy()
    # the fast path zeroes padded positions (nested tensors are off, but compare real tokens only)
    assert rel_err(y[keys], fast[keys]) <= 2e-6
    assert rel_err(y[keys], slow[keys]) <= 2e-6
