"""Move weights between PyTorch (torch_blocks / stock nn.TransformerEncoder) and flax_blocks.

    from_torch(Encoder, cfg, source, num_layers=6)                      torch -> a new Flax module
    load_torch_state_dict(module, source, *, prefix="", strict=True)   torch -> Flax, in place
    torch_state_dict(module)                                            Flax  -> {torch name: array}
    infer_config(source)                                                what a checkpoint fixes

Both directions read the parameter declarations (`flax_blocks.core.declarations`): each
Param's torch name, Flax path and Transform (torch tensor <-> Flax array). An Encoder's
torch `layers.{i}.` maps to index i of the Flax layers' leading (stacked) axis. Nothing
here imports torch: a `.pt` file needs it, a `.safetensors` file or a mapping of arrays
does not. Other checkpoints' key names (Hugging Face families) are `flax_blocks.checkpoints.dialects`.

Loading is strict by default and atomic: every problem (missing or unexpected keys, shape
mismatches, non-floating dtypes, a prefix that matches nothing, a layer count that differs)
is collected and raised together in one `ConversionError` before the module is touched.
Dtypes are preserved (float32, float64, bfloat16) unless `dtype=` asks for a cast.

Modules: `place` (which parameters a module has, both namings, and values placed into
them), `infer` (config inference), `load` (validate -> plan -> apply), `save` (state dicts
out); `__main__` is the command line (`python -m flax_blocks.checkpoints.convert`, see
`flax_blocks.checkpoints.convert.cli`).
"""

from ..io import ConversionError, read_state_dict, to_numpy
from .infer import ConfigReport, infer_config
from .load import LoadResult, from_torch, load_flax_state_dict, load_torch_state_dict
from .place import Expected, expected_torch_params, materialize_rng_state, module_params
from .save import flax_state_dict, torch_state_dict

__all__ = [
    "ConversionError", "read_state_dict", "to_numpy", "ConfigReport", "infer_config", "LoadResult", "from_torch",
    "load_flax_state_dict", "load_torch_state_dict", "materialize_rng_state", "Expected", "expected_torch_params",
    "module_params", "flax_state_dict", "torch_state_dict",
]
