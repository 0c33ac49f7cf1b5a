"""The same small Encoder trained with optax (JAX) and torch.optim.AdamW (PyTorch).

Every hyperparameter is explicit and identical on both sides: a warmup + cosine learning
rate schedule (one optax schedule, evaluated for torch too), betas, eps, weight decay
(applied to every parameter on both sides) and gradient clipping by global norm.

Traps found here: optax evaluates schedules in float32 even under x64 (see
`TrainConfig.schedule`); and optax.clip_by_global_norm scales by max_norm / norm, torch's
clip_grad_norm_ by max_norm / (norm + 1e-6). That 1e-6 alone moves the trajectories
apart by far more than float64 rounding, so the JAX side uses `clip_by_global_norm_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import flax_blocks as fb

from .harness import TORCH_DTYPES, Case, flax_twin, precision, rel_err, torch_twin


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch: int = 4
    seq: int = 6
    peak_lr: float = 3e-3
    warmup: int = 10
    end_lr: float = 3e-4
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 0.5
    torch_clip: bool = True  # False: optax's own clip_by_global_norm (a negative test)

    def schedule(self) -> optax.Schedule:
        """Warmup then cosine decay, computed in the default float dtype (float64 under x64).

        optax evaluates a schedule on its int32 step count, and jnp then computes it in
        float32 even with x64 on: a float32-rounded learning rate alone moves float64
        trajectories apart by ~1e-8. Casting the count first keeps it float64."""
        base = optax.warmup_cosine_decay_schedule(0.0, self.peak_lr, self.warmup, self.steps, self.end_lr)
        return lambda count: base(jnp.asarray(count, jnp.result_type(float)))


CASE = Case("Encoder", fb.BlockConfig(d_model=12, num_heads=2, d_ff=20, dropout=0.0, norm="pre", activation="gelu"),
            num_layers=2, seed=5)


def clip_by_global_norm_torch(max_norm: float) -> optax.GradientTransformation:
    """torch.nn.utils.clip_grad_norm_ in optax: g * min(1, max_norm / (||g|| + 1e-6))."""

    def update(updates, state, params=None):
        coef = jnp.minimum(max_norm / (optax.tree.norm(updates) + 1e-6), 1.0)
        return jax.tree.map(lambda g: g * coef.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _data(tc: TrainConfig, d_model: int, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(tc.steps, tc.batch, tc.seq, d_model))
    target = rng.normal(size=(tc.batch, tc.seq, d_model))
    return xs, target


def train_flax(module, tc: TrainConfig, xs: np.ndarray, target: np.ndarray, dtype: str):
    """Returns (per-step losses (steps,), final params as {torch name: array})."""
    from flax_blocks.checkpoints.convert import torch_state_dict

    clip = clip_by_global_norm_torch(tc.clip_norm) if tc.torch_clip else optax.clip_by_global_norm(tc.clip_norm)
    opt = optax.chain(clip, optax.adamw(tc.schedule(), b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    jdt = jnp.dtype(dtype)

    def loss_fn(params, rest, x, y):
        return jnp.mean((nnx.merge(graphdef, params, rest)(x) - y) ** 2)

    @jax.jit
    def train(params, rest, xs, y):
        def step(carry, x):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, rest, x, y)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, _), losses = jax.lax.scan(step, (params, opt.init(params)), xs)
        return params, losses

    params, losses = train(params, rest, jnp.asarray(xs, jdt), jnp.asarray(target, jdt))
    return np.asarray(losses), torch_state_dict(nnx.merge(graphdef, params, rest))


def train_torch(module: torch.nn.Module, tc: TrainConfig, xs: np.ndarray, target: np.ndarray, dtype: str):
    """Returns (per-step losses (steps,), final params as {name: array})."""
    tdt = TORCH_DTYPES[dtype]
    schedule = tc.schedule()
    opt = torch.optim.AdamW(module.parameters(), lr=tc.peak_lr, betas=(tc.b1, tc.b2), eps=tc.eps,
                            weight_decay=tc.weight_decay, amsgrad=False, maximize=False)
    y = torch.tensor(target, dtype=tdt)
    losses = []
    for t in range(tc.steps):
        for group in opt.param_groups:  # the same schedule, evaluated at the same step
            group["lr"] = float(schedule(t))
        opt.zero_grad(set_to_none=True)
        loss = ((module(torch.tensor(xs[t], dtype=tdt)) - y) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), tc.clip_norm)
        opt.step()
        losses.append(loss.item())
    return np.array(losses), {k: v.detach().numpy() for k, v in module.state_dict().items()}


@dataclass
class Trajectory:
    loss_err: float  # max over steps of |loss_jax - loss_torch| / loss_torch
    weight_err: float  # worst parameter's rel_err after training, key biases excepted
    key_bias_err: float  # the key projection's bias: its true gradient is exactly zero
    losses_flax: np.ndarray
    losses_torch: np.ndarray


def compare_trajectories(dtype: str, tc: TrainConfig = TrainConfig(), case: Case = CASE) -> Trajectory:
    with precision(dtype):
        tmod = torch_twin(case, dtype)
        fmod = flax_twin(case, tmod, dtype)
        xs, target = _data(tc, case.cfg.d_model)
        lf, wf = train_flax(fmod, tc, xs, target, dtype)
        lt, wt = train_torch(tmod, tc, xs, target, dtype)
    loss_err = float(np.max(np.abs(lf - lt) / np.abs(lt)))
    # softmax is invariant to the key bias, so its gradient is rounding noise that Adam
    # normalises into full-size steps: it is compared separately.
    e = case.cfg.d_model
    weights, key_bias = [], []
    for k in wt:
        if k.endswith("in_proj_bias"):
            key_bias.append(rel_err(wf[k][e:2 * e], wt[k][e:2 * e]))
            wf[k], wt[k] = np.delete(wf[k], np.s_[e:2 * e]), np.delete(wt[k], np.s_[e:2 * e])
        weights.append(rel_err(wf[k], wt[k]))
    return Trajectory(loss_err, max(weights), max(key_bias, default=0.0), lf, lt)
