"""The Hugging Face model itself as the parity reference for a Flax stack from `fb.from_hf`.

Feeds hidden states as `inputs_embeds` (ViT: as `pixel_values`, its embeddings replaced by the
identity) with the embeddings' own additions out of the way (BERT / RoBERTa: position and
token-type embeddings zeroed, embedding LayerNorm replaced by the identity; DistilBERT: the
same without token types; GPT-2: position embeddings zeroed; OPT: position embeddings zeroed
and project_in / project_out removed; LLaMA-family, Phi-3, Qwen3, OLMo 2 and GPT-NeoX models add
nothing; Gemma multiplies inputs_embeds by sqrt(hidden_size) in its forward, so its layer 0 is
handed inputs_embeds itself), so the HF model's last hidden state is its layers + final norm
from the same layer-0 input.

float64: HF's LLaMA-family (and Phi-3, Qwen3, Gemma, OLMo 2) RMSNorm casts hidden states to float32 and its rotary
embedding computes inv_freq, angles and cos/sin in float32, and the eager attention of those
families, OPT and ViT takes the softmax in float32, all even in a float64 model.
`float64_faithful` replaces the first two forwards on the given instance by the same formulas
without the float32 casts, and those families run with attn_implementation="sdpa" (float64
throughout): in float64 the comparison then measures the formulas, not float32 rounding.
float32 runs the HF model untouched.
"""

from __future__ import annotations

import json
import os
import types

import numpy as np


def _rmsnorm64(self, x):
    import torch

    eps = getattr(self, "variance_epsilon", None) or self.eps
    weight = 1.0 + self.weight if self._offset else self.weight
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotary64(self, x, position_ids, layer_type=None):
    """HF's rotary module's forward in float64: the default inverse frequencies, or the scaled
    type's from transformers' own ROPE_INIT_FUNCTIONS recompiled to compute in float64
    (`rope_functions64`), at the sequence length HF's dynamic_rope_update would pass for this
    call (dynamic: the call's length past max_position_embeddings; longrope: the long factors
    past the original length); cos and sin times the type's attention factor."""
    import torch

    cfg = self.config
    params = cfg.rope_parameters if layer_type is None else cfg.rope_parameters[layer_type]  # Gemma 3: per kind
    kind = params.get("rope_type", "default")
    if kind == "default":
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", 1.0))  # GPT-NeoX, StableLM: part of each head
        inv_freq, factor = 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0
    else:
        seq_len = int(position_ids.max()) + 1
        if kind == "dynamic":
            seq_len = seq_len if seq_len > cfg.max_position_embeddings else None
        elif kind == "longrope":
            original = params["original_max_position_embeddings"]
            seq_len = original + 1 if seq_len > original else None
        else:
            seq_len = None
        inv_freq, factor = rope_functions64()[kind](cfg, None, seq_len=seq_len, layer_type=layer_type)
    freqs = position_ids[..., None].to(torch.float64) * inv_freq.to(torch.float64)
    if getattr(self, "_halves", False):  # GPT-OSS: one half
        emb = freqs
    elif type(self).__name__.startswith("Cohere"):  # Cohere: repeat_interleave, each frequency twice
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype)


_ROPE64: dict = {}


def rope_functions64() -> dict:
    """transformers' ROPE_INIT_FUNCTIONS with their float32 casts turned into float64 ones: the
    same source (inspect.getsource), `torch.float` / `torch.float32` / `.float()` replaced,
    compiled in the module's namespace. Built once; transformers' own are left as they are."""
    if not _ROPE64:
        import inspect
        import re
        import textwrap

        from transformers import modeling_rope_utils as mru

        space = dict(vars(mru))
        for kind, fn in mru.ROPE_INIT_FUNCTIONS.items():
            source = textwrap.dedent(inspect.getsource(fn))
            source = re.sub(r"torch\.float(32)?\b", "torch.float64", source).replace(".float()", ".double()")
            exec(compile(source, mru.__file__, "exec"), space)
            _ROPE64[kind] = space[fn.__name__]
    return _ROPE64


def _eager_softmax_in_the_query_dtype(model) -> None:
    """For families whose attention is eager only (Gemma 2: soft-capping, no SDPA): their module's
    eager_attention_forward, recompiled with the softmax taken in promote(query dtype, float32)
    instead of float32. Process-wide (the module looks the function up at call time), and the
    same computation for float32, bfloat16 and float16 queries: only float64 changes."""
    import inspect
    import sys
    import textwrap

    module = sys.modules[type(model).__module__]
    fn = module.eager_attention_forward
    if getattr(fn, "_float64_faithful", False):
        return
    source = textwrap.dedent(inspect.getsource(fn))
    old = "softmax(attn_weights, dim=-1, dtype=torch.float32)"
    assert source.count(old) == 1, f"{module.__name__}.eager_attention_forward changed: patch it anew"
    code = source.replace(old, "softmax(attn_weights, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32))")
    space = dict(vars(module))
    exec(compile(code, module.__file__, "exec"), space)
    space["eager_attention_forward"]._float64_faithful = True
    module.eager_attention_forward = space["eager_attention_forward"]




def attention_for(model_type: str | None, dtype: str) -> str:
    """The attention HF runs in a test: SDPA for a float64 model of a family computing in float32
    inside (its eager softmax is float32), where its classes have SDPA (GPT-OSS has not: its eager
    softmax, sinks included, is in the model's dtype); else eager."""
    import transformers

    from flax_blocks.checkpoints.family import FAMILIES

    if reference(model_type).sdpa:  # its eager path computes something else (Falcon's ALiBi twice)
        return "sdpa"
    if dtype != "float64" or not reference(model_type).float32_inside:
        return "eager"
    family = FAMILIES.get(model_type) if model_type else None
    cls = getattr(transformers, family.model_class, None) if family is not None else None
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def reference(model_type: str | None):
    """What the family's registration says of transformers' implementation
    (`flax_blocks.checkpoints.family.Reference`: float32 inside a float64 model, eager attention
    only, inputs_embeds scaled in the base model's forward); the defaults for an unknown type."""
    from flax_blocks.checkpoints.family import FAMILIES, Reference

    family = FAMILIES.get(model_type) if model_type else None
    return family.reference if family is not None else Reference()


def _cohere_norm64(self, x):
    import torch

    x = x - x.mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _cohere_rotary_in_the_query_dtype(model) -> None:
    """Cohere's apply_rotary_pos_emb casts q and k to float32 (process-wide: the module's function
    replaced by one computing in q's dtype, the same function for float32 models)."""
    import importlib

    modeling = importlib.import_module(type(model).__module__)

    def apply(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + modeling.rotate_half(q) * sin, k * cos + modeling.rotate_half(k) * sin

    modeling.apply_rotary_pos_emb = apply


def _sinusoids64(num_pos: int, dim: int):
    """GPT-J's create_sinusoidal_positions (sin then cos, dim / 2 frequencies of base 10000) in float64."""
    import torch

    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(num_pos, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat((torch.sin(angles), torch.cos(angles)), dim=1)


def float64_faithful(model):
    """Replace, on this instance only, the RMSNorm and rotary forwards that cast to float32
    (Gemma's RMSNorm, whose source scales by 1.0 + self.weight, keeps that offset); for
    eager-only families (`reference`), their eager attention's float32 softmax (process-wide, see
    _eager_softmax_in_the_query_dtype)."""
    import inspect

    if reference(getattr(model.config, "model_type", None)).eager_only:
        _eager_softmax_in_the_query_dtype(model)
    if getattr(model.config, "model_type", None) in ("cohere", "cohere2", "modernbert"):  # (ModernBERT: q.float())
        _cohere_rotary_in_the_query_dtype(model)
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RMSNorm"):
            m._offset = "1.0 + self.weight" in inspect.getsource(type(m).forward)
            m.forward = types.MethodType(_rmsnorm64, m)
        elif name in ("CohereLayerNorm", "Cohere2LayerNorm"):  # mean-subtracted, no bias, in float32
            m.forward = types.MethodType(_cohere_norm64, m)
        elif name == "GPTJRotaryEmbedding":  # its sin / cos table, built in float32 at init
            m.embed_positions = _sinusoids64(m.max_positions, m.pos_embd_dim)
        elif name.endswith("RotaryEmbedding"):
            m._halves = "emb = freqs\n" in inspect.getsource(type(m).forward)  # cos, sin of half a head (GPT-OSS)
            m.forward = types.MethodType(_rotary64, m)
        elif name.startswith("Deepseek") and name.endswith("TopkRouter"):
            m.forward = types.MethodType(_in_the_input_dtype(type(m)), m)
    if getattr(model.config, "model_type", None) == "deepseek_v2":
        _deepseek_v2_rotary64(model)
    return model


# The float32 casts of DeepSeek's routers (V2's softmax too), each taken out by _in_the_input_dtype
_ROUTER_CASTS = {"F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))":
                 "F.linear(hidden_states, self.weight)",
                 "router_logits.softmax(dim=-1, dtype=torch.float32)": "router_logits.softmax(dim=-1)"}


def _in_the_input_dtype(cls):
    """A DeepSeek router's forward: transformers' own source with its float32 casts (_ROUTER_CASTS)
    taken out, compiled in its module's namespace; fails if the logits' cast is no longer there."""
    import importlib
    import inspect
    import textwrap

    src = textwrap.dedent(inspect.getsource(cls.forward))
    first = next(iter(_ROUTER_CASTS))
    if src.count(first) != 1:
        raise AssertionError(f"{cls.__name__}.forward no longer computes its logits as {first}")
    for cast, plain in _ROUTER_CASTS.items():
        src = src.replace(cast, plain)
    namespace: dict = {}
    exec(src, vars(importlib.import_module(cls.__module__)), namespace)
    return namespace["forward"]


def _deepseek_v2_rotary64(model) -> None:
    """DeepSeek V2's rotary in float64: its embedding's complex freqs_cis from _rotary64's cos and
    sin (this instance), and apply_rotary_emb, which casts q and k to float32, computing in q's
    dtype (process-wide, the same function for float32 models, as _cohere_rotary_in_the_query_dtype)."""
    import importlib

    import torch

    def polar64(self, x, position_ids):
        cos, sin = _rotary64(self, x, position_ids)
        half = cos.shape[-1] // 2
        return torch.complex(cos[..., :half], sin[..., :half])

    def apply(xq, xk, freqs_cis):
        freqs_cis = freqs_cis.unsqueeze(1)
        def turn(t):
            return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2)) * freqs_cis).flatten(3)
        return turn(xq).type_as(xq), turn(xk).type_as(xk)

    for m in model.modules():
        if type(m).__name__ == "DeepseekV2RotaryEmbedding":
            m.forward = types.MethodType(polar64, m)
    importlib.import_module(type(model).__module__).apply_rotary_emb = apply


def embeddings_out_of_the_way(model):
    """Make the HF base model's output on inputs_embeds (ViT: pixel_values) that of its layers +
    final norm."""
    import torch

    with torch.no_grad():
        emb = getattr(model, "embeddings", None)
        if emb is not None and hasattr(emb, "patch_embeddings"):  # ViT: the hidden states pass as they are
            emb.forward = types.MethodType(lambda self, pixel_values, **kwargs: pixel_values, emb)
        elif emb is not None and hasattr(emb, "tok_embeddings"):  # ModernBERT: norm(inputs_embeds)
            emb.norm = torch.nn.Identity()
        elif emb is not None:  # BERT, RoBERTa, DistilBERT: inputs_embeds + (token type) + position, LayerNorm
            emb.position_embeddings.weight.zero_()
            if hasattr(emb, "token_type_embeddings"):
                emb.token_type_embeddings.weight.zero_()
            emb.LayerNorm = torch.nn.Identity()
        if hasattr(model, "wpe"):  # GPT-2: inputs_embeds + position
            model.wpe.weight.zero_()
        decoder = getattr(model, "decoder", None)
        if decoder is not None and hasattr(decoder, "embed_positions"):  # OPT: project_in(x) + position, project_out
            decoder.embed_positions.weight.zero_()
            decoder.project_in = decoder.project_out = None
    if reference(getattr(model.config, "model_type", None)).scales_inputs:
        _feed_the_first_layer(model)
    return model




def _feed_the_first_layer(model):
    """Hand layer 0 the inputs_embeds themselves, in place of inputs_embeds * sqrt(hidden_size):
    the comparison is then the stack's from the same layer-0 input."""
    box = {}

    def grab(module, args, kwargs):
        box["x"] = kwargs["inputs_embeds"]

    def put(module, args, kwargs):
        if args:
            return (box["x"], *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": box["x"]}

    model.register_forward_pre_hook(grab, with_kwargs=True)
    model.layers[0].register_forward_pre_hook(put, with_kwargs=True)




def hf_run(model, x: np.ndarray, ct: np.ndarray, keys: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(last hidden state, gradient of <output, ct> w.r.t. x) of an HF base model on
    inputs_embeds x (B, T, E); keys (B, T), True = real token, or None."""
    import torch

    xt = torch.tensor(x, requires_grad=True)
    mask = None if keys is None else torch.tensor(keys.astype(np.int64))
    name = "pixel_values" if getattr(model, "main_input_name", None) == "pixel_values" else "inputs_embeds"
    if getattr(model.config, "model_type", None) == "whisper":
        y = _whisper_encoder(model, xt)
    else:
        y = model(**{name: xt}, attention_mask=mask).last_hidden_state
    y.backward(torch.tensor(ct))
    return y.detach().numpy(), xt.grad.numpy()


def _whisper_encoder(model, xt):
    """The Whisper encoder's output with its layer 0 handed xt (B, T, E) in place of
    conv(mel) + positions: silent mel features of the length it insists on (2 x T frames) go
    in, and a hook swaps layer 0's input. It takes no attention mask (as HF's encoder)."""
    import torch

    encoder, cfg = model.get_encoder(), model.config

    def put(module, args, kwargs):
        return ((xt, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": xt})

    hook = encoder.layers[0].register_forward_pre_hook(put, with_kwargs=True)
    try:
        feats = torch.zeros(xt.shape[0], cfg.num_mel_bins, 2 * cfg.max_source_positions, dtype=xt.dtype)
        return encoder(input_features=feats).last_hidden_state
    finally:
        hook.remove()


def flax_runs(module, x: np.ndarray, ct: np.ndarray, keys: np.ndarray,
              cases: tuple[bool, ...] = (False, True)) -> dict[bool, tuple[np.ndarray, np.ndarray]]:
    """{masked: (output, gradient w.r.t. x)} of a Flax stack without (False) and with (True)
    key_mask=keys, as `cases` asks, in one jitted program."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(module)

    @jax.jit
    def run(state, x, ct, keys):
        model = nnx.merge(graphdef, state)
        out = {}
        for masked in cases:
            y, vjp = jax.vjp(lambda h, masked=masked: model(h, key_mask=keys if masked else None), x)
            out[masked] = (y, vjp(ct)[0])
        return out

    return jax.tree.map(np.asarray, run(state, jnp.asarray(x), jnp.asarray(ct), jnp.asarray(keys)))


def rel_at(a: np.ndarray, b: np.ndarray, keys: np.ndarray) -> float:
    """max|a - b| / max|b| over the real (keys True) positions."""
    a, b = a[keys], b[keys]
    return float(np.abs(a - b).max() / np.abs(b).max())


def load_hf(folder: str, dtype: str):
    """The HF base model of a save_pretrained folder, in `dtype`, attention as described above."""
    import torch
    import transformers

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    attn = attention_for(config.get("model_type"), dtype)
    model = transformers.AutoModel.from_pretrained(folder, dtype=getattr(torch, dtype), attn_implementation=attn,
                                                   experts_implementation="eager")  # (grouped_mm: no float64)
    model = embeddings_out_of_the_way(model.eval())
    return config, (float64_faithful(model) if dtype == "float64" else model)
