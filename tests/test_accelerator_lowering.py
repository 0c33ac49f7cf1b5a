"""Nothing CPU-only in the programs an accelerator would run: the lab's train step, the
bench's block steps (a dense block and the blocked attention's long causal one, LLaMA-like
too) and `fb.generate`'s decoding loop are lowered for CUDA and TPU from this CPU
(`jax.jit(f).trace(...).lower(lowering_platforms=...)`), and a host callback planted in the
lab's step makes that fail."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_blocks as fb
from experiments.bench import blocks as bench
from experiments.stability.model import ModelConfig
from experiments.stability.tasks import make_task
from experiments.stability.train import PROGRAMS, RunSpec, TrainConfig, Trainer

PLATFORMS = ("cuda", "tpu")


def _lower_everywhere(traced: jax.stages.Traced) -> dict[str, str]:
    """The program's StableHLO for each platform (raises where it cannot be lowered)."""
    return {p: traced.lower(lowering_platforms=(p,)).as_text() for p in PLATFORMS}


def _lab_step(trainer_cls: type = Trainer, program: str = "chunk") -> jax.stages.Traced:
    task = make_task("markov", vocab=16, seq_len=8, seed=0)
    cfg = ModelConfig("pre", 2, vocab=16, seq_len=8, d_model=16, num_heads=2, d_ff=32)
    tr = trainer_cls(cfg, task, TrainConfig(steps=4, batch=4, chunk=2, heldout=4, pool=64))
    return tr.trace([RunSpec(1e-3, 0, 0), RunSpec(1e-2, 2, 1)], program)


@pytest.mark.parametrize("program", PROGRAMS)
def test_lab_programs_lower_for_accelerators(program):
    """The chunk of train steps, the fresh models and the held-out probe."""
    hlo = _lower_everywhere(_lab_step(program=program))
    if program == "chunk":
        assert all("while" in text for text in hlo.values())  # the steps' scan is in the program


def test_an_unknown_program_is_refused_by_name():
    with pytest.raises(ValueError, match=r"program must be one of \('chunk', 'init', 'probe'\), got 'train'"):
        _lab_step(program="train")


@pytest.mark.parametrize("size", ["block d1024 T2048", "encoder d1024 L12", "block d32 T16 llama-like"])
def test_bench_block_steps_lower_for_accelerators(size):
    """The bench's GPU rows (the blocked attention at T 2048; a 12-layer scan) and the
    LLaMA-like block, built abstractly (nothing is allocated)."""
    s = next(x for rows in bench.SIZES.values() for x in rows if x.name == size)
    graphdef, params, rest = nnx.split(_abstract(s), nnx.Param, ...)
    forward, train = bench.jax_step_fns(graphdef, rest)
    x = jax.ShapeDtypeStruct((s.batch, s.seq, s.d_model), jnp.float32)
    _lower_everywhere(jax.jit(forward).trace(params, x))
    _lower_everywhere(jax.jit(train).trace(params, x, x))


def _abstract(s: bench.Size):
    from flax_blocks.blocks import TransformerBlock
    from flax_blocks.stacks import Encoder

    cfg = s.cfg("float32")
    return nnx.eval_shape(lambda: TransformerBlock(cfg, rngs=nnx.Rngs(0)) if s.block
                          else Encoder(cfg, num_layers=s.layers, rngs=nnx.Rngs(0)))


def test_generate_lowers_for_accelerators():
    from flax_blocks import generation

    cfg = fb.BlockConfig(d_model=16, num_heads=2, d_ff=32, norm="pre", causal=True, dropout=0.0)
    lm = fb.LanguageModel(cfg, fb.LMConfig(vocab_size=32, num_layers=2, max_positions=32), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(lm)
    layers = generation._layer_weights(graphdef, state)
    ids, mask = jnp.asarray(np.arange(8).reshape(2, 4)), jnp.ones((2, 4), bool)
    traced = generation._generate.trace(graphdef, state, layers, ids, mask, jax.random.key(0), max_new_tokens=4,
                                        temperature=0.0, top_k=None, top_p=None, eos=None, pad=None)
    _lower_everywhere(traced)


def test_a_host_callback_in_the_lab_step_is_caught():
    class Planted(Trainer):  # a metric fetched to the host inside the step: works on CPU only
        def _train_loss(self, params, rest, tokens):
            loss = super()._train_loss(params, rest, tokens)
            jax.debug.callback(lambda v: None, loss)
            return loss

    traced = _lab_step(Planted)
    for platform in PLATFORMS:
        with pytest.raises(ValueError, match=f"lowering platform {platform}"):
            traced.lower(lowering_platforms=(platform,))
