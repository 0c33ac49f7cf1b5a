"""A flax_blocks module's weights out: torch-named (`torch_state_dict`) or Flax-named
(`flax_state_dict`), as numpy arrays."""

from __future__ import annotations

import numpy as np

from ..io import natural_key
from .params import expected_torch_params, flax_params


def torch_state_dict(module) -> dict[str, np.ndarray]:
    """{torch name: numpy array} of a flax_blocks module, in torch's layout and naming
    (loadable with strict=True into the torch_blocks twin, and into stock torch layers
    where the config is one torch supports). Dtypes are kept (bfloat16 as ml_dtypes).
    A whole model (flax_blocks.lm.LanguageModel) names its own parts (its `_torch_state_dict`)."""
    hook = getattr(type(module), "_torch_state_dict", None)  # duck-typed: no import of the model's module
    if hook is not None:
        return hook(module)
    params = flax_params(module)
    out: dict[str, np.ndarray] = {}
    for name, exp in expected_torch_params(module).items():
        value = np.asarray(params[exp.flax_path].get_value())
        if exp.layer is not None:
            value = value[exp.layer]
        out[name] = np.array(exp.param.transform.to_torch(value, module.cfg), order="C")  # keeps 0-d ReZero scales 0-d
    return dict(sorted(out.items(), key=lambda kv: natural_key(kv[0])))


def flax_state_dict(module) -> dict[str, np.ndarray]:
    """{dotted Flax path: numpy array}, the Flax-layout checkpoint (stacked layers)."""
    return {p: np.asarray(v.get_value()) for p, v in flax_params(module).items()}

