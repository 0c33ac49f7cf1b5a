"""The port checker on transformers models it was not tuned on (parity_tests/port/hf_zoo_more.py):
each correct port passes in float64 with no rules, no adapters and no wrapper (GPT-J's second
parameter is its cache; ViT takes pixel_values, Whisper input_features), torch's float32
constants made at init named as islands; each planted mistake is located at its module and
named by a replay that reproduces it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from parity_tests.port import compare, copy_weights
from parity_tests.port import hf_zoo_more as Z
from parity_tests.port.gradients import FLOOR32
from parity_tests.port.side_by_side import _tolerances

pytest.importorskip("transformers")

# model -> [(planted mistake, the module it must be located at (torch_path or parent), words)]
ZOO = {
    "gptj": [(dict(rotary="halves"), "h.0.attn", "rotates halves (i, i + D/2: HF's rotate_half) where torch rotates "
                                                 "adjacent"),
             (dict(sequential=True), "h.0", "runs a parallel block sequentially"),
             (dict(pos_offset=1), "rotary_emb", "positions off by one")],
    "phi": [(dict(rotary="neighbours"), "layers.0.self_attn", "rotates adjacent feature pairs"),
            (dict(sequential=True), "layers.0", "runs a parallel block sequentially"),
            (dict(exact_gelu=True), "layers.0.mlp", "exact GELU where torch computes the tanh approximation")],
    "falcon": [(dict(rotary="neighbours"), "h.0.self_attention", "rotates adjacent feature pairs"),
               (dict(one_norm=True), "h.0", "never calls h.0.ln_mlp"),
               (dict(eps=1e-6), "h.0.ln_attn", "eps=1e-06 where torch uses eps=1e-05")],
    "mistral": [(dict(gqa="tile"), "layers.0.self_attn", "tiles the key / value heads"),
                (dict(norm="one-plus"), "layers.0.input_layernorm", "scales by (1 + w) where torch scales by w"),
                (dict(act="gelu"), "layers.0.mlp", "where torch computes silu")],
    "gemma2": [(dict(plain_w=True), "layers.0.input_layernorm", "scales by w where torch scales by (1 + w)"),
               (dict(head_dim_scale=True), "layers.0.self_attn", "where torch scales by 1/sqrt(query_pre_attn_scalar)"),
               (dict(exact_gelu=True), "layers.0.mlp", "exact GELU where torch computes the tanh approximation")],
    "vit": [(dict(tanh_gelu=True), "layers.0.mlp", "tanh approximation where torch computes exact GELU"),
            (dict(eps=1e-6), "layers.0.layernorm_before", "eps=1e-06 where torch uses eps=1e-12"),
            (dict(parallel=True), "layers.0", "leaves out layers.0.attention's output")],
    "whisper": [(dict(causal_conv=True), "conv1", "pads causally (k - 1 on the left)"),
                (dict(tanh_gelu=True), "layers.0", "tanh approximation where torch computes exact GELU"),
                (dict(eps=1e-6), "layers.0.self_attn_layer_norm", "eps=1e-06 where torch uses eps=1e-05")],
    "t5": [(dict(scaled=True), "encoder.block.0.layer.0.SelfAttention", "where torch does not scale them"),
           (dict(gelu=True), "encoder.block.0.layer.1.DenseReluDense", "where torch computes relu"),
           (dict(eps=1e-5), "encoder.block.0.layer.0.layer_norm", "eps=1e-05 where torch uses eps=1e-06")],
    "qwen3": [(dict(no_qk_norm=True), "layers.0.self_attn.q_norm", "never calls layers.0.self_attn.q_norm"),
              (dict(eps=1e-5), "layers.0.input_layernorm", "eps=1e-05 where torch uses eps=1e-06"),
              (dict(act="gelu"), "layers.0.mlp", "where torch computes silu")],
    "gpt_bigcode": [(dict(scale="d"), "h.0.attn", "by 1/head_dim where torch uses 1/sqrt(head_dim)"),
                    (dict(causal_offset=1), "h.0.attn", "each query also sees the next key"),
                    (dict(exact_gelu=True), "h.0.mlp", "exact GELU where torch computes the tanh approximation")],
}
INIT_TABLES = {"gptj": "GPTJRotaryEmbedding holds embed_positions, made at init: torch's `rotary_emb` table was "
                       "computed in float32 at init"}


@pytest.mark.parametrize("name", list(ZOO))
def test_a_port_the_checker_was_not_tuned_on(name):
    """The correct port passes (GPT-J with its gradients); every planted mistake is located
    and named (one summary of what was not)."""
    tm = Z.torch_model(name)
    fm = Z.port(name, tm.config)
    copy_weights(tm, fm)
    report = compare(tm, fm, **Z.inputs(name), grads=name == "gptj")
    assert report.ok, str(report)
    if name in INIT_TABLES:
        assert any(line.startswith(INIT_TABLES[name]) for line in report.islands), report.islands
        assert report.grads and max(r.accumulated for r in report.rows) > 1e-11  # float32's rounding is there
    wrong = []
    for mistake, where, says in ZOO[name]:
        bad = Z.port(name, tm.config, **mistake)
        copy_weights(tm, bad)
        d = compare(tm, bad, **Z.inputs(name), grads=False).first_divergence
        if d is None or where not in (d.torch_path, d.parent) or says not in d.explanation:
            wrong.append(f"{mistake}: {d}")
    assert not wrong, "\n".join(wrong)


def test_positional_inputs_go_to_torch_by_the_ports_names():
    """GPT-J's forward is (input_ids, cache, attention_mask, ...); the port's call is
    (input_ids, attention_mask): the mask given positionally reaches torch's attention_mask."""
    tm = Z.torch_model("gptj")
    fm = Z.port("gptj", tm.config, rotary="halves")
    copy_weights(tm, fm)
    x = Z.inputs("gptj")
    d = compare(tm, fm, x["input_ids"], x["attention_mask"], grads=False).first_divergence
    assert d is not None and "rotates halves" in d.explanation, d


def test_float32_tolerances_are_ten_times_torchs_own_noise():
    """float32: each module may differ from torch by ten times torch's own float32 noise on
    what it gives and on what it is given (at least 1e-6); float64 with an island upstream:
    ten times the noise it carries."""
    t = SimpleNamespace(path="fc", index=0)
    runs = SimpleNamespace(dtype="float32", noise={("fc", 0): (3e-6, 5e-6)}, constants=[])
    assert _tolerances(runs, t, False) == pytest.approx((3e-5, 5e-5, 3e-5))
    runs.noise = {("fc", 0): (1e-8, 2e-8)}
    assert _tolerances(runs, t, False) == (FLOOR32, FLOOR32, FLOOR32)
    runs.dtype, runs.noise = "float64", {("fc", 0): (3e-7, 4e-7)}
    assert _tolerances(runs, t, False) == pytest.approx((3e-6, 4e-6, 1e-12))
