"""Gradient norms at initialisation in Xiong et al. 2020's own setting, beside the lab's.

    python -m experiments.init_study --out experiments/init_study/results   # the committed study (minutes)
    python -m experiments.init_study --quick                                # tiny sizes -> runs/quick
    python -m experiments.init_study.report experiments/init_study/results  # re-render the report

Xiong, Yang, He, Zheng, Zheng, Xing, Zhang, Lan, Wang, Liu 2020, "On Layer Normalization in
the Transformer Architecture" (ICML), claim at initialisation:
  Fig. 3: post-LN's gradient norm of each layer's FFN W2 grows toward the output layer;
    pre-LN's is level across layers (a 6 + 6 layer encoder-decoder, d_model 512, translation).
  Theorem 1: the last layer's FFN W2 gradient is O(d sqrt(ln d)) for post-LN, flat in the
    depth L, and O(d sqrt(ln d / L)) for pre-LN, i.e. ~ L^-1/2.
The lab (experiments.stability) measures a different setting, a d_model 32 decoder-only LM on
a Markov chain, where Fig. 3 did not reproduce. This study measures both settings, same
depths, same draws, same statistics:

  setting "xiong": `flax_blocks.blocks.Transformer` (encoder-decoder), L + L layers, d_model
    512, d_ff 2048, 8 heads, ReLU, LayerNorm eps 1e-5, no dropout, fairseq's initialisation:
      token embedding E (V, d) ~ N(0, d^-1/2), used as sqrt(d) * E[token]  (entries ~ N(0, 1)),
        plus fairseq's sinusoidal positions (sin half, cos half; position t + 2 for token t,
        as fairseq counts from padding_idx + 1 = 2); one E shared by source, target and the
        output projection (fairseq's --share-all-embeddings): logits = y E^T;
      every block matrix xavier-uniform, zero biases (`BlockConfig(init="xavier")`, which
        covers q/k/v, out, W1, W2 of every self- and cross-attention and FFN; LayerNorms 1, 0),
        with q, k, v then multiplied by 1/sqrt(2): fairseq draws them xavier-uniform over the
        packed (3d, d) in_proj matrix, U(+-sqrt(6 / 4d)), which is the per-part xavier bound
        sqrt(6 / 2d) times 1/sqrt(2) (later fairseq versions draw separate q/k/v with gain
        1/sqrt(2): the same law); the output projection of attention keeps gain 1;
      post-LN stacks without final norms, pre-LN stacks with one each (as fairseq's
        encoder/decoder_normalize_before);
    task: source = `seq_len` tokens uniform over 1..V-1; target = a fixed permutation of the
      vocabulary applied to the reversed source; the decoder reads [0, target[:-1]] (0 is the
      start token, as fairseq's EOS) with teacher forcing; loss = mean cross-entropy over the
      B * T target tokens. No padding.
  setting "lab": the library's LanguageModel via experiments.stability.model.create_params (the lab's
    init: xavier blocks, embeddings and learned positions N(0, 1/2) each, xavier head), causal, on the lab's
    Markov task (experiments.stability.tasks), the `depth` preset's size; mean cross-entropy.

For each (setting, variant in post/pre, depth L) one jitted function maps a key to one draw's
measurements; draw i uses key(seed) (PRNG_IMPL) folded with i, split into an init key and a
batch key: a fresh init AND a fresh batch per draw (draw i's batch is the same across variants
and depths). `draws` per cell; Xiong's setting runs `deep_draws` from `deep_from` layers on,
where a draw costs most. Per draw and per stack (xiong: encoder "enc" and
decoder "dec", each L layers; lab: the causal stack "lm"):
  {stack}_w2      (L,)  ||dLoss/dW2_l||_F, W2 = the layer's linear2.kernel (d_ff, d_model)
                        (declarations: the MLP's "down" linear; torch's linear2.weight)
  {stack}_layer   (L,)  the gradient norm over all of layer l's parameters
  {stack}_ratio   (L, S) ||F_s(x)|| / ||x|| for each sublayer s of layer l: F_s the
                        sublayer's output (the residual branch, before the add), x the
                        residual stream entering the sublayer; norms are RMS over the
                        batch's tokens (sqrt(mean_t ||.||^2)). S = 2 (self-attention, FFN) or
                        3 (self-attention, cross-attention, FFN)
  {stack}_stream  (L+1,) ||x_l||^2 / d, mean over tokens, of the stream entering layer l + 1
                        (l = 0: the embedded input) and leaving the last layer (before a
                        final norm)
  {stack}_gstream (L+1,) ||dLoss/dx_l|| (Frobenius over the batch) for the same streams: how the
                        gradient of the residual stream changes from layer to layer
  {stack}_gsub    (L, S, 2) ||dLoss/d.|| around each sublayer s of layer l: at z_s = x_s +
                        F_s(x_s) and at the stream leaving it (post-LN: Norm(z_s); pre-LN: z_s);
                        at the stream x_s entering it: the previous sublayer's second entry (s
                        > 0) or gstream[l]. gz / gout is the norm's backward factor, gin / gz
                        the residual branch's, (I + dF/dx)^T
  {stack}_recon   ()    self-check: max |y - y'| / rms(y) between each block's own output
                        and the output rebuilt from the measured sublayer branches
  x0_token_ms, x0_pos_ms, x0_ms  the embedding scale: mean over coordinates and tokens of the
                        token part^2, the position part^2 and (token + position)^2 of the
                        first stack's input
  check           ()    self-check: max |.| / rms of the final hidden states of the rerun minus
                        the library's own forward's (Transformer / LanguageModel.hidden)
  loss            ()    the loss at initialisation
The gradients come from one backward pass of the loss through a layer-by-layer rerun of the
model (`stack_diagnostics`: a lax.scan over each stack's stacked layers calling every block's
own `run`, with a tap on each sublayer's branch and a zero probe added to the stream
at every layer boundary, whose gradient is the stream's); "check" shows the rerun is the
library's forward, and tests/test_init_study.py that its W2 gradients are jax.grad's through
the library's forward.

Cells: OUT/cells/<setting>_<variant>_L<depth>-<hash>.json, one per (setting, variant,
depth), holding every draw; OUT/init.json describes the study. A rerun skips cells on disk
(an interrupted study resumes). The report (report.py) reads only those files. OUT is --out, else
runs/study (runs/quick with --quick) beside this file, which git ignores.
"""

from __future__ import annotations

import time

_START = time.time()

import argparse
import hashlib
import itertools
import json
import math
import shlex
import sys
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.stability.model import ModelConfig, create_params
from experiments.stability.presets import PRESETS
from experiments.stability.sweep import environment, load_average, read_cell, write_cell
from experiments.stability.tasks import markov_task
from experiments.stability.train import compile_lowered, compiler_options, tree_sq
from flax_blocks import BlockConfig
from flax_blocks.attention import build_mask, self_attention_masks
from flax_blocks.core import declarations
from flax_blocks.core.context import Context
from flax_blocks.stacks import Transformer

from . import report as init_report

RUNS = Path(__file__).resolve().parent / "runs"  # where the study writes without --out (untracked)
CELL_VERSION = 5  # bump when a code change alters results, so old cells are not reused
VARIANTS = ("post", "pre")
SETTINGS = ("lab", "xiong")  # run order: the lab's small programs first

# ------------------------------------------------------------------------------------
# The two settings
# ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class XiongSetup:
    """Xiong et al.'s Fig. 3 model (Transformer base, fairseq) on a synthetic translation task."""

    d_model: int = 512
    num_heads: int = 8
    d_ff: int = 2048
    vocab: int = 128  # token 0 = start token; sources over 1..vocab-1
    seq_len: int = 16  # source length = target length
    batch: int = 4
    embed_scale: bool = True  # fairseq: token embeddings times sqrt(d_model) (False: a deliberate mistake, for tests)
    qkv_gain: float = 2 ** -0.5  # fairseq's q/k/v law relative to per-part xavier (see the module notes)
    task_seed: int = 0  # the permutation of the vocabulary


_DEPTH = PRESETS["depth"]


@dataclass(frozen=True)
class LabSetup:
    """The lab's LM (experiments.stability.model) at the `depth` preset's size, on its Markov task."""

    d_model: int = _DEPTH.d_model
    num_heads: int = _DEPTH.num_heads
    d_ff: int = _DEPTH.d_ff
    vocab: int = _DEPTH.vocab
    seq_len: int = _DEPTH.seq_len
    batch: int = _DEPTH.batch
    task_seed: int = _DEPTH.task_seed


def sinusoidal_positions(num: int, dim: int, offset: int = 2) -> np.ndarray:
    """fairseq's SinusoidalPositionalEmbedding rows offset .. offset + num - 1: (num, dim),
    [sin(p w_i) for i < dim/2, cos(p w_i) for i < dim/2], w_i = 10000^(-i / (dim/2 - 1)).
    Every row has mean square 1/2 (an odd dim gets a zero last column, as fairseq's)."""
    half = dim // 2
    w = np.exp(np.arange(half, dtype=np.float64) * -(math.log(10000.0) / max(half - 1, 1)))
    p = np.arange(offset, offset + num, dtype=np.float64)[:, None] * w[None]
    table = np.concatenate([np.sin(p), np.cos(p)], axis=1)
    if dim % 2:
        table = np.concatenate([table, np.zeros((num, 1))], axis=1)
    return table.astype(np.float32)


class Seq2Seq(nnx.Module):
    """fairseq-style encoder-decoder around `flax_blocks.blocks.Transformer`.

    src (B, S), tgt_in (B, T) int32 -> logits (B, T, V) = Transformer(x_src, x_tgt) E^T with
    x = sqrt(d) E[tokens] + positions. Params: embed (V, d), transformer (encoder, decoder).
    """

    def __init__(self, setup: XiongSetup, variant: str, depth: int, *, rngs: nnx.Rngs):
        self.spec = setup
        d = setup.d_model
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (setup.vocab, d)) * d ** -0.5)
        cfg = BlockConfig(d_model=d, num_heads=setup.num_heads, d_ff=setup.d_ff, dropout=0.0, activation="relu",
                          norm=variant, layer_norm_eps=1e-5, causal=True, init="xavier")
        # the encoder is made non-causal by Transformer; final norms only where fairseq has them
        self.transformer = Transformer(cfg, num_encoder_layers=depth, num_decoder_layers=depth,
                                       final_norm=variant == "pre", rngs=rngs)
        for attn in (self.transformer.encoder.layers.self_attn, self.transformer.decoder.layers.self_attn,
                     self.transformer.decoder.layers.multihead_attn):
            attn.in_kernel[...] = attn.in_kernel[...] * setup.qkv_gain

    def embed_parts(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens (B, T) -> (token part (B, T, d), position part (T, d))."""
        scale = math.sqrt(self.spec.d_model) if self.spec.embed_scale else 1.0
        pos = jnp.asarray(sinusoidal_positions(tokens.shape[-1], self.spec.d_model))
        return scale * self.embed[...][tokens], pos

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        tok, pos = self.embed_parts(tokens)
        return tok + pos

    def __call__(self, src: jax.Array, tgt_in: jax.Array) -> jax.Array:
        y = self.transformer(self.embed_tokens(src), self.embed_tokens(tgt_in))  # (B, T, d)
        return jnp.einsum("btd,vd->btv", y, self.embed[...])


def _mean_ce(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy over every target: logits (B, T, V), targets (B, T) -> ()."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


class XiongSetting:
    """Build, batch, forward and measured rerun of the encoder-decoder setting."""

    name = "xiong"
    stacks = ("enc", "dec")

    def __init__(self, setup: XiongSetup):
        self.setup = setup
        rng = np.random.default_rng(setup.task_seed)
        self.perm = np.concatenate([[0], 1 + rng.permutation(setup.vocab - 1)]).astype(np.int32)

    def create(self, variant: str, depth: int, key: jax.Array):
        return nnx.split(Seq2Seq(self.setup, variant, depth, rngs=nnx.Rngs(params=key)), nnx.Param, ...)

    def batch(self, key: jax.Array) -> dict[str, jax.Array]:
        """{"src" (B, S), "tgt_in" (B, T), "tgt" (B, T)}: tgt = perm[reversed src]."""
        s = self.setup
        src = jax.random.randint(key, (s.batch, s.seq_len), 1, s.vocab, dtype=jnp.int32)
        tgt = jnp.asarray(self.perm)[src[:, ::-1]]
        tgt_in = jnp.concatenate([jnp.zeros((s.batch, 1), jnp.int32), tgt[:, :-1]], axis=1)
        return {"src": src, "tgt_in": tgt_in, "tgt": tgt}

    def probe_shapes(self, variant: str, depth: int) -> dict[str, dict[str, tuple[int, ...]]]:
        s = self.setup
        x = (s.batch, s.seq_len, s.d_model)
        subs = {"enc": len(declarations.BLOCKS["TransformerBlock"]), "dec": len(declarations.BLOCKS["DecoderBlock"])}
        return {k: {"layer": (depth + 1, *x), "z": (depth, n, *x), "n": (depth, n, *x)} for k, n in subs.items()}

    def forward(self, params, graphdef, rest, batch) -> jax.Array:
        """The decoder's output (B, T, d) as the library computes it (Transformer.__call__)."""
        model = nnx.merge(graphdef, params, rest)
        return model.transformer(model.embed_tokens(batch["src"]), model.embed_tokens(batch["tgt_in"]))

    def rerun(self, params, probes, graphdef, rest, batch) -> tuple[jax.Array, dict]:
        """The loss through a layer-by-layer rerun of the model (`stack_diagnostics`) with zero
        probes on the streams: (mean CE, {"enc", "dec": diagnostics, "y": decoder output,
        "x0": embedding stats})."""
        model = nnx.merge(graphdef, params, rest)
        enc, dec = model.transformer.encoder, model.transformer.decoder
        tok, pos = model.embed_parts(batch["src"])
        x_src, x_tgt = tok + pos, model.embed_tokens(batch["tgt_in"])
        b, s, t = x_src.shape[0], x_src.shape[1], x_tgt.shape[1]
        enc_masks = self_attention_masks(enc.cfg, "dense", b, s, None, None)
        dec_masks = self_attention_masks(dec.cfg, "dense", b, t, None, None)
        dec_masks["cross"] = build_mask(dec.cfg, b, t, None, None, keys=s, causal=False)
        enc_d = stack_diagnostics(enc, x_src, enc_masks, probes=probes["enc"])
        dec_d = stack_diagnostics(dec, x_tgt, dec_masks, memory=enc_d.pop("output"), probes=probes["dec"])
        y = dec_d.pop("output")
        loss = _mean_ce(jnp.einsum("btd,vd->btv", y, model.embed[...]), batch["tgt"])
        return loss, {"enc": enc_d, "dec": dec_d, "y": y, "x0": _embedding_stats(tok, pos)}

    @staticmethod
    def layer_grads(grads) -> dict[str, Any]:
        return {"enc": grads["transformer"]["encoder"]["layers"], "dec": grads["transformer"]["decoder"]["layers"]}


class LabSetting:
    """Build, batch, forward and measured rerun of the lab's causal LM on its Markov chain."""

    name = "lab"
    stacks = ("lm",)

    def __init__(self, setup: LabSetup):
        self.setup = setup
        self.task = markov_task(vocab=setup.vocab, seq_len=setup.seq_len, seed=setup.task_seed)

    def model_config(self, variant: str, depth: int) -> ModelConfig:
        s = self.setup
        return ModelConfig(variant, depth, vocab=s.vocab, seq_len=s.seq_len, d_model=s.d_model,
                           num_heads=s.num_heads, d_ff=s.d_ff)

    def create(self, variant: str, depth: int, key: jax.Array):
        return create_params(self.model_config(variant, depth), key)

    def batch(self, key: jax.Array) -> dict[str, jax.Array]:
        """{"tokens" (B, T + 1)}: fresh sequences of the chain."""
        return {"tokens": self.task.sample(key, self.setup.batch)}

    def probe_shapes(self, variant: str, depth: int) -> dict[str, dict[str, tuple[int, ...]]]:
        s = self.setup
        x = (s.batch, s.seq_len, s.d_model)
        n = len(declarations.BLOCKS["TransformerBlock"])
        return {"lm": {"layer": (depth + 1, *x), "z": (depth, n, *x), "n": (depth, n, *x)}}

    def forward(self, params, graphdef, rest, batch) -> jax.Array:
        """The stack's output (B, T, d) as the library computes it (LanguageModel.hidden)."""
        return nnx.merge(graphdef, params, rest).hidden(batch["tokens"][:, :-1])

    def rerun(self, params, probes, graphdef, rest, batch) -> tuple[jax.Array, dict]:
        """As XiongSetting.rerun, for the one causal stack ("lm")."""
        model = nnx.merge(graphdef, params, rest)
        tokens = batch["tokens"]
        b, t = tokens[:, :-1].shape
        tok, pos = model.embed(tokens[:, :-1]), model.pos(jnp.arange(t))
        stack = model.encoder
        masks = self_attention_masks(stack.cfg, "dense", b, t, None, None)
        lm = stack_diagnostics(stack, tok + pos, masks, probes=probes["lm"])
        y = lm.pop("output")
        return _mean_ce(model.logits(y), tokens[:, 1:]), {"lm": lm, "y": y, "x0": _embedding_stats(tok, pos)}

    @staticmethod
    def layer_grads(grads) -> dict[str, Any]:
        return {"lm": grads["encoder"]["layers"]}


def make_setting(name: str, study: Study):
    return XiongSetting(study.xiong) if name == "xiong" else LabSetting(study.lab)


# ------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------


def _rms(x: jax.Array) -> jax.Array:
    """sqrt(mean over tokens of ||x_t||^2) of x (..., E)."""
    return jnp.sqrt(jnp.mean(jnp.sum(jnp.square(x), axis=-1)))


def _rel_err(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(a - b)) / jnp.sqrt(jnp.mean(jnp.square(b)))


def _embedding_stats(tok: jax.Array, pos: jax.Array) -> dict[str, jax.Array]:
    """Mean square per coordinate of the token part (B, T, E), the position part (T, E) and
    their sum: ||.||^2 / d averaged over tokens."""
    return {"x0_token_ms": jnp.mean(jnp.square(tok)), "x0_pos_ms": jnp.mean(jnp.square(pos)),
            "x0_ms": jnp.mean(jnp.square(tok + pos))}


class _Tap:
    """Stands in for a block's dropout (identity at rate 0): keeps the sublayer's branch output
    F(x), which the block's `residual` passes through the dropout, and returns F(x) + probe, a zero
    probe whose gradient is the loss's gradient with respect to z = x + F(x)."""

    def __init__(self, sink: list, probe: jax.Array):
        self.sink, self.probe = sink, probe

    def __call__(self, h: jax.Array, deterministic: bool | None = None, rngs: Any = None) -> jax.Array:
        self.sink.append(h)
        return h + self.probe


class _Probed:
    """A post-LN sublayer's norm with a zero probe added to its output (there the stream)."""

    def __init__(self, norm: Callable, probe: jax.Array):
        self.norm, self.probe = norm, probe

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(x) + self.probe


def stack_diagnostics(stack, x: jax.Array, masks: dict, memory: jax.Array | None = None,
                      probes: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
    """Run a flax_blocks Encoder / Decoder layer by layer (a lax.scan over its stacked
    layers, each block's own `run`) on x (B, T, E), taking each sublayer's branch.

    probes, zeros, whose gradients are the loss's gradients with respect to the stream:
      "layer" (L + 1, B, T, E) added to the stream entering each layer and leaving the last
        (before a final norm);
      "z" (L, S, B, T, E) added to each sublayer's branch output, so at z = x + F(x) (the
        stream after the sublayer in pre-LN, the norm's input in post-LN);
      "n" (L, S, B, T, E) added to each post-LN sublayer's norm output (the stream after it;
        unused in pre-LN).
    Returns {"ratio": (L, S) ||F_s(x_s)|| / ||x_s|| (RMS over tokens) with x_s the stream
    entering sublayer s; "stream": (L + 1,) ||x_l||^2 / d; "recon": () the largest relative
    error of rebuilding each block's output from its branches, x_{s+1} = Norm_s(x_s + F_s)
    (post) or x_s + F_s (pre); "output": (B, T, E) the stack's output, final norm included}.
    """
    post = stack.cfg.norm == "post"
    graphdef, state = nnx.split(stack.layers)
    depth = stack.num_layers
    if probes is None:
        probes = {k: jnp.zeros(v, x.dtype) for k, v in probe_shapes(stack, x.shape).items()}

    def body(h, xs):
        layer_state, layer, p_layer, p_z, p_n = xs
        h = h + p_layer
        block = nnx.merge(graphdef, layer_state)
        branches: list[jax.Array] = []
        norms = [getattr(block, sub.norm) for sub in block.sublayers]
        object.__setattr__(block, "dropouts", [_Tap(branches, p_z[i]) for i in range(len(block.sublayers))])
        if post:
            for i, sub in enumerate(block.sublayers):
                object.__setattr__(block, sub.norm, _Probed(norms[i], p_n[i]))
        y = block.run(h, Context(masks, memory=memory, deterministic=True, layer=layer))
        ratios, cur = [], h
        for norm, f in zip(norms, branches, strict=True):
            ratios.append(_rms(f) / _rms(cur))
            cur = norm(cur + f) if post else cur + f
        stream = jnp.mean(jnp.sum(jnp.square(y), axis=-1)) / y.shape[-1]
        return y, (jnp.stack(ratios), stream, _rel_err(cur, y))

    layers = jnp.arange(1, depth + 1, dtype=jnp.int32)
    y, (ratio, stream, recon) = jax.lax.scan(
        body, x, (state, layers, probes["layer"][:depth], probes["z"], probes["n"]))
    y = y + probes["layer"][depth]
    x0 = jnp.mean(jnp.sum(jnp.square(x), axis=-1)) / x.shape[-1]
    if stack.final_norm is not None:
        y = stack.final_norm(y)
    return {"ratio": ratio, "stream": jnp.concatenate([x0[None], stream]), "recon": jnp.max(recon), "output": y}


def probe_shapes(stack, x_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The probes of `stack_diagnostics` for a stack (L layers of S sublayers) on x (B, T, E)."""
    depth, subs = stack.num_layers, len(declarations.BLOCKS[stack.block.kind])
    return {"layer": (depth + 1, *x_shape), "z": (depth, subs, *x_shape), "n": (depth, subs, *x_shape)}


def sublayer_gradients(g: dict[str, jax.Array], post: bool) -> jax.Array:
    """Probe gradients of one stack -> (L, S, 2): ||dLoss/d.|| at z_s = x_s + F_s and at the
    sublayer's output stream x_{s+1} (post: Norm(z_s); pre: z_s). The gradient at its input
    stream x_s is the previous sublayer's output one, or the layer boundary's ("gstream")."""
    def norm(a):
        return jnp.sqrt(jnp.sum(jnp.square(a), axis=(-3, -2, -1)))
    gz = norm(g["z"])  # (L, S)
    return jnp.stack([gz, norm(g["n"]) if post else gz], axis=-1)


def measure_fn(setting, variant: str, depth: int) -> Callable[[jax.Array], dict[str, jax.Array]]:
    """key -> one draw's measurements (see the module notes): a fresh init from one half of
    the key, a fresh batch from the other; one backward pass of the mean loss at init, through
    the layer-by-layer rerun (`setting.rerun`), gives the parameters' gradients and the
    streams'; the library's own forward (`setting.forward`) checks the rerun ("check")."""

    def one(key: jax.Array) -> dict[str, jax.Array]:
        k_init, k_data = jax.random.split(key)
        graphdef, params, rest = setting.create(variant, depth, k_init)
        batch = setting.batch(k_data)
        probes = {k: {p: jnp.zeros(shape, jnp.float32) for p, shape in v.items()}
                  for k, v in setting.probe_shapes(variant, depth).items()}
        (loss, aux), (grads, gprobes) = jax.value_and_grad(setting.rerun, argnums=(0, 1), has_aux=True)(
            params, probes, graphdef, rest, batch)
        out = {"loss": loss, "check": _rel_err(aux["y"], setting.forward(params, graphdef, rest, batch)),
               **aux["x0"]}
        for name, g in setting.layer_grads(grads).items():
            out[f"{name}_w2"] = jnp.sqrt(tree_sq(g["linear2"]["kernel"], keep_leading=True))  # (L,)
            out[f"{name}_layer"] = jnp.sqrt(tree_sq(g, keep_leading=True))  # (L,)
            out.update({f"{name}_{k}": v for k, v in aux[name].items()})  # ratio, stream, recon
            out[f"{name}_gstream"] = jnp.sqrt(tree_sq(gprobes[name]["layer"], keep_leading=True))  # (L + 1,)
            out[f"{name}_gsub"] = sublayer_gradients(gprobes[name], variant == "post")  # (L, S, 2)
        return out

    return one


PRNG_IMPL = "rbg"  # XLA's RngBitGenerator for the random bits: a 48 + 48-layer d512 model draws 353 M
# initial values per draw, which JAX's default threefry made the bulk of a draw's time on this CPU
# (measured at 6 + 6 layers: 0.9-1.4 s per draw with threefry, 0.5 s with rbg)


def draw_key(seed: int, draw: int) -> jax.Array:
    """Draw i's key: the same for every setting, variant and depth."""
    return jax.random.fold_in(jax.random.key(seed, impl=PRNG_IMPL), draw)


# ------------------------------------------------------------------------------------
# The study and its cells
# ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Study:
    name: str = "init"
    settings: tuple[str, ...] = SETTINGS
    variants: tuple[str, ...] = VARIANTS
    depths: tuple[int, ...] = (6, 12, 24, 48)
    draws: int = 32
    # Xiong's setting costs ~ its depth per draw (0.35 G parameters at 48 + 48 layers); from
    # `deep_from` layers on it runs `deep_draws` draws (Theorem 1's deep points), to keep the
    # whole study within minutes on a 2-core CPU
    deep_draws: int = 16
    deep_from: int = 24
    seed: int = 0
    xla_opt_level: int = 1  # XLA:CPU's LLVM level (experiments.stability.train.compiler_options); 0 compiles fastest
    xiong: XiongSetup = field(default_factory=XiongSetup)
    lab: LabSetup = field(default_factory=LabSetup)

    def draws_of(self, setting: str, depth: int) -> int:
        return self.deep_draws if setting == "xiong" and depth >= self.deep_from else self.draws

    def cells(self) -> list[tuple[str, str, int]]:
        """(setting, variant, depth), cheap first: the lab's, then Xiong's by depth."""
        order = {s: i for i, s in enumerate(SETTINGS)}
        return sorted(((s, v, L) for s in self.settings for v in self.variants for L in self.depths),
                      key=lambda c: (order[c[0]], c[2], VARIANTS.index(c[1])))


# The test's size: both settings and both variants at one depth, tiny widths, in seconds (each
# cell is one XLA compile of ~1-2 s of CPU here; Theorem 1's fit needs two depths and so is
# "not measured" at this size: tests/test_init_study.py checks its statistics on planted data).
QUICK = Study(
    name="quick", depths=(3,), draws=4, deep_draws=3, deep_from=3, xla_opt_level=0,
    xiong=XiongSetup(d_model=16, num_heads=2, d_ff=32, vocab=16, seq_len=6, batch=2),
    lab=LabSetup(d_model=16, num_heads=2, d_ff=32, vocab=16, seq_len=6, batch=2),
)


def cell_config(study: Study, setting: str, variant: str, depth: int) -> dict:
    """Everything that determines one cell's numbers."""
    return {"version": CELL_VERSION, "setting": setting, "variant": variant, "depth": depth,
            "draws": study.draws_of(setting, depth), "seed": study.seed, "prng": PRNG_IMPL,
            "setup": asdict(getattr(study, setting))}


def cell_name(cfg: dict) -> str:
    digest = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]
    return f"{cfg['setting']}_{cfg['variant']}_L{cfg['depth']}-{digest}"


def _round(x: Any, digits: int = 5) -> Any:
    """Arrays -> nested lists of floats with `digits` significant digits (keeps the cells small)."""
    if isinstance(x, dict):
        return {k: _round(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v, digits) for v in x]
    if isinstance(x, np.ndarray):
        return _round(x.tolist(), digits)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return float(f"{x:.{digits}g}") if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def _compile(lowered: jax.stages.Lowered, options: dict[str, Any]) -> tuple[jax.stages.Compiled, float]:
    t0 = time.time()
    return compile_lowered(lowered, options), time.time() - t0


def lower_cell(study: Study, setting_name: str, variant: str, depth: int) -> jax.stages.Lowered:
    """Trace the cell's measurement function (one per (setting, variant, depth))."""
    fn = jax.jit(measure_fn(make_setting(setting_name, study), variant, depth))
    return fn.lower(draw_key(study.seed, 0))


def run_cell(study: Study, setting_name: str, depth: int, program: jax.stages.Compiled) -> dict:
    """Run a cell's compiled function for every draw: {"draws": {name: (n, ...)}, "run_s"}."""
    t0 = time.time()
    n = study.draws_of(setting_name, depth)
    draws = [jax.device_get(program(draw_key(study.seed, i))) for i in range(n)]
    stacked = {k: np.stack([np.asarray(d[k]) for d in draws]) for k in draws[0]}
    return {"draws": stacked, "run_s": time.time() - t0}


def run_study(study: Study, out: Path, *, command: str | None = None, progress: bool = True) -> list[str]:
    """Every missing cell of the study, written to out/cells as it finishes; out/init.json.
    Cells are traced here and compiled on two worker threads (XLA compiles without the GIL)
    while earlier cells run. Returns the names of all the study's cells."""
    start, cpu_start, load_before = time.time(), time.process_time(), load_average()
    cells_dir = out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    configs = [cell_config(study, *c) for c in study.cells()]
    names = [cell_name(c) for c in configs]
    meta = {"study": asdict(study), "command": command, "cells": names,
            "lab_preset": "depth" if study.lab == LabSetup() else None}  # the lab setting's size is that preset's
    previous = json.loads((out / "init.json").read_text()) if (out / "init.json").exists() else {}
    if previous.get("cells") == names and "runs" in previous:
        meta["runs"] = previous["runs"]  # the wall times of earlier invocations
    (out / "init.json").write_text(json.dumps(meta, indent=1))  # a partial study can be reported
    options = compiler_options(study.xla_opt_level)
    env = {**environment(), "xla_compile_options": options}
    todo = [(cfg, name) for cfg, name in zip(configs, names, strict=True)
            if read_cell(cells_dir / f"{name}.json") is None]
    with ThreadPoolExecutor(max_workers=2) as pool:
        ahead: deque = deque()
        queue = iter(todo)

        def trace_next() -> None:  # two cells ahead: compiling while the current one runs
            for cfg, name in itertools.islice(queue, 1):
                lowered = lower_cell(study, cfg["setting"], cfg["variant"], cfg["depth"])
                ahead.append((cfg, name, pool.submit(_compile, lowered, options)))

        trace_next(), trace_next()
        while ahead:
            cfg, name, future = ahead.popleft()
            trace_next()
            program, compile_s = future.result()
            rec = run_cell(study, cfg["setting"], cfg["depth"], program)
            timing = {"compile_s": round(compile_s, 2), "run_s": round(rec["run_s"], 2)}
            draws = {k: _round(v, 4 if k.endswith(("_gsub", "_ratio", "_stream")) else 5)
                     for k, v in rec["draws"].items()}  # 4 digits for the bulky diagnostics: cells stay small
            write_cell(cells_dir / f"{name}.json",
                       _round({"name": name, "config": cfg, "draws": draws, "timing": timing, "environment": env}))
            if progress:
                print(f"{name}: {cfg['draws']} draws, compile {compile_s:.1f} s, run {rec['run_s']:.1f} s "
                      f"({time.time() - start:.0f} s so far)", file=sys.stderr, flush=True)
    run = {"cells_computed": len(todo), "wall_seconds": round(time.time() - start, 1),
           "cpu_seconds": round(time.process_time() - cpu_start, 1),
           "load_average_before": load_before, "load_average_after": load_average(), "environment": env}
    meta["runs"] = meta.get("runs", []) + [run]
    (out / "init.json").write_text(json.dumps(meta, indent=1))
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.init_study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: experiments/init_study/runs/study, or .../quick; untracked)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (the test's)")
    p.add_argument("--draws", type=int, help="draws (init + batch) per cell")
    p.add_argument("--depths", type=lambda s: tuple(int(x) for x in s.split(",") if x), help="e.g. 6,12,24,48")
    p.add_argument("--settings", type=lambda s: tuple(x for x in s.split(",") if x), help="xiong,lab")
    p.add_argument("--no-report", action="store_true", help="skip report.md and the plots")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    study = QUICK if args.quick else Study()
    changes = {k: getattr(args, k) for k in ("draws", "depths", "settings") if getattr(args, k) is not None}
    if changes.get("settings") and set(changes["settings"]) - set(SETTINGS):
        raise SystemExit(f"unknown setting(s) {sorted(set(changes['settings']) - set(SETTINGS))}; "
                         f"choose from {SETTINGS}")
    study = replace(study, **changes)
    command = " ".join(["python -m experiments.init_study", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    out = args.out if args.out is not None else RUNS / ("quick" if args.quick else "study")
    run_study(study, out, command=command, progress=not args.no_progress)
    if not args.no_report:
        print(f"report: {init_report.write_report(out)}")
    print(f"total wall time {time.time() - _START:.0f}s (from import)", file=sys.stderr)
    return 0

