"""The old home of the config and files of a Hugging Face source: now
`flax_blocks.checkpoints.checkpoint`, which a load reads in one module. These names keep
working from here; nothing in the library imports this module."""

from .checkpoint import (  # noqa: F401
    CONFIG_DTYPES,
    NOT_COMPUTED,
    WEIGHT_FILES,
    ConfigRead,
    check_hf_source,
    config_dtype,
    family_of,
    hf_config,
    hf_model_config,
    hf_state_dict,
    read_config,
    read_folder,
    weight_files,
)
