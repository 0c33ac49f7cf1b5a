"""A flax_blocks module's weights out: torch-named (`torch_state_dict`) or Flax-named
(`flax_state_dict`), as numpy arrays."""

from __future__ import annotations

import numpy as np

from ...core import declarations
from ...core.lm_config import ENCODER, components
from ...lm import LanguageModel
from ..io import natural_key
from .place import expected_torch_params, flax_params


def torch_state_dict(module) -> dict[str, np.ndarray]:
    """{torch name: numpy array} of a flax_blocks module, in torch's layout and naming
    (loadable with strict=True into the torch_blocks twin, and into stock torch layers
    where the config is one torch supports). Dtypes are kept (bfloat16 as ml_dtypes).
    A whole model (`LanguageModel`): its own parts (embeddings, head) and its stack's under "encoder."."""
    if isinstance(module, LanguageModel):
        return _language_model(module)
    params = flax_params(module)
    out: dict[str, np.ndarray] = {}
    for name, exp in expected_torch_params(module).items():
        value = np.asarray(params[exp.flax_path].get_value())
        if exp.layer is not None:
            value = value[exp.layer]
        out[name] = np.array(exp.param.transform.to_torch(value, module.cfg), order="C")  # keeps 0-d ReZero scales 0-d
    return dict(sorted(out.items(), key=lambda kv: natural_key(kv[0])))


def _language_model(model: LanguageModel) -> dict[str, np.ndarray]:
    """{torch name: numpy array} of a whole model, the twin's names."""
    out: dict[str, np.ndarray] = {}
    for name, comp in components(model.lm, model.cfg):
        for t, _, p in declarations.flatten(comp, f"{name}."):
            value = np.asarray(getattr(getattr(model, name), p.flax).get_value())
            out[t] = np.array(p.transform.to_torch(value, model.cfg), order="C")
    out.update({f"{ENCODER}.{k}": v for k, v in torch_state_dict(model.encoder).items()})
    return out


def flax_state_dict(module) -> dict[str, np.ndarray]:
    """{dotted Flax path: numpy array}, the Flax-layout checkpoint (stacked layers)."""
    return {p: np.asarray(v.get_value()) for p, v in flax_params(module).items()}

