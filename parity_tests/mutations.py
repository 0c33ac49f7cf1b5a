"""Deliberately wrong Flax twins: the classic porting mistakes that parity checks must catch.

Each entry: (case the mistake shows in, Flax config override or None, mutation or None).
A mutation takes (case, flax module, inputs) and returns the wrong (module, inputs).
"""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import numpy as np

import flax_blocks as fb

from .harness import Case, Inputs

BASE = fb.BlockConfig(d_model=12, num_heads=2, d_ff=20, dropout=0.0, norm="post", activation="gelu")


def invert_flax_mask(case: Case, module, inp: Inputs):
    """Hand torch's convention (True = may NOT attend) to Flax unconverted."""
    return module, replace(inp, attention_mask=~inp.attention_mask)


def swap_q_and_k(case: Case, module, inp: Inputs):
    attn = module.layers.self_attn if case.kind == "Encoder" else module.self_attn
    k = attn.in_kernel[...]
    attn.in_kernel.set_value(k[..., [1, 0, 2], :, :])
    return module, inp


def transpose_out_projection(case: Case, module, inp: Inputs):
    attn = module.self_attn
    h, d, e = attn.out_kernel[...].shape
    attn.out_kernel.set_value(attn.out_kernel[...].reshape(h * d, e).T.reshape(h, d, e))
    return module, inp


def layers_off_by_one(case: Case, module, inp: Inputs):
    from flax import nnx

    state = nnx.state(module.layers, nnx.Param)
    nnx.update(module.layers, __import__("jax").tree.map(lambda a: jnp.roll(a, 1, axis=0), state))
    return module, inp


BLOCK = Case("TransformerBlock", BASE)
MUTATIONS = {
    "layer_norm_eps_1e-6": (BLOCK, replace(BASE, layer_norm_eps=1e-6), None),
    "tanh_gelu_for_exact": (BLOCK, replace(BASE, activation="gelu_tanh"), None),
    "inverted_mask": (replace(BLOCK, attention_mask=True), None, invert_flax_mask),
    "swapped_q_and_k": (BLOCK, None, swap_q_and_k),
    "transposed_out_projection": (BLOCK, None, transpose_out_projection),
    "layers_off_by_one": (Case("Encoder", BASE, num_layers=3), None, layers_off_by_one),
}
