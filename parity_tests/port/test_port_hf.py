"""The port checker on real transformers models ported by hand as porters write them
(parity_tests/port/hf_zoo.py): each correct port passes in float64 with no rules and no
adapters, torch's float32 islands named; each planted mistake is located at its module and
named; what a new user tripped on (Conv1D, no weights copied, a renamed port, `match` on
dropout, cut paths) is said plainly; nothing is left behind."""

from __future__ import annotations

import copy
import sys

import jax
import numpy as np
import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as F
from flax import nnx

from parity_tests.port import PortError, compare, copy_weights
from parity_tests.port import hf_zoo as Z
from parity_tests.port.gradients import FLOOR32

pytest.importorskip("transformers")

FAMILIES = ["gpt2", "bert", "llama", "qwen2", "gpt_neox"]
ISLANDS = {"gpt2": set(), "bert": set(), "llama": {"LlamaRMSNorm", "LlamaRotaryEmbedding"},
           "qwen2": {"Qwen2RMSNorm", "Qwen2RotaryEmbedding"}, "gpt_neox": {"GPTNeoXRotaryEmbedding"}}


pytestmark = pytest.mark.xdist_group("port_hf")  # its module fixtures built by one worker (--dist loadgroup)

@pytest.fixture(scope="module")
def models():
    """The transformers models, built once each (random weights, tiny configs)."""
    cache: dict[tuple, torch.nn.Module] = {}

    def get(name: str, attn: str = "sdpa") -> torch.nn.Module:
        if (name, attn) not in cache:
            cache[(name, attn)] = Z.torch_model(name, attn=attn)
        return cache[(name, attn)]
    return get


def ported(tm, name: str, rules=None, **mistakes):
    fm = Z.port(name, tm.config, **mistakes)
    copy_weights(tm, fm, rules=rules)
    return fm


@pytest.mark.parametrize("name", FAMILIES)
def test_a_correct_port_passes_in_float64_with_no_rules_and_no_adapters(models, name):
    tm = models(name)
    fm = Z.port(name, tm.config)
    pairs = copy_weights(tm, fm)  # no rules: GPT-2's Conv1D, LLaMA's hand-written RMSNorm known
    assert {t for t, f, _ in pairs if f is not None} == {n for n, _ in tm.named_parameters()}
    report = compare(tm, fm, **Z.inputs(name))
    assert report.ok, str(report)
    assert report.grads and all(r.local is not None for r in report.rows), str(report)
    assert {line.split()[0] for line in report.islands} == ISLANDS[name], report.islands
    if ISLANDS[name]:  # judged at float32's floor there, float64's elsewhere
        assert "judged at float32's floor" in str(report)
        assert any(r.tol_local == 1e-12 for r in report.rows) and any(r.tol_local >= FLOOR32 for r in report.rows)
        assert max(r.accumulated for r in report.rows) > 1e-11  # torch's float32 rounding is really there
    else:
        assert max(r.accumulated for r in report.rows) <= 1e-12
    text = str(report)  # the table prints full paths: no two modules share a label
    assert all(f"\n{r.torch_path} " in text for r in report.rows if r.torch_path), text


def test_eager_attention_softmax_in_float32_is_an_island_and_a_mistake_is_still_named(models):
    """HF's eager attention computes its softmax in float32 (LLaMA): the attention module is
    named an island; the correct port passes and a tiled GQA is named through repeat_kv."""
    tm = models("llama", "eager")
    report = compare(tm, ported(tm, "llama"), **Z.inputs("llama"), grads=False)
    assert report.ok and any(line.startswith("LlamaAttention computes in float32") for line in report.islands)
    d = compare(tm, ported(tm, "llama", gqa="tile"), **Z.inputs("llama"), grads=False).first_divergence
    assert d.parent == "layers.0.self_attn" and "tiles the key / value heads" in d.explanation, d


# (family, planted mistake, copy rules, the module it must be located at (the divergence's
# torch_path or parent), words of its explanation); each planted in every layer
C_PROJ = [(r"h\.0\.attn\.c_proj\.weight", "h.0.attn.c_proj.kernel", "transpose")]
MISTAKES = [
    ("gpt2", dict(exact_gelu=True), None, "h.0.mlp", "exact GELU where torch computes the tanh approximation"),
    ("gpt2", dict(scale="d"), None, "h.0.attn", "by 1/head_dim where torch uses 1/sqrt(head_dim)"),
    ("gpt2", dict(scale="none"), None, "h.0.attn", "by 1 (no scale)"),
    ("gpt2", dict(causal_offset=1), None, "h.0.attn", "each query also sees the next key"),
    ("gpt2", dict(causal_offset=-1), None, "h.0.attn", "no query sees its own key"),
    ("gpt2", dict(split="heads-last"), None, "h.0.attn", "(head_dim, heads) where torch splits (heads, head_dim)"),
    ("gpt2", dict(split="heads-last-both"), None, "h.0.attn", "(and merges them back the same way)"),
    ("gpt2", dict(pos_offset=2), None, "wpe", "other integers than torch gives it"),
    ("gpt2", dict(skip_ln_f=True), None, "ln_f", "never calls ln_f"),
    ("gpt2", dict(no_wpe=True), None, "wpe", "never calls wpe"),
    ("gpt2", dict(), C_PROJ, "h.0.attn.c_proj", "holds torch's h.0.attn.c_proj.weight transposed"),
    ("bert", dict(tanh_gelu=True), None, "encoder.layer.0.intermediate",
     "tanh approximation where torch computes exact GELU"),
    ("bert", dict(eps=1e-6), None, "embeddings.LayerNorm", "eps=1e-06 where torch uses eps=1e-12"),
    ("bert", dict(mask_inverted=True), None, "encoder.layer.0.attention.self", "opposite sense"),
    ("bert", dict(no_token_type=True), None, "embeddings.token_type_embeddings",
     "never calls embeddings.token_type_embeddings"),
    ("llama", dict(rope="interleaved"), None, "layers.0.self_attn", "rotates adjacent feature pairs"),
    ("llama", dict(rope="interleaved-tables"), None, "", "holds the frequencies interleaved"),
    ("llama", dict(gqa="tile"), None, "layers.0.self_attn", "tiles the key / value heads"),
    ("llama", dict(norm="eps-outside"), None, "layers.0.input_layernorm", "adds eps outside the square root"),
    ("llama", dict(norm="one-plus"), None, "layers.0.input_layernorm", "scales by (1 + w) where torch scales by w"),
    ("llama", dict(norm="layernorm"), None, "layers.0.input_layernorm", "LayerNorm (mean subtracted) where torch uses"),
    ("llama", dict(eps=1e-6), None, "layers.0.input_layernorm", "eps=1e-06 where torch uses eps=1e-05"),
    ("llama", dict(act="gelu"), None, "layers.0.mlp", "tanh GELU (jax.nn.gelu's default) where torch computes silu"),
    ("llama", dict(mask_in_root=True, causal_offset=1), None, "", "a causal mask shifted by one"),
    ("gpt_neox", dict(rope="interleaved"), None, "layers.0.attention", "rotates adjacent feature pairs"),
    ("gpt_neox", dict(rope="last"), None, "layers.0.attention", "rotates the last rotary_dim features"),
    # the same mistakes in ports written another way: HF's old Flax masks (-1e9 future, -1e4
    # padding), a boolean padding mask, norms and softmax in float32 as HF's code
    ("gpt2", dict(mask_style="additive", causal_offset=-1), None, "h.0.attn", "no query sees its own key"),
    # a causal model's padding read inverted: the replay flips the padding part and keeps the causal one
    ("gpt2", dict(mask_style="additive", mask_inverted=True), None, "h.0.attn", "opposite sense"),
    ("bert", dict(mask_style="bool", mask_inverted=True), None, "encoder.layer.0.attention.self", "opposite sense"),
    ("llama", dict(upcast=True, gqa="tile"), None, "layers.0.self_attn", "tiles the key / value heads"),
    ("gpt_neox", dict(sequential=True), None, "layers.0", "a parallel residual"),
]


@pytest.mark.parametrize("name,mistake,rules,where,says", MISTAKES,
                         ids=[f"{m[0]}-{'-'.join(f'{k}={v}' for k, v in m[1].items()) or 'c_proj'}" for m in MISTAKES])
def test_a_planted_mistake_is_located_and_named(models, name, mistake, rules, where, says):
    tm = models(name)
    report = compare(tm, ported(tm, name, rules, **mistake), **Z.inputs(name), grads=False)
    d = report.first_divergence
    assert d is not None and where in (d.torch_path, d.parent), str(report)
    assert says in d.explanation, d.explanation


def test_a_causal_offset_is_named_where_hf_masks_by_is_causal(models):
    """No attention mask: HF's sdpa path hands scaled_dot_product_attention is_causal=True
    and no mask at all; the shifted diagonal is named all the same."""
    tm = models("gpt2")
    ids = Z.inputs("gpt2")["input_ids"]
    d = compare(tm, ported(tm, "gpt2", causal_offset=1), ids, grads=False).first_divergence
    assert d.parent == "h.0.attn" and "each query also sees the next key" in d.explanation, d


@pytest.mark.parametrize("name,variation", [("gpt2", dict(mask_style="additive")), ("bert", dict(mask_style="bool")),
                                            ("llama", dict(mask_in_root=True))])
def test_a_correct_port_written_another_way_passes(models, name, variation):
    """A port's own ways: HF's old Flax masks, a boolean padding mask, the model building its
    layers' (B, 1, T, T) mask itself; with padding and without an attention mask (HF's sdpa
    then masks by is_causal)."""
    tm = models(name)
    fm = ported(tm, name, **variation)
    assert compare(tm, fm, **Z.inputs(name), grads=False).ok
    if name != "gpt2":  # GPT-2 without a mask: test_a_causal_offset_is_named_where_hf_masks_by_is_causal
        assert compare(tm, fm, Z.inputs(name)["input_ids"], grads=False).ok


def test_a_port_computing_in_float32_as_hf_does_passes_with_its_islands_named(models):
    """LLaMA's norms and softmax computed in float32 in the port too, as HF's code writes
    them: against HF's sdpa attention (float64 there) the port's attention is named a float32
    island of the port, and judged at float32's floor with its gradients."""
    tm = models("llama")
    report = compare(tm, ported(tm, "llama", upcast=True), **Z.inputs("llama"))
    assert report.ok, str(report)
    assert any(line.startswith("FlaxLlamaAttention computes in float32 in the port") for line in report.islands)


def test_a_causal_offset_in_the_models_own_mask_is_named(models):
    tm = models("llama")
    d = compare(tm, ported(tm, "llama", mask_in_root=True, causal_offset=-1),
                Z.inputs("llama")["input_ids"], grads=False).first_divergence
    assert d is not None and "shifted by one" in d.explanation, d


def test_the_padding_idx_row_is_named_and_not_compared(models):
    """BertModel's word embeddings keep the padding_idx row (0) out of the gradient; the port's
    nnx.Embed cannot: that row is said and left out, the rest compared."""
    tm = models("bert")
    inputs = Z.inputs("bert")
    inputs["input_ids"][1, -3:] = 0  # the padding tokens are the pad id
    report = compare(tm, ported(tm, "bert"), **inputs)
    assert report.ok, str(report)
    assert any("row 0 (padding_idx): torch gives it no gradient" in n for n in report.notes), report.notes


# What a new user tripped on -------------------------------------------------------------


def test_a_torch_model_left_in_train_mode_is_named(models):
    """transformers builds a model from a config in train mode: its dropout draws, and the
    check says so before anything else."""
    tm = copy.deepcopy(models("bert")).train()
    d = compare(tm, ported(tm, "bert"), **Z.inputs("bert"), grads=False).first_divergence
    assert d is not None and "torch's model is in train mode with dropout on" in d.explanation, d


def test_forgetting_copy_weights_is_named(models):
    tm = models("gpt2")
    d = compare(tm, Z.port("gpt2", tm.config), **Z.inputs("gpt2"), grads=False).first_divergence
    assert d is not None and "none of the port's" in d.explanation and "copy_weights" in d.explanation, d


def test_a_renamed_port_gets_the_rename_and_near_matches_each_problem_once(models):
    """GPT-2's `h` ported as `blocks`: one line names the rename, each module its nearest
    counterpart, and no parameter is listed again as uncopied."""
    tm = models("gpt2")
    fm = Z.port("gpt2", tm.config)
    fm.blocks = fm.h
    del fm.h
    with pytest.raises(PortError) as e:
        copy_weights(tm, fm)
    problems = e.value.problems
    assert "torch 'h' is flax 'blocks' in 12 modules" in problems[0], problems[0]
    assert any("nearest flax module: blocks.0.attn.c_attn" in p for p in problems), problems
    assert not any("is not copied anywhere" in p or "filled from no torch parameter" in p for p in problems), problems
    assert len(problems) == 1 + len({p.split(" (")[0] for p in problems[1:]})  # each module once


def test_match_globs_skip_parameterless_modules():
    """A port whose names differ, paired by `match`: torch's dropout modules match the glob
    too, but only modules with parameters pair with modules with parameters."""
    class TorchNet(tnn.Module):
        def __init__(self):
            super().__init__()
            self.layers = tnn.ModuleList([tnn.ModuleDict(dict(fc=tnn.Linear(6, 6), drop=tnn.Dropout(0.1)))
                                          for _ in range(2)])

        def forward(self, x):
            for layer in self.layers:
                x = layer["drop"](torch.tanh(layer["fc"](x)))
            return x

    class FlaxNet(nnx.Module):
        def __init__(self):
            self.fc = nnx.List([nnx.Linear(6, 6, rngs=nnx.Rngs(i)) for i in range(2)])

        def __call__(self, x):
            for fc in self.fc:
                x = jax.numpy.tanh(fc(x))
            return x

    tm, fm = TorchNet().eval(), FlaxNet()
    copy_weights(tm, fm, rules=[(r"layers\.(\d)\.fc\.(weight)", r"fc.\1.kernel", "transpose"),
                                (r"layers\.(\d)\.fc\.(bias)", r"fc.\1.bias", "identity")])
    report = compare(tm, fm, np.random.default_rng(0).standard_normal((2, 6)), match={"layers.*": "fc.*"},
                     rules=[(r"layers\.(\d)\.fc\.(weight)", r"fc.\1.kernel", "transpose"),
                            (r"layers\.(\d)\.fc\.(bias)", r"fc.\1.bias", "identity")])
    assert report.ok, str(report)
    assert [(r.torch_path, r.flax_path) for r in report.rows][1:] == [("layers.0.fc", "fc.0"), ("layers.1.fc", "fc.1")]


# Every catalogue entry named -------------------------------------------------------------


def test_a_gemma_style_norm_ported_without_its_one_plus_is_named():
    """Gemma's RMSNorm scales by (1 + w) (transformers' own module, by behaviour); a port on
    nnx.RMSNorm copies w as the scale."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    torch.manual_seed(0)
    tm = tnn.Sequential(tnn.Linear(8, 12), GemmaRMSNorm(12, eps=1e-6))
    with torch.no_grad():
        tm[1].weight.normal_(0, 0.1)
    fm = nnx.Sequential(nnx.Linear(8, 12, rngs=nnx.Rngs(0)), nnx.RMSNorm(12, epsilon=1e-6, rngs=nnx.Rngs(0)))
    copy_weights(tm, fm)
    d = compare(tm, fm, np.random.default_rng(0).standard_normal((2, 8)), grads=False).first_divergence
    assert d.torch_path == "1" and "scales by w where torch scales by (1 + w)" in d.explanation, d


def test_rmsnorm_for_layernorm_in_torch_functions_is_named():
    class TorchLN(tnn.Module):
        def __init__(self):
            super().__init__()
            self.fc = tnn.Linear(8, 8)

        def forward(self, x):
            return self.fc(F.layer_norm(x, (8,)))

    class FlaxRMS(nnx.Module):
        def __init__(self):
            self.fc = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.fc(x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5))

    tm, fm = TorchLN(), FlaxRMS()
    copy_weights(tm, fm)
    d = compare(tm, fm, np.random.default_rng(0).standard_normal((2, 8)) + 1.0, grads=False).first_divergence
    assert "RMSNorm (no mean subtracted) where torch uses LayerNorm" in d.explanation, d


def test_fast_variance_is_named_where_the_mean_dwarfs_the_spread(models):
    """nnx.LayerNorm's use_fast_variance=True (E[x^2] - E[x]^2) on rows whose mean is far
    above their spread: BERT's word embeddings shifted by 10 (std 0.02). The exact variance is
    equal there within 1e-12; the fast one is not, and is named."""
    tm = copy.deepcopy(models("bert"))
    with torch.no_grad():
        tm.embeddings.word_embeddings.weight += 10.0
    assert compare(tm, ported(tm, "bert"), **Z.inputs("bert"), grads=False).ok
    d = compare(tm, ported(tm, "bert", fast_variance=True), **Z.inputs("bert"), grads=False).first_divergence
    assert d.torch_path == "embeddings.LayerNorm" and "E[x^2] - E[x]^2" in d.explanation, d


class _TorchConv(tnn.Module):
    def __init__(self):
        super().__init__()
        self.conv = tnn.Conv1d(4, 6, 3, padding=1)  # 'SAME'

    def forward(self, x):  # (B, C, T)
        return self.conv(x)


class _FlaxConv(nnx.Module):
    def __init__(self):
        self.conv = nnx.Conv(4, 6, (3,), padding=((2, 0),), rngs=nnx.Rngs(0))  # the mistake: causal

    def __call__(self, x):  # (B, C, T), as torch's
        return jax.numpy.moveaxis(self.conv(jax.numpy.moveaxis(x, 1, -1)), -1, 1)


def test_conv_padding_is_named():
    torch.manual_seed(0)
    tm, fm = _TorchConv(), _FlaxConv()
    copy_weights(tm, fm)
    d = compare(tm, fm, np.random.default_rng(0).standard_normal((2, 4, 9)), grads=False).first_divergence
    assert d.torch_path == "conv" and "pads causally (k - 1 on the left)" in d.explanation, d


@pytest.mark.parametrize("torch_act,flax_act,says", [
    (F.gelu, jax.nn.silu, "computes silu where torch computes gelu"),
    (F.silu, lambda a: jax.nn.gelu(a, approximate=False), "computes gelu where torch computes silu"),
    (F.relu, lambda a: jax.nn.gelu(a, approximate=False), "computes gelu where torch computes relu"),
    (F.relu, jax.nn.gelu, "computes tanh GELU (jax.nn.gelu's default) where torch computes relu"),
    (F.gelu, jax.nn.relu, "computes relu where torch computes gelu")])
def test_an_activation_swapped_in_torch_functions_is_named(torch_act, flax_act, says):
    class TorchMLP(tnn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = tnn.Linear(6, 10), tnn.Linear(10, 6)

        def forward(self, x):
            return self.fc2(torch_act(self.fc1(x)))

    class FlaxMLP(nnx.Module):
        def __init__(self):
            self.fc1, self.fc2 = nnx.Linear(6, 10, rngs=nnx.Rngs(0)), nnx.Linear(10, 6, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.fc2(flax_act(self.fc1(x)))

    torch.manual_seed(0)
    tm, fm = TorchMLP(), FlaxMLP()
    copy_weights(tm, fm)
    d = compare(tm, fm, np.random.default_rng(0).standard_normal((3, 6)), grads=False).first_divergence
    assert d.torch_path == "fc2" and says in d.explanation, d


def test_a_square_kernel_used_transposed_in_the_ports_code_is_named():
    """The kernel holds torch's weight as copied (a rule said identity), and the port's own
    code multiplies by it the other way round."""
    class MyLinear(nnx.Module):
        def __init__(self):
            self.weight = nnx.Param(jax.numpy.zeros((5, 5)))
            self.bias = nnx.Param(jax.numpy.zeros((5,)))

        def __call__(self, x):
            return x @ self.weight[...] + self.bias[...]  # torch computes x @ weight.T + bias

    torch.manual_seed(0)
    tm, fm = tnn.Linear(5, 5), MyLinear()
    copy_weights(tm, fm, rules=[("weight", "weight", "identity")])
    d = compare(tm, fm, np.random.default_rng(0).standard_normal((2, 5)), grads=False).first_divergence
    assert "uses weight's square kernel transposed" in d.explanation, d


def test_weights_changed_after_copying_are_named(models):
    tm = models("bert")
    fm = ported(tm, "bert")
    fm.encoder.layer[1].output.dense.kernel[...] *= 1.01
    d = compare(tm, fm, **Z.inputs("bert"), grads=False).first_divergence
    assert d.torch_path == "encoder.layer.1.output.dense" and "do not hold torch's values" in d.explanation, d


# float32 ---------------------------------------------------------------------------------


def test_float32_passes_a_deep_correct_port_whose_error_is_above_torchs_own_noise():
    """A chaotic 24-layer tanh MLP (gain 2): torch's own float32 noise reaches 1e-5, and the
    port's error at some modules lies between once and ten times that noise and above the
    1e-6 floor: the check passes only with its ten-fold margin."""
    torch.manual_seed(0)
    lins = [tnn.Linear(32, 32) for _ in range(24)]
    for lin in lins:
        tnn.init.normal_(lin.weight, std=2.0 / 32 ** 0.5)
    tm = tnn.Sequential(*[m for lin in lins for m in (lin, tnn.Tanh())])
    fm = nnx.Sequential(*[m for i in range(24) for m in (nnx.Linear(32, 32, rngs=nnx.Rngs(i)), jax.numpy.tanh)])
    copy_weights(tm, fm)
    report = compare(tm, fm, np.random.default_rng(0).standard_normal((4, 32)), dtype="float32")
    assert report.ok, str(report)
    above = [r for r in report.rows if r.accumulated > max(r.tol / 10, FLOOR32)]
    grads_above = [r for r in report.rows if r.grad is not None and r.grad > max(r.grad_tol / 10, FLOOR32)]
    assert above and grads_above, str(report)  # would fail at 1x torch's noise


# Nothing left behind ---------------------------------------------------------------------


def test_nothing_is_left_behind_after_explaining_real_models(models):
    """Explanations replace HF modules' forwards, transpose parameters, patch HF's
    apply_rotary_pos_emb and swap torch's functions in a torch function mode; the float64 run
    watches dtypes in another and x64 is on for the call: all undone (the two explanations
    below try every mistake of the catalogue before theirs)."""
    tm = models("llama")
    fm = ported(tm, "llama", norm="eps-outside")
    llama = sys.modules[type(tm.layers[0].self_attn).__module__]
    before = {k: v.clone() for k, v in tm.state_dict().items()}
    rope, sdpa, matmul, view = llama.apply_rotary_pos_emb, F.scaled_dot_product_attention, torch.matmul, \
        torch.Tensor.view
    x64 = jax.config.jax_enable_x64
    assert "eps outside" in compare(tm, fm, **Z.inputs("llama"), grads=False).first_divergence.explanation
    assert "adjacent feature pairs" in compare(tm, ported(tm, "llama", rope="interleaved"), **Z.inputs("llama"),
                                               grads=False).first_divergence.explanation
    assert all("forward" not in vars(m) for m in tm.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in tm.modules())
    assert all(torch.equal(before[k], v) for k, v in tm.state_dict().items())
    assert next(tm.parameters()).dtype == torch.float32 and not tm.training
    assert (llama.apply_rotary_pos_emb, F.scaled_dot_product_attention, torch.matmul, torch.Tensor.view) == \
        (rope, sdpa, matmul, view)
    assert not torch._C._is_torch_function_mode_enabled()
    assert jax.config.jax_enable_x64 == x64
    assert fm.layers[0].self_attn.q_proj.kernel[...].dtype == jax.numpy.float32
