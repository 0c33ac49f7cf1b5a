"""The framework-free core both twins share: `config` (BlockConfig and its checks), `rope`
(rotary frequencies and their scalings), `declarations` (every module's parameters: names,
shapes, init), `options` (the option table), `lm_config` (the whole-model config),
`attention_paths` (the rule that picks an attention's path) and `context` (what a call hands a
block's sublayers, and an attention its `AttentionCall`). The
only part of `flax_blocks` that `torch_blocks` imports; it imports neither JAX nor torch."""
