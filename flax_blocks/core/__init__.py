"""The framework-free core both twins share: `config` (BlockConfig and its checks), `rope`
(rotary frequencies and their scalings), `declarations` (every module's parameters: names,
shapes, init), `options` (the option table) and `lm_config` (the whole-model config). The
only part of `flax_blocks` that `torch_blocks` imports; it imports neither JAX nor torch."""
