"""Checkpoints in and out: file reading (`io`, `stream`, `io_errors`), checkpoint dialects
(`dialects`), the torch <-> Flax converter (`convert`, its CLI `python -m
flax_blocks.checkpoints.convert`) and Hugging Face configs, families, models and the Hub
(`hf`, `hf_config`, `hf_families`, `hf_models`, `hub`)."""
