"""Jitted training of many runs at once: steps under lax.scan, layers under scan, runs under vmap.

A *group* is a set of runs sharing one model shape and variant (one `ModelConfig`) and
differing in learning rate, warmup and seed. A group is three compiled programs
(`PROGRAMS`), each vmapped over its runs: "init" (the fresh models), "probe" (the held-out
pass with its intermediates, at init and after every chunk) and "chunk" (`TrainConfig.chunk`
steps, one `lax.scan`); compiled apart, two threads compile them at once, and kept in the
program cache when one is given (experiments/stability/program_cache.py: a warm run loads them without
tracing). The programs take and return each run's model as nested dicts of arrays
(`model.pure_params`), so a loaded program needs no Flax class. The leading "runs"
axis is sharded across the available devices (a 1-D mesh), so the same code runs on one CPU,
several (simulated) CPU devices, a GPU or a TPU slice. Python only loops over the chunks (so
a progress bar can move).

Each run is a pure function of its (seed, lr, warmup): its model is initialised from
key(seed) and its batches are drawn with key(seed) from a pool of task sequences shared by
the sweep, so runs with the same seed see the same data whatever their variant, depth,
learning rate, or which other runs share their program or device.

Recorded per run:
  every step: training loss (on that step's fresh batch, before the update), gradient
    global norm, held-out loss and the model update size ||F(x; theta_t) - F(x; theta_0)||
    (F = encoder output on the fixed held-out batch, per-token L2 norm averaged over
    tokens), both measured after the step's update;
  at step 0 (initialisation) and at the first step of every chunk: per-layer gradient
    norms (whole layer, FFN W2, attention) of that step's training batch, and, on the
    held-out batch, the residual-stream norm ||x_l||^2 / d for l = 0..L and the attention
    entropy of each layer; the held-out loss at initialisation;
  per chunk, the mean over its steps of the same per-layer gradient norms ("..._mean");
  at initialisation and after every chunk (n_chunks + 1 probe points, "probe_steps"), on
    the held-out batch: the largest scaled pre-softmax attention logit of each layer (max
    over batch, heads and unmasked (query, key) pairs; the Encoder's intermediate
    "attention_logits_max"), the RMS and the largest |value| of the LM head's output
    logits, and ||x_l||^2 / d
    ("stream_norm_probe": its last row is the stream after training);
  the experts variants (model.MOE_VARIANTS), at the same probe points on the held-out batch,
    the router's measures of each layer (`router_measures`): the largest |router logit|
    ("router_logit_max") and their RMS ("router_logit_rms"), each expert's share of the
    top-k picks ("expert_load", (L, X)), the load balance X * max_x share ("expert_balance":
    1 = every expert picked equally, X / k = all tokens on the same k experts), and HF's
    load-balancing loss over the whole stack ("router_aux": k when balanced); the FFN W2
    gradient norm is that of the experts' down projections. With TrainConfig.router_aux_coef
    > 0 the training objective adds coef x that loss on the training batch, and its value is
    recorded every step ("aux_loss"); "loss" stays the cross-entropy.

Multi-host: call `jax.distributed.initialize()` in every process before any JAX work (the
`--distributed` / `--coordinator --num-processes --process-id` flags of
`experiments.stability` do; on CPU with gloo collectives); `jax.devices()` then lists every
host's devices, `runs_mesh()` spans them, and every host passes the same inputs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .model import ModelConfig, model_binder, pure_params
from .program_cache import ProgramCache
from .tasks import Task

if TYPE_CHECKING:
    from flax_blocks import LanguageModel

Metrics = dict[str, np.ndarray]
PER_STEP = ("loss", "grad_norm", "heldout_loss", "update")
PER_GRAD = ("layer_grad_norm", "w2_grad_norm", "attn_grad_norm")
PER_GRAD_MEAN = tuple(f"{k}_mean" for k in PER_GRAD)
PER_PROBE = ("stream_norm", "attn_entropy")
# at init and after every chunk: (n_chunks + 1, ...)
TRAJECTORY = ("attn_logit_max", "logit_rms", "logit_absmax", "stream_norm_probe")
# the experts variants' router at the same probe points: (n_chunks + 1, L); "expert_load" (.., L, X), "router_aux" (..,)
ROUTER = ("router_logit_max", "router_logit_rms", "expert_balance", "expert_load", "router_aux")
PROGRAMS = ("chunk", "init", "probe")  # a group's compiled programs, the largest first


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings shared by every run of a sweep.

    steps must be a multiple of chunk. Adam with (b1, b2, eps) = (0.9, 0.98, 1e-9), the
    setting of the original Transformer and of the papers compared here; no weight decay,
    no gradient clipping (clipping would hide the instabilities being measured).
    Learning rate: linear warmup from lr / warmup to lr over `warmup` steps, then constant.
    router_aux_coef: the experts variants only; 0 (the default) trains on the cross-entropy alone.
    pool: task sequences drawn once (seed pool_seed); batches are sampled from it.
    heldout: fixed held-out sequences (seed heldout_seed, disjoint stream from the pool).
    """

    steps: int = 300
    batch: int = 32
    chunk: int = 50
    heldout: int = 16
    pool: int = 16384
    pool_seed: int = 1
    heldout_seed: int = 2
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-9
    router_aux_coef: float = 0.0  # the experts variants: objective = CE + coef x HF's load-balancing loss

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.chunk <= 0 or self.steps % self.chunk:
            raise ValueError(f"steps ({self.steps}) must be a positive multiple of chunk ({self.chunk})")


@dataclass(frozen=True)
class RunSpec:
    """What distinguishes the runs of one group."""

    lr: float
    warmup: int
    seed: int


def runs_mesh() -> Mesh:
    """A 1-D mesh over every device (all hosts), axis name "runs"."""
    return Mesh(np.array(jax.devices()), ("runs",))


def auto_axes_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with every axis Auto: the Trainer makes every array it computes on (params,
    batches, pools) on its mesh and places them itself, so a mesh of Explicit axes
    (`jax.make_mesh`'s default) is run as the same devices and names with XLA choosing."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


TRACING = threading.Lock()  # one thread traces at a time (`Trainer.compile`, `sample_pool`)
CPU_OPT_LEVEL = 1
OWN_OPTIONS = ("xla_backend_optimization_level", "xla_cpu_use_fusion_emitters")  # what compiler_options sets


def compiler_options(opt_level: int | None = CPU_OPT_LEVEL, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """XLA options for `Lowered.compile`, tuned for CPU compile time.

    On CPU, with opt_level not None: LLVM optimisation level `opt_level` (1 compiles these
    programs ~3x faster than XLA's default 3) and the classic fusion emitters instead of the
    newer MLIR ones (another ~1/3 off); measured on this project's programs, both run as fast
    (they are bound by dot kernels and per-op overhead, not by generated loop code).
    Elsewhere, or with opt_level None: XLA's defaults. `extra` options are added as given.
    Results can differ in the last bits between option sets: compare runs made with the same.
    """
    options: dict[str, Any] = {}
    if opt_level is not None and jax.default_backend() == "cpu":
        options = dict(zip(OWN_OPTIONS, (int(opt_level), False), strict=True))
    return {**options, **(extra or {})}


class UnknownCompileOption(ValueError):
    """A compile option the user gave (--xla-option) that this XLA build does not know."""


def compile_lowered(lowered: jax.stages.Lowered, options: dict[str, Any]) -> jax.stages.Compiled:
    """lowered.compile(options). The options `compiler_options` sets itself are dropped where
    this XLA build does not know them; any other unknown name is an UnknownCompileOption
    naming it (a misspelt --xla-option would otherwise be ignored without a word)."""
    try:
        return lowered.compile(options)
    except Exception as err:  # XLA raises a plain runtime error for an unknown option name
        unknown = [k for k in options if f"No such compile option: '{k}'" in str(err)]
        if not unknown:
            raise
        theirs = [k for k in unknown if k not in OWN_OPTIONS]
        if theirs:
            raise UnknownCompileOption(f"XLA compile option(s) {theirs} unknown to this XLA build (jaxlib "
                                       f"{jax.lib.__version__}); check the name given to --xla-option") from None
        return compile_lowered(lowered, {k: v for k, v in options.items() if k not in unknown})


def sample_pool(task: Task, n: int, seed: int, options: dict[str, Any] | None = None,
                split: str = "train") -> np.ndarray:
    """n task sequences (n, seq_len + 1) int32, drawn once with key(seed). split "heldout":
    the held-out sequences (text: windows of the held-out topics; the synthetic tasks draw
    both from one distribution, the seeds keeping the streams apart)."""
    if task.name == "text":
        return task.windows(n, seed, split)
    key = jax.random.key(seed)
    options = compiler_options() if options is None else options
    with TRACING:  # beside a group's tracing (experiments.stability): one at a time
        lowered = jax.jit(task.sample, static_argnums=1).lower(key, n)
    return np.asarray(compile_lowered(lowered, options)(key))


def sample_data(task: Task, train_cfg: TrainConfig, options: dict[str, Any] | None = None,
                sample: Callable[..., np.ndarray] = sample_pool) -> tuple[np.ndarray, np.ndarray]:
    """The task data of `train_cfg`: the pool (train_cfg.pool, T + 1) and the held-out
    sequences (train_cfg.heldout, T + 1), each drawn by `sample` (sample_pool's signature)."""
    return (sample(task, train_cfg.pool, train_cfg.pool_seed, options),
            sample(task, train_cfg.heldout, train_cfg.heldout_seed, options, split="heldout"))


# ------------------------------------------------------------------------------------
# Reductions used by the measurements
# ------------------------------------------------------------------------------------


def tree_sq(tree: Any, keep_leading: bool = False) -> jax.Array:
    """Sum of squares over a pytree; with keep_leading, one sum per index of axis 0 (layers)."""
    leaves = jax.tree.leaves(tree)
    if keep_leading:
        return sum(jnp.sum(jnp.square(x).reshape(x.shape[0], -1), axis=1) for x in leaves)
    return sum(jnp.sum(jnp.square(x)) for x in leaves)


def attention_entropy(weights: jax.Array) -> jax.Array:
    """weights (L, B, H, T, T) -> mean entropy (nats) of each layer's attention rows, (L,)."""
    safe = jnp.where(weights > 0, weights, 1.0)
    return -jnp.mean(jnp.sum(weights * jnp.log(safe), axis=-1), axis=(1, 2, 3))


def stream_norms(embedded: jax.Array, residual: jax.Array) -> jax.Array:
    """x_0 (B, T, E) and the stream after each layer (L, B, T, E) -> ||x_l||^2 / d, (L + 1,)."""
    d = embedded.shape[-1]
    x0 = jnp.mean(jnp.sum(jnp.square(embedded), -1)) / d
    xs = jnp.mean(jnp.sum(jnp.square(residual), -1), axis=(1, 2)) / d
    return jnp.concatenate([x0[None], xs])


def router_measures(router_logits: jax.Array, top_k: int) -> dict[str, jax.Array]:
    """A stack's router logits (L, B, T, X) -> per layer: the largest |logit| (L,), their RMS (L,),
    each expert's share of the B T k top-k picks (L, X) (summing to 1) and the load balance
    X * max_x share (L,): 1 when every expert gets 1 / X of the picks, X / k when every token
    picks the same k experts. The top k as the router picks them (`flax_blocks.experts.route`)."""
    x = router_logits.shape[-1]
    logits = router_logits.astype(jnp.float32)
    _, chosen = jax.lax.top_k(logits, top_k)  # softmax keeps the order: the same picks as the router's
    load = jnp.mean(jax.nn.one_hot(chosen, x, dtype=jnp.float32), axis=(1, 2, 3))  # (L, X)
    return {"router_logit_max": jnp.max(jnp.abs(logits), axis=(1, 2, 3)),
            "router_logit_rms": jnp.sqrt(jnp.mean(jnp.square(logits), axis=(1, 2, 3))),
            "expert_load": load, "expert_balance": x * jnp.max(load, axis=-1)}


class Trainer:
    """The compiled training program of one group: one ModelConfig, one Task, one TrainConfig."""

    def __init__(self, model_cfg: ModelConfig, task: Task, train_cfg: TrainConfig, *,
                 mesh: Mesh | None = None, pool: np.ndarray | None = None,
                 heldout: np.ndarray | None = None, options: dict[str, Any] | None = None,
                 program_cache: ProgramCache | None = None):
        if model_cfg.seq_len != task.seq_len or model_cfg.vocab != task.vocab:
            raise ValueError(f"model (vocab {model_cfg.vocab}, seq_len {model_cfg.seq_len}) does not "
                             f"match task (vocab {task.vocab}, seq_len {task.seq_len})")
        self.model_cfg, self.task, self.train_cfg = model_cfg, task, train_cfg
        self.mesh = auto_axes_mesh(mesh or runs_mesh())
        self.n_devices = self.mesh.devices.size
        self.adam = optax.scale_by_adam(b1=train_cfg.b1, b2=train_cfg.b2, eps=train_cfg.eps)
        self.weights = task.weights()  # (T,) loss weight per target position
        # the load-balancing loss's weight in the objective: the experts variants' only
        self.aux_coef = float(train_cfg.router_aux_coef) if model_cfg.experts else 0.0
        self.compiler_options = compiler_options() if options is None else options
        self.program_cache = program_cache  # where `compile` loads its programs from, when it holds them
        # The task data: (pool, T + 1) and (heldout, T + 1) int32, replicated; the programs are
        # traced from these shapes, so the data may come later (`use_data`; else sampled by `run`).
        t = task.seq_len + 1
        replicated = NamedSharding(self.mesh, P())
        self.data_shapes = (jax.ShapeDtypeStruct((train_cfg.pool, t), jnp.int32, sharding=replicated),
                            jax.ShapeDtypeStruct((train_cfg.heldout, t), jnp.int32, sharding=replicated))
        self.pool: jax.Array | None = None
        self.heldout: jax.Array | None = None
        if pool is not None or heldout is not None:
            if pool is None or heldout is None:
                raise ValueError("give both pool and heldout, or neither (then `run` samples them)")
            self.use_data(pool, heldout)
        # Three programs, vmapped over the runs: the fresh models, the probe (at init and after
        # each chunk) and a chunk of steps; compiled apart, so two threads compile them at once.
        # Every output keeps the runs axis sharded (the fresh models' constant leaves too).
        self.runs_sharding = runs = NamedSharding(self.mesh, P("runs"))  # the runs axis over the devices
        self._jitted = {
            "chunk": jax.jit(jax.vmap(self._chunk_one, in_axes=(0, 0, 0, None, None)), out_shardings=runs),
            "init": jax.jit(jax.vmap(self._init_one), out_shardings=runs),
            "probe": jax.jit(jax.vmap(self._probe, in_axes=(0, 0, None)), out_shardings=runs),
        }
        self._programs: dict[str, jax.stages.Compiled] = {}
        self._shapes: dict[int, dict] = {}  # run count -> the fresh state's shapes (`_state_shapes`)

    @functools.cached_property
    def _bind(self) -> Callable[[dict, dict], LanguageModel]:
        """(params, rest) -> the model (built once, and only where a program is traced)."""
        return model_binder(self.model_cfg)

    def use_data(self, pool: np.ndarray | jax.Array, heldout: np.ndarray | jax.Array) -> None:
        """The task data every run draws from: pool (train_cfg.pool, T + 1) and heldout
        (train_cfg.heldout, T + 1) token arrays, integer, placed on this group's devices."""
        for name, x, want in (("pool", pool, self.data_shapes[0]), ("heldout", heldout, self.data_shapes[1])):
            if tuple(x.shape) != want.shape or not np.issubdtype(x.dtype, np.integer):
                raise ValueError(f"{name} must be integer tokens of shape {want.shape} (train_cfg and the "
                                 f"task's seq_len + 1), got {x.dtype} {tuple(x.shape)}")
        self.pool = jax.device_put(np.asarray(pool, np.int32), self.data_shapes[0].sharding)
        self.heldout = jax.device_put(np.asarray(heldout, np.int32), self.data_shapes[1].sharding)

    # -- one run -------------------------------------------------------------------------

    def _model(self, params: dict, rest: dict) -> LanguageModel:
        """The model with these parameters (`rest`: the Dropouts' RNG state, unused at rate 0),
        both nested dicts of arrays as the programs take and return them (`model.pure_params`)."""
        return self._bind(params, rest)

    def _mean_ce(self, logits: jax.Array, tokens: jax.Array) -> jax.Array:
        """Mean cross-entropy over scored targets: logits (B, T, V), tokens (B, T + 1) -> scalar."""
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])  # (B, T)
        return jnp.sum(ce * self.weights) / (tokens.shape[0] * jnp.sum(self.weights))

    def _train_loss(self, params: dict, rest: dict, tokens: jax.Array) -> jax.Array:
        """Mean loss on a batch of tokens (B, T + 1)."""
        return self._mean_ce(self._model(params, rest)(tokens[:, :-1]), tokens)

    def _objective(self, params: dict, rest: dict, tokens: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The experts variants' objective with the auxiliary loss: CE + aux_coef x HF's
        load-balancing loss of the batch's router logits -> (objective, (CE, load-balancing loss))."""
        from flax_blocks.experts import load_balancing_loss

        logits, inter = self._model(params, rest)(tokens[:, :-1], return_intermediates=True)
        ce = self._mean_ce(logits, tokens)
        aux = load_balancing_loss(self.model_cfg.block_config(), inter["router_logits"])
        return ce + self.aux_coef * aux, (ce, aux)

    def _heldout(self, params: dict, rest: dict, heldout: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Held-out loss and encoder output y (heldout, T, E)."""
        model = self._model(params, rest)
        y = model.hidden(heldout[:, :-1])
        return self._mean_ce(model.logits(y), heldout), y

    def _probe(self, params: dict, rest: dict, heldout: jax.Array) -> dict[str, jax.Array]:
        """The held-out forward pass with its intermediates: loss, encoder output y
        (heldout, T, E), stream norms ||x_l||^2 / d (L + 1,), attention entropy (L,), the
        largest attention logit of each layer (L,), and the RMS and max |.| of the output
        logits (scalars)."""
        logits, inter = self._model(params, rest)(heldout[:, :-1], return_intermediates=True)
        out = {
            "loss": self._mean_ce(logits, heldout), "y": inter["output"],
            "stream_norm": stream_norms(inter["embedded"], inter["residual"]),
            "attn_entropy": attention_entropy(inter["attention_weights"]),
            "attn_logit_max": inter["attention_logits_max"].astype(jnp.float32),
            "logit_rms": jnp.sqrt(jnp.mean(jnp.square(logits))),
            "logit_absmax": jnp.max(jnp.abs(logits)),
        }
        if self.model_cfg.experts:  # the router's measures (a dense model's probe is unchanged)
            from flax_blocks.experts import load_balancing_loss

            block = self.model_cfg.block_config()
            out.update(router_measures(inter["router_logits"], block.num_experts_per_tok))
            out["router_aux"] = load_balancing_loss(block, inter["router_logits"]).astype(jnp.float32)
        return out

    def _init_one(self, seed: jax.Array) -> dict:
        """One run's fresh state: the model initialised from key(seed), Adam's zero moments,
        step 0 (`rest`: the Dropouts' RNG state, unused at rate 0)."""
        params, rest = pure_params(self.model_cfg, jax.random.fold_in(jax.random.key(seed), 0))
        return {"params": params, "rest": rest, "opt": self.adam.init(params), "step": jnp.zeros((), jnp.int32),
                "seed": seed}

    def _chunk_one(self, state: dict, lr: jax.Array, warmup: jax.Array, pool: jax.Array,
                   heldout: jax.Array) -> tuple[dict, dict]:
        """One run: `chunk` steps under lax.scan from `state` -> (state, per-step and per-layer metrics).
        state["y0"]: the encoder output on the held-out batch at initialisation (the update size's origin)."""
        rest, y0 = state["rest"], state["y0"]
        data_key = jax.random.fold_in(jax.random.key(state["seed"]), 1)

        def step(carry: tuple, _: None) -> tuple[tuple, dict]:
            params, opt, t = carry
            idx = jax.random.randint(jax.random.fold_in(data_key, t), (self.train_cfg.batch,), 0, pool.shape[0])
            if self.aux_coef:  # the experts variants with the auxiliary loss
                (_, (loss, aux)), grads = jax.value_and_grad(self._objective, has_aux=True)(params, rest, pool[idx])
            else:  # as every dense variant has always trained
                loss, grads = jax.value_and_grad(self._train_loss)(params, rest, pool[idx])
            updates, opt = self.adam.update(grads, opt, params)
            scale = jnp.where(warmup > 0, jnp.minimum(1.0, (t + 1) / jnp.maximum(warmup, 1)), 1.0)
            params = jax.tree.map(lambda p, u: p - lr * scale * u, params, updates)
            heldout_loss, y = self._heldout(params, rest, heldout)
            layers = grads["encoder"]["layers"]
            w2 = layers["experts"]["down"] if self.model_cfg.experts else layers["linear2"]["kernel"]
            out = {
                "loss": loss,
                "grad_norm": jnp.sqrt(tree_sq(grads)),
                "heldout_loss": heldout_loss,
                "update": jnp.mean(jnp.sqrt(jnp.sum(jnp.square(y - y0), axis=-1))),
                "layer_grad_norm": jnp.sqrt(tree_sq(layers, keep_leading=True)),  # (L,)
                "w2_grad_norm": jnp.sqrt(tree_sq(w2, keep_leading=True)),
                "attn_grad_norm": jnp.sqrt(tree_sq(layers["self_attn"], keep_leading=True)),
            }
            if self.aux_coef:
                out["aux_loss"] = aux
            return (params, opt, t + 1), out

        carry = (state["params"], state["opt"], state["step"])
        (params, opt, t), per_step = jax.lax.scan(step, carry, None, length=self.train_cfg.chunk)
        metrics = {k: per_step[k] for k in PER_STEP + ("aux_loss",) if k in per_step}
        metrics.update({k: per_step[k][0] for k in PER_GRAD})  # at the chunk's first step
        metrics.update({f"{k}_mean": jnp.mean(per_step[k], axis=0) for k in PER_GRAD})  # over the chunk
        return {**state, "params": params, "opt": opt, "step": t}, metrics

    # -- the group -----------------------------------------------------------------------

    def _shard(self, x: np.ndarray) -> jax.Array:
        return jax.device_put(x, self.runs_sharding)

    def _inputs(self, specs: list[RunSpec]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Sharded (seeds, lrs, warmups), padded to a multiple of the device count by
        repeating the last run."""
        if not specs:
            raise ValueError("no runs given")
        padded = specs + [specs[-1]] * ((-len(specs)) % self.n_devices)
        seeds = self._shard(np.array([s.seed for s in padded], np.int32))
        lrs = self._shard(np.array([s.lr for s in padded], np.float32))
        warmups = self._shard(np.array([s.warmup for s in padded], np.int32))
        return seeds, lrs, warmups

    def trace(self, specs: list[RunSpec], program: str) -> jax.stages.Traced:
        """Trace one of the group's programs ("chunk", "init" or "probe") for these runs;
        nothing is computed (the state's shapes come from `jax.eval_shape`)."""
        if program not in PROGRAMS:
            raise ValueError(f"program must be one of {PROGRAMS}, got {program!r}")
        seeds, lrs, warmups = self._inputs(specs)
        if program == "init":
            return self._jitted["init"].trace(seeds)
        state = self._state_shapes(seeds)
        if program == "probe":
            return self._jitted["probe"].trace(state["params"], state["rest"], self.data_shapes[1])
        y0 = jax.ShapeDtypeStruct((len(seeds), self.train_cfg.heldout, self.model_cfg.seq_len, self.model_cfg.d_model),
                                  jnp.float32, sharding=self.runs_sharding)
        return self._jitted["chunk"].trace({**state, "y0": y0}, lrs, warmups, *self.data_shapes)

    def _state_shapes(self, seeds: jax.Array) -> dict:
        """The fresh state's ShapeDtypeStructs for these (padded) runs, sharded on the runs axis
        (traced once per run count, shared by the probe's and the chunk's tracing)."""
        n = len(seeds)
        if n not in self._shapes:
            shapes = jax.eval_shape(self._jitted["init"], seeds)
            self._shapes[n] = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.runs_sharding), shapes)
        return self._shapes[n]

    def compile(self, specs: list[RunSpec], program: str) -> jax.stages.Compiled:
        """Trace, lower and compile one program and keep it for `run`; with a program cache,
        load it from there when it holds it (nothing is traced) and store it when not.
        Tracing holds the GIL, so threads trace one at a time, the first to ask first (the
        largest program's compile, which runs without the GIL, starts sooner)."""

        def build() -> jax.stages.Compiled:
            with TRACING:
                lowered = self.trace(specs, program).lower()
            return compile_lowered(lowered, self.compiler_options)

        if self.program_cache is None:
            compiled = build()
        else:
            compiled = self.program_cache.program(self.describe(specs, program), self.mesh.devices.flat, build)
        self._programs[program] = compiled
        return compiled

    def describe(self, specs: list[RunSpec], program: str) -> dict[str, Any]:
        """What one of the group's programs is a function of, besides the code and the devices
        (`program_cache.environment_key`, the program cache's key): its name, the model,
        training and task configs, the (padded) run count, the data's shapes and the compile
        options."""
        if program not in PROGRAMS:
            raise ValueError(f"program must be one of {PROGRAMS}, got {program!r}")
        return {"program": program, "runs": len(specs) + (-len(specs)) % self.n_devices,
                "model": asdict(self.model_cfg), "train": asdict(self.train_cfg), "task": self.task.identity(),
                "options": self.compiler_options}

    def keep(self, program: str, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """Compile a lowered program and keep it for `run` (XLA compiles without the GIL: two
        threads compile two programs at once)."""
        self._programs[program] = compiled = compile_lowered(lowered, self.compiler_options)
        return compiled

    def run(self, specs: list[RunSpec]) -> Iterator[tuple[int, list[Metrics] | None]]:
        """Train every run in `specs` together. Yields (steps done, None) after each chunk,
        then (steps, results): one dict of numpy metrics per spec, in order (padding dropped).
        """
        n = len(specs)
        if self.pool is None or self.heldout is None:
            self.use_data(*sample_data(self.task, self.train_cfg, self.compiler_options))
        seeds, lrs, warmups = self._inputs(specs)
        init, probe, chunk = (self._programs.get(p) or self.compile(specs, p) for p in ("init", "probe", "chunk"))

        def fetch(tree: dict) -> Metrics:
            if jax.process_count() > 1:  # gather the runs axis from every host
                tree = multihost_utils.process_allgather(tree, tiled=True)
            return jax.device_get(tree)

        state = init(seeds)
        at_init = probe(state["params"], state["rest"], self.heldout)
        state["y0"] = at_init.pop("y")
        probes, chunks = [fetch(at_init)], []
        for c in range(self.train_cfg.steps // self.train_cfg.chunk):
            state, m = chunk(state, lrs, warmups, self.pool, self.heldout)
            after = probe(state["params"], state["rest"], self.heldout)
            after.pop("y")
            chunks.append(fetch(m))
            probes.append(fetch(after))
            yield (c + 1) * self.train_cfg.chunk, None

        out: dict[str, np.ndarray] = {}
        for k in PER_STEP + ("aux_loss",) * ("aux_loss" in chunks[0]):  # (R, steps)
            out[k] = np.concatenate([m[k] for m in chunks], axis=1)
        for k in PER_GRAD + PER_GRAD_MEAN:  # (R, n_chunks, ...)
            out[k] = np.stack([m[k] for m in chunks], axis=1)
        for k in PER_PROBE:  # (R, n_chunks, ...): at each chunk's start
            out[k] = np.stack([p[k] for p in probes[:-1]], axis=1)
        for k in TRAJECTORY:  # (R, n_chunks + 1, ...): at init, then after each chunk
            out[k] = np.stack([p["stream_norm" if k == "stream_norm_probe" else k] for p in probes], axis=1)
        for k in ROUTER:  # the experts variants: (R, n_chunks + 1, L[, X]) or (R, n_chunks + 1)
            if k in probes[0]:
                out[k] = np.stack([p[k] for p in probes], axis=1)
        out["heldout_loss0"] = probes[0]["loss"]  # (R,)
        results = []
        for i in range(n):
            r = {k: v[i] for k, v in out.items()}
            r["chunk_steps"] = np.arange(0, self.train_cfg.steps, self.train_cfg.chunk)
            r["probe_steps"] = np.arange(0, self.train_cfg.steps + 1, self.train_cfg.chunk)
            results.append(r)
        yield self.train_cfg.steps, results
