"""Dropout: random streams differ between frameworks, so compare statistics.

FeedForward with relu, no LayerNorm, no skip, no bias: y = W2 D(relu(W1 x)) with a second
dropout after W2. Both dropouts are independent and linear after relu, so E[y_train] equals
the eval output; keep rate and 1/(1-p) scaling show in the fraction and size of zeros.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_blocks as fb
import torch_blocks as tb

CFG = fb.BlockConfig(d_model=8, num_heads=2, d_ff=16, dropout=0.3, activation="relu", norm="none",
                     residual="none", bias=False)
N = 4000


def _samples():
    t = tb.FeedForward(CFG, generator=torch.Generator().manual_seed(0))
    f = fb.from_torch(fb.FeedForward, CFG, t, seed=1)  # dropout keys materialised from the seed
    x = np.abs(np.random.default_rng(0).normal(size=(1, 4, 8))).astype(np.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        t.train()
        ts = torch.stack([t(torch.from_numpy(x)) for _ in range(N)]).numpy()
        t.eval()
        t_eval = t(torch.from_numpy(x)).numpy()
    # the module's own call and its own RNG stream; cached_partial skips re-walking the
    # module's graph at each of the N calls (the same samples, bit for bit, in a quarter of the time)
    call = nnx.cached_partial(nnx.jit(lambda m, x: m(x)), f)
    xj = jnp.asarray(x)
    fs = np.stack([np.asarray(call(xj)) for _ in range(N)])
    f.eval()
    f_eval = np.asarray(f(jnp.asarray(x)))
    return ts, t_eval, fs, f_eval


def test_dropout_statistics_match():
    ts, t_eval, fs, f_eval = _samples()
    np.testing.assert_allclose(f_eval, t_eval, rtol=1e-5, atol=1e-6)  # eval: dropout off, same function
    se = ts.std(0) / np.sqrt(N)
    for s in (ts, fs):
        assert np.all(np.abs(s.mean(0) - t_eval) < 5 * se + 1e-6)  # mean preserved (inverted scaling)
        zero = (s == 0).mean()
        assert abs(zero - 0.3) < 0.02  # the output dropout's drop rate
        # the output dropout's mask is independent of the inner one, so given that an entry
        # is kept, its mean is the eval output scaled by 1 / (1 - p): the inverted scale
        kept = np.where(s != 0, s, np.nan)
        kept_mean, n_kept = np.nanmean(kept, 0), (s != 0).sum(0)
        kept_se = np.nanstd(kept, 0) / np.sqrt(n_kept)
        assert np.all(np.abs(kept_mean - t_eval / 0.7) < 5 * kept_se + 1e-6)
        scale = float((kept_mean * t_eval).sum() / (t_eval**2).sum())  # least-squares fit of the scale
        assert abs(scale - 1 / 0.7) < 0.03, scale  # 1 (no rescaling) or 0.7 would fail
    np.testing.assert_allclose(fs.std(0), ts.std(0), rtol=0.1)  # same spread
    assert not np.allclose(fs[0], fs[1])  # samples do differ


def test_module_dropout_is_random_in_train_and_off_in_eval():
    f = fb.FeedForward(CFG, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 4, 8))
    assert not np.allclose(f(x), f(x))
    f.eval()
    np.testing.assert_array_equal(f(x), f(x))
