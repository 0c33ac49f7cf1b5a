"""Whisper (model_type whisper): an encoder-decoder on audio, whose two stacks load on their own
(part="stack" / "encoder" / "decoder"): pre-LN layers with torch's LayerNorm eps, no k_proj
bias (read as a zero one), the decoder's cross-attention to the encoder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..dialects import CLASSIC, Dialect, Rule, linear, norm, register_dialect
from ..family import DROPOUT, GENERATION, INIT, OUTSIDE_PART, Family, Read, read_activation, register

# Whisper's encoder: pre-LN, LayerNorms with torch's eps, GELU, biases everywhere but on k_proj
# (read as a zero k bias: exact, see Rule.zero); positions (sinusoidal embed_positions) and the
# two convolutions lie in its embeddings, outside the stack; it takes no attention mask. The
# decoder (cross-attention) is not read.
HF_WHISPER = Dialect(
    "hf-whisper", "Hugging Face Whisper encoder (encoder.layers.{i}.self_attn.q_proj.weight, no k_proj bias)",
    layer="encoder.layers.{i}.", final_norm="encoder.layer_norm",
    rules=(
        Rule("self_attn.in_proj_weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight"), split=("q", "kv", "kv")),
        Rule("self_attn.in_proj_bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
             split=("q", "kv", "kv"), zero=("self_attn.k_proj.bias",)),
        *linear("self_attn.out_proj", "self_attn.out_proj"),
        *norm("norm1", "self_attn_layer_norm"),
        *linear("linear1", "fc1"),
        *linear("linear2", "fc2"),
        *norm("norm2", "final_layer_norm"),
    ),
    settings={**CLASSIC, "norm": "pre", "causal": False, "layer_norm_eps": 1e-5},
    reads=("activation", "num_kv_heads"),
    outside=("the encoder's convolutions and positions (conv1, conv2, embed_positions) and the whole decoder "
             "(fb.from_hf(..., part='decoder') reads it)"),
    shared_by="Whisper's decoder (hf-whisper-decoder, in the same checkpoints)",
)
register_dialect(HF_WHISPER)

# Whisper's decoder: our Decoder (torch's TransformerDecoder layout): causal self-attention,
# cross-attention to the encoder's output (encoder_attn), MLP, each pre-LN; neither k_proj has a
# bias. Its token and position embeddings (embed_tokens, embed_positions) lie before layer 0.
HF_WHISPER_DECODER = Dialect(
    "hf-whisper-decoder", "Hugging Face Whisper decoder (decoder.layers.{i}.encoder_attn.q_proj.weight, ...)",
    layer="decoder.layers.{i}.", final_norm="decoder.layer_norm",
    rules=(
        *(r for attn, theirs in (("self_attn", "self_attn"), ("multihead_attn", "encoder_attn")) for r in (
            Rule(f"{attn}.in_proj_weight", tuple(f"{theirs}.{x}_proj.weight" for x in "qkv"), split=("q", "kv", "kv")),
            Rule(f"{attn}.in_proj_bias", tuple(f"{theirs}.{x}_proj.bias" for x in "qkv"), split=("q", "kv", "kv"),
                 zero=(f"{theirs}.k_proj.bias",)),
            *linear(f"{attn}.out_proj", f"{theirs}.out_proj"))),
        *norm("norm1", "self_attn_layer_norm"),
        *norm("norm2", "encoder_attn_layer_norm"),
        *linear("linear1", "fc1"),
        *linear("linear2", "fc2"),
        *norm("norm3", "final_layer_norm"),
    ),
    settings={**CLASSIC, "norm": "pre", "causal": True, "layer_norm_eps": 1e-5},
    reads=("activation", "num_kv_heads"),
    outside="the decoder's token and position embeddings (embed_tokens, embed_positions) and the whole encoder",
    shared_by="Whisper's encoder (hf-whisper, in the same checkpoints)",
    stack="Decoder",
)
register_dialect(HF_WHISPER_DECODER)


def _whisper(part: str) -> Callable[[Read], dict[str, Any]]:
    def read(c: Read) -> dict[str, Any]:
        """WhisperEncoder / WhisperDecoder: pre-LN, torch's LayerNorm eps, no k_proj bias."""
        heads = int(c[f"{part}_attention_heads"])
        if part == "encoder" and c["is_causal"]:
            c.refuse("is_causal", "Whisper's encoder is read as bidirectional")
        if part == "decoder" and c["is_causal"] is False:
            c.refuse("is_causal", "a bidirectional Whisper decoder: the blocks' Decoder is causal")
        return {"d_model": int(c["d_model"]), "num_heads": heads, "d_ff": int(c[f"{part}_ffn_dim"]),
                "num_layers": int(c[f"{part}_layers"]), "dropout": 0.0, "num_kv_heads": None,
                "activation": read_activation(c, "activation_function"), "final_norm": True}
    read.__doc__ = f"Whisper's {part}: pre-LN, torch's LayerNorm eps, no k_proj bias."
    return read


WHISPER_READS = {"d_model": 384, "encoder_layers": 4, "encoder_attention_heads": 6, "encoder_ffn_dim": 1536,
                  "decoder_layers": 4, "decoder_attention_heads": 6, "decoder_ffn_dim": 1536,
                  "activation_function": "gelu", "is_causal": None}
WHISPER_INERT = {
    **{k: DROPOUT for k in ("dropout", "attention_dropout", "activation_dropout", "encoder_layerdrop",
                             "decoder_layerdrop")},
    "init_std": INIT, "vocab_size": OUTSIDE_PART + " (the decoder's embeddings)",
    **{k: OUTSIDE_PART + " (the convolutions, positions and embeddings around the stacks)" for k in (
        "num_mel_bins", "scale_embedding", "max_source_positions", "max_target_positions")},
    **{k: "SpecAugment masking, in training only" for k in (
        "apply_spec_augment", "mask_time_prob", "mask_time_length", "mask_time_min_masks", "mask_feature_prob",
        "mask_feature_length", "mask_feature_min_masks")},
    **{k: "the audio-classification head, not loaded" for k in ("use_weighted_layer_sum", "classifier_proj_size")},
    "median_filter_width": "word-timestamp alignment in generation", "tie_word_embeddings": "the decoder's head",
    "max_length": GENERATION,
}
_STACKS = "an encoder-decoder on audio: convolutions over mel features before the encoder, the decoder's " \
          "cross-attention to it; read the stacks with part='stack' / 'encoder' / 'decoder'"
register(parts={
    part: Family("whisper", "WhisperConfig", f"Whisper{part.capitalize()}", dialect, WHISPER_READS, _whisper(part),
                 WHISPER_INERT, aliases={"num_key_value_heads": "encoder_attention_heads",
                                         "num_attention_heads": "encoder_attention_heads", "hidden_size": "d_model",
                                         "num_hidden_layers": "encoder_layers"}, stack_only=_STACKS)
    for part, dialect in (("encoder", "hf-whisper"), ("decoder", "hf-whisper-decoder"))})
