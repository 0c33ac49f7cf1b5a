"""Every tolerance of the suite has wrong twins that exceed it: the checks can fail."""

from __future__ import annotations

import jax
import pytest

from flax_blocks.layers import Norm

from .harness import TOL, parity
from .mutations import MUTATIONS
from .trajectory import TrainConfig, compare_trajectories

# Every wrong twin in float32, whose tolerances are the loose ones (2e-6 forward, 1e-5
# gradient): a mistake caught there is caught by float64's 1e-12 / 1e-11 too, since a
# mistake's error is a property of the function, not of the dtype. float64 runs the mistakes
# the tolerances exist for (eps, the GELU variant, the mask's sense, a transposed kernel) and
# the smallest one (an RMSNorm eps of machine epsilon), so each float64 tolerance has its own.
FLOAT64_MUTATIONS = ("layer_norm_eps_1e-6", "tanh_gelu_for_exact", "inverted_mask", "transposed_out_projection",
                     "rmsnorm_eps_machine_epsilon")
WRONG_TWINS = [(m, "float32") for m in MUTATIONS] + [(m, "float64") for m in FLOAT64_MUTATIONS]


@pytest.mark.parametrize(("mutation", "dtype"), WRONG_TWINS, ids=[f"{m}-{d}" for m, d in WRONG_TWINS])
def test_wrong_twin_fails_forward(mutation, dtype):
    case, flax_cfg, mutate = MUTATIONS[mutation]
    err = parity(case, dtype, flax_cfg=flax_cfg, mutate=mutate)
    assert err.forward > TOL["forward", dtype]
    assert not err.ok(dtype)
    if mutation != "layer_norm_eps_1e-6" or dtype == "float64":
        assert err.grad > TOL["grad", dtype] and err.dx > TOL["grad", dtype]
    else:
        # The eps mistake moves float32 gradients by ~8e-6, inside the float32 gradient
        # tolerance 1e-5: here the forward check (asserted above) is what catches it. Any
        # mistake that changes the forward function is caught there; the gradient tolerance
        # guards mistakes the forward cannot show, and test_gradient_only_wrong_twin_fails
        # gives it a wrong twin whose forward is exact.
        assert err.grad < TOL["grad", dtype]


class _BackwardEpsNorm(Norm):
    """A norm whose forward is exact but whose gradient is that of eps 1e-4: the shape of a
    mistake in a hand-written backward (custom_vjp, a fused kernel)."""

    def __call__(self, x):
        y = super().__call__(x)
        h = x if self.rms else x - x.mean(-1, keepdims=True)
        alt = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-4) * self.scale[...]
        alt = alt if self.bias is None else alt + self.bias[...]
        return jax.lax.stop_gradient(y) + (alt - jax.lax.stop_gradient(alt))


def _backward_eps_norms(case, module, inp):
    module.norm1.__class__ = module.norm2.__class__ = _BackwardEpsNorm
    return module, inp


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradient_only_wrong_twin_fails(dtype):
    """Forward within tolerance, gradients not: the gradient tolerances have teeth of their own."""
    err = parity(MUTATIONS["tanh_gelu_for_exact"][0], dtype, mutate=_backward_eps_norms)
    assert err.forward <= TOL["forward", dtype]
    assert err.grad > TOL["grad", dtype] and err.dx > TOL["grad", dtype]


def test_optax_clip_breaks_float64_trajectory():
    """optax.clip_by_global_norm omits torch's +1e-6: the trajectory check sees it."""
    traj = compare_trajectories("float64", TrainConfig(steps=30, torch_clip=False))
    assert traj.weight_err > 1e-9
