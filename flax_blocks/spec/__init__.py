"""The framework-free spec shared by both twins: `config` (BlockConfig and its checks),
`declarations` (every module's parameters: names, shapes, init), `options` (the option
table) and `lm_spec` (the whole-model config). The only part of `flax_blocks` that
`torch_blocks` imports; it imports neither JAX nor torch."""
