"""Checkpoints in and out: file reading (`io`, `stream`, `io_errors`), checkpoint dialects
(`dialects`), the torch <-> Flax converter (`convert`, its CLI `python -m
flax_blocks.checkpoints.convert`), and Hugging Face models: each family one module of
`families` (its names, its config reader, the parts around its stack), registered in `family`
and read by `checkpoint` (a source read once, framework-free: config, files, whole models,
generation settings, load report), `hf` (the Flax twin's from_hf / place, and to_hf), `save_hf`
and `hub`.

Importing this package registers every family (their modules hold their dialects), so that
any of its modules finds them all."""

from . import families  # noqa: F401 - registers every family and its dialect
