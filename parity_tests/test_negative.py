"""Every tolerance of the suite has wrong twins that exceed it: the checks can fail."""

from __future__ import annotations

import pytest

from .harness import TOL, parity
from .mutations import MUTATIONS
from .trajectory import TrainConfig, compare_trajectories


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_wrong_twin_fails_forward(mutation, dtype):
    case, flax_cfg, mutate = MUTATIONS[mutation]
    err = parity(case, dtype, flax_cfg=flax_cfg, mutate=mutate)
    assert err.forward > TOL["forward", dtype]
    assert not err.ok(dtype)
    if mutation != "layer_norm_eps_1e-6":
        # structural mistakes also fail every gradient tolerance; the eps mistake moves
        # float32 gradients by ~8e-6, inside 1e-5: the forward check is what catches it.
        assert err.grad > TOL["grad", dtype] and err.dx > TOL["grad", dtype]
    else:
        assert err.grad > TOL["grad", "float64"]


def test_optax_clip_breaks_float64_trajectory():
    """optax.clip_by_global_norm omits torch's +1e-6: the trajectory check sees it."""
    traj = compare_trajectories("float64", TrainConfig(steps=30, torch_clip=False))
    assert traj.weight_err > 1e-9
