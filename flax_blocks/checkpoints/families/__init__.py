"""The Hugging Face families, one module each: its checkpoint names (a Dialect), its config read as
transformers' code for it reads it (a Family), the parts around its stack and what the parity
tests need to know of transformers' implementation, registered where they are defined
(`flax_blocks.checkpoints.family.register`). Importing this package registers them all, in
this order; docs/adding-a-family.md walks through adding one."""

from . import (  # noqa: F401 - imported for their registrations
    bert,
    cohere,
    cohere2,
    deepseek_v2,
    deepseek_v3,
    distilbert,
    gemma,
    gemma2,
    gemma3,
    gpt2,
    gpt_bigcode,
    gpt_neox,
    gpt_oss,
    gptj,
    granite,
    granitemoe,
    llama,
    mistral,
    mixtral,
    modernbert,
    olmo2,
    olmoe,
    opt,
    phi,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    roberta,
    stablelm,
    starcoder2,
    vit,
    whisper,
    xlm_roberta,
)
