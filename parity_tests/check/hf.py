"""A Hugging Face folder checked by `python -m parity_tests.check FOLDER`: the Flax stack
`fb.from_hf` reads from it against the HF model rebuilt from it (parity_tests.hf.reference
feeds both the same hidden states, HF's embeddings out of the way)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..hf.reference import flax_runs, hf_run, load_hf, rel_at
from .report import CheckReport


def check_hf(folder: str, *, num_heads: int | None = None, dtype: str = "float32", batch: int = 2, seq: int = 8,
             seed: int = 0, pad_keys: int | None = None):
    """The Flax stack read from an HF folder against the HF model rebuilt from it (its own
    config.json and weights). num_heads overrides the config's (to see a wrong one fail).
    Returns a CheckReport with one row, the stack's output."""
    from ..twins.harness import precision

    with precision(dtype):  # float64 on in JAX for this check only
        return _check_hf(folder, num_heads, dtype, batch, seq, seed, pad_keys)


def _check_hf(folder, num_heads, dtype, batch, seq, seed, pad_keys):
    import flax_blocks as fb
    from flax_blocks.checkpoints.checkpoint import hf_config, hf_state_dict

    from ..twins.harness import TOL

    config, model = load_hf(folder, dtype)
    dialect, cfg, num_layers, final_norm = hf_config(config, dtype=dtype)
    if num_heads is None or num_heads == cfg.num_heads:  # the user's own path: the folder through from_hf
        flax, loaded = fb.from_hf(folder, dtype=dtype), "fb.from_hf(folder)"
    else:  # a deliberately different head count, to see the check fail: the weights with the flags' config
        kv = None if cfg.num_kv_heads is None else min(cfg.num_kv_heads, num_heads)
        cfg = replace(cfg, num_heads=num_heads, num_kv_heads=kv)
        flax = fb.from_torch(fb.Encoder, cfg, hf_state_dict(model), dialect=dialect, num_layers=num_layers,
                             final_norm=final_norm, dtype=dtype)
        loaded = f"fb.from_torch with num_heads={num_heads}"
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, seq, cfg.d_model)).astype(dtype)
    keys = np.ones((batch, seq), bool)
    keys[-1, seq - (seq // 2 if pad_keys is None else pad_keys):] = False
    ct = (rng.normal(size=x.shape) * keys[..., None]).astype(dtype)  # real query positions only
    yf, gf = flax_runs(flax, x, ct, keys, (True,))[True]
    yh, gh = hf_run(model, x, ct, keys)
    report = CheckReport(f"Encoder ({config.get('model_type')}, dialect {dialect}, loaded with {loaded})", dtype,
                         reference=f"the Hugging Face {type(model).__name__} rebuilt from {folder}")
    fwd, grad = rel_at(yf, yh, keys), rel_at(gf, gh, keys)
    report.rows.append(("output", float(np.abs(yf - yh)[keys].max()), fwd, grad))
    if not fwd <= TOL["forward", dtype]:
        report.failures.append(f"output: forward rel error {fwd:.2e} > {TOL['forward', dtype]:.0e}")
    if not grad <= TOL["grad", dtype]:
        report.failures.append(f"output: gradient rel error {grad:.2e} > {TOL['grad', dtype]:.0e}")
    return report
