"""The port checker (parity_tests.port) on a zoo of ports made of none of our blocks
(parity_tests/port/zoo.py): correct ports equal in float64, planted mistakes located at their
module and named, strict weight copies, refusals, and nothing left changed."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as F
from flax import nnx

from parity_tests.port import PortError, compare, copy_weights, plan
from parity_tests.port import zoo as Z
from parity_tests.port.__main__ import main


@pytest.mark.parametrize("name", list(Z.ZOO))
def test_a_correct_port_is_equal_in_float64_with_gradients(name):
    tm, fm = Z.pair(name)
    report = compare(tm, fm, *Z.inputs(name))
    assert report.ok, str(report)
    assert report.output_error <= 1e-12
    assert all(r.local is not None and r.local <= 1e-12 for r in report.rows), str(report)
    assert report.grads and max(report.grads.values()) <= 1e-12, report.grads
    assert len(report.grads) == sum(isinstance(v, nnx.Param) for _, v in nnx.iter_graph(fm))


# (zoo member, planted mistake, the module it must be located at, kind, words of the explanation);
# the mixer's tanh GELU is the example below, eps mistakes sit in three members
MISTAKES = [
    ("gpt", dict(tanh_gelu_layer=1), "blocks.1.mlp.fc2", "between", "tanh approximation"),
    ("gpt", dict(split="heads-last"), "blocks.0.attn.proj", "between", "(head_dim, heads)"),
    ("gpt", dict(scale="d"), "blocks.0.attn.proj", "between", "softmax scale"),
    ("gpt", dict(mask="inverted"), "blocks.0.attn.proj", "between", "opposite sense"),
    ("mha", dict(mask="inverted"), "attn", "inside", "padding mask in the opposite sense"),
    ("vit", dict(eps_layer=1), "blocks.1.ln1", "inside", "eps=1e-06 where torch uses eps=1e-05"),
    ("t5", dict(scale_layer=0), "layers.0.o", "between", "extra 1/sqrt(8)"),
    ("mixer", dict(pad_layer=0), "blocks.0.conv", "between", "pads the other side"),
    ("mlpmixer", dict(default_eps_layer=1), "layers.1.norm1", "inside", "eps=1e-06 where torch uses eps=1e-05"),
    ("mlpmixer", dict(untransposed_layer=0), "layers.0.tokens", "between", "axes 1 and 2 swapped"),
]


@pytest.mark.parametrize("name,mistake,where,kind,says", MISTAKES, ids=[f"{m[0]}-{next(iter(m[1]))}" for m in MISTAKES])
def test_a_planted_mistake_is_located_and_named(name, mistake, where, kind, says):
    tm, fm = Z.pair(name, **mistake)
    report = compare(tm, fm, *Z.inputs(name), grads=False)
    d = report.first_divergence
    assert d is not None and (d.torch_path, d.kind) == (where, kind), str(report)
    assert says in d.explanation, d.explanation


def test_the_issues_example_end_to_end_checks_miss_and_the_port_check_names_it():
    """The Conv1d mixer with tanh GELU in layer 1: its logits pass allclose(atol=1e-3) and
    keep every argmax, while the float64 check names the module and the mistake."""
    tm, fm = Z.pair("mixer", tanh_gelu_layer=1)
    (ids,) = Z.inputs("mixer")
    with torch.no_grad():
        want = tm(torch.from_numpy(ids)).numpy()
    got = np.asarray(fm(ids))
    assert np.allclose(got, want, atol=1e-3) and (got.argmax(-1) == want.argmax(-1)).all()
    report = compare(tm, fm, ids, grads=False)
    assert "blocks.1.mlp" in str(report.first_divergence) and "tanh" in report.first_divergence.explanation


def test_float32_judges_each_module_by_torchs_own_noise():
    tm, fm = Z.pair("gpt")
    ok = compare(tm, fm, *Z.inputs("gpt"), dtype="float32")
    assert ok.ok, str(ok)
    assert all(r.tol >= 1e-6 for r in ok.rows) and max(r.local for r in ok.rows) < 1e-5
    assert all(r.grad <= r.grad_tol for r in ok.rows if r.grad is not None)  # each from torch's own float32 gradient
    bad = compare(*Z.pair("gpt", tanh_gelu_layer=1), *Z.inputs("gpt"), dtype="float32", grads=False)
    assert bad.first_divergence.torch_path == "blocks.1.mlp.fc2", str(bad)


def test_a_gradient_only_mistake_is_found_going_backward():
    class TorchTwo(tnn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = tnn.Linear(4, 4), tnn.Linear(4, 3)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    class FlaxTwo(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.lax.stop_gradient(jax.numpy.tanh(self.a(x))))  # the mistake: no gradient to a

    tm, fm = TorchTwo(), FlaxTwo(nnx.Rngs(0))
    copy_weights(tm, fm)
    report = compare(tm, fm, np.random.default_rng(0).standard_normal((2, 4)))
    assert all(r.accumulated <= 1e-12 for r in report.rows)
    d = report.first_divergence
    assert d is not None and d.torch_path == "a" and d.kind == "inherited" and "gradient" in d.explanation, str(report)


# Weights ---------------------------------------------------------------------------------


def test_nn_multiheadattention_maps_onto_nnx_multiheadattention_with_no_rules():
    pairs = {t: (f, str(tf)) for t, f, tf in plan(Z.TorchMHABlock(), Z.FlaxMHABlock())}
    assert pairs["attn.in_proj_weight"][0] == "attn.value.kernel"  # the last of its three pairs
    assert {f for t, (f, _) in pairs.items() if t.startswith("attn.")} >= {
        "attn.out.kernel", "attn.out.bias"}
    assert pairs["ff.0.weight"] == ("ff.0.kernel", "transpose")


def test_a_layernorm_ported_as_an_rmsnorm_is_a_copy_error_and_nothing_is_written():
    torch.manual_seed(0)
    tm = tnn.Sequential(tnn.Linear(4, 4), tnn.LayerNorm(4))
    fm = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.RMSNorm(4, rngs=nnx.Rngs(0)))
    before = np.asarray(fm.layers[0].kernel[...]).copy()
    with pytest.raises(PortError) as e:
        copy_weights(tm, fm)
    assert "torch 1 is nn.LayerNorm" in str(e.value) and "nnx.RMSNorm" in str(e.value)
    assert e.value.problems == [p for p in e.value.problems if "1.bias" not in p and "1.scale" not in p] \
        and len(e.value.problems) == 1  # said once: its parameters are not listed again as uncopied
    assert np.array_equal(np.asarray(fm.layers[0].kernel[...]), before)


class _TorchSquare(tnn.Module):
    def __init__(self):
        super().__init__()
        self.w = tnn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.w


class _FlaxSquare(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jax.numpy.zeros((4, 4)))

    def __call__(self, x):
        return x @ self.w[...]


def test_a_square_matrix_is_never_paired_on_its_shape_alone():
    tm, fm = _TorchSquare(), _FlaxSquare()
    with pytest.raises(PortError, match="square"):
        copy_weights(tm, fm)
    x = np.random.default_rng(0).standard_normal((2, 4))
    copy_weights(tm, fm, rules=[(r"w", "w", "transpose")])  # the wrong orientation, said by a rule
    assert compare(tm, fm, x, grads=False).first_divergence.torch_path == ""
    copy_weights(tm, fm, rules=[(r"w", "w", "identity")])
    assert compare(tm, fm, x).ok


def test_a_misshaped_or_unpaired_weight_names_both_sides():
    tm = tnn.Sequential(tnn.Linear(4, 5), tnn.Linear(5, 2))
    fm = nnx.Sequential(nnx.Linear(4, 6, rngs=nnx.Rngs(0)), nnx.Linear(6, 2, rngs=nnx.Rngs(0)),
                        nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(PortError) as e:
        copy_weights(tm, fm)
    text = str(e.value)
    assert "torch 0.weight (5, 4) -> flax 0.kernel: transpose gives (4, 5), flax holds (4, 6)" in text
    assert "flax parameter 2.kernel (2, 2) is filled from no torch parameter" in text


# Refusals and hygiene ----------------------------------------------------------------------


def test_comparing_a_framework_with_itself_is_refused():
    tm, fm = Z.pair("mlpmixer")
    x = Z.inputs("mlpmixer")
    with pytest.raises(TypeError, match="torch compared with itself"):
        compare(tm, tm, *x)
    with pytest.raises(TypeError, match="framework compared with itself"):
        compare(fm, fm, *x)

    class Wrapped(tnn.Module):  # "torch" that runs the Flax port
        def __init__(self):
            super().__init__()
            self.port = fm

        def forward(self, x):
            return torch.from_numpy(np.asarray(self.port(x.numpy())))

    with pytest.raises(TypeError, match="runs JAX code"):
        compare(Wrapped(), fm, *x)


def test_nothing_is_left_changed():
    tm, fm = Z.pair("gpt", tanh_gelu_layer=1)
    tm.train()
    x64 = jax.config.jax_enable_x64
    kernel = np.asarray(fm.blocks[0].mlp.fc1.kernel[...]).copy()
    calls = (nnx.Linear.__call__, nnx.LayerNorm.__call__, Z.FlaxGPT.__call__)
    functions = (F.gelu, F.layer_norm, F.softmax, torch.Tensor.view, torch.Tensor.__matmul__, torch.Tensor.masked_fill)
    report = compare(tm, fm, *Z.inputs("gpt"))  # a divergence: the explanations patch and restore
    assert not report.ok
    assert tm.training and all(m.training for m in tm.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in tm.modules())
    assert next(tm.parameters()).dtype == torch.float32
    assert jax.config.jax_enable_x64 == x64
    assert fm.blocks[0].mlp.fc1.kernel[...].dtype == jax.numpy.float32
    assert np.array_equal(np.asarray(fm.blocks[0].mlp.fc1.kernel[...]), kernel)
    assert (nnx.Linear.__call__, nnx.LayerNorm.__call__, Z.FlaxGPT.__call__) == calls
    assert (F.gelu, F.layer_norm, F.softmax, torch.Tensor.view, torch.Tensor.__matmul__,
            torch.Tensor.masked_fill) == functions


def test_report_table_json_and_plot(tmp_path):
    report = compare(*Z.pair("mlpmixer", default_eps_layer=1), *Z.inputs("mlpmixer"), grads=False)
    text = str(report)
    assert "layers.1.norm1" in text and "DIVERGES" in text and "first divergence inside layers.1.norm1" in text
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["first_divergence"]["torch_path"] == "layers.1.norm1"
    report.plot(tmp_path / "port.png")
    assert (tmp_path / "port.png").stat().st_size > 10_000


def test_command_line_prints_the_table_and_exits_1_naming_the_module(tmp_path, capsys):
    args = ["parity_tests.port.zoo:TorchMLPMixer", "--inputs", "float:2x8x8"]
    assert main([args[0], "parity_tests.port.zoo:FlaxMLPMixer", *args[1:]]) == 0
    assert "every module within tolerance" in capsys.readouterr().out
    torch.manual_seed(3)
    torch.save(Z.TorchMLPMixer().state_dict(), tmp_path / "w.pt")
    code = main([args[0], "parity_tests.port.zoo:mlp_mixer_with_default_eps", *args[1:], "--weights",
                 str(tmp_path / "w.pt"), "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr()
    assert code == 1 and "layers.1.norm1" in out.err and (tmp_path / "p.png").exists()
    with pytest.raises(SystemExit):
        main([args[0], "parity_tests.port.zoo:FlaxMLPMixer", "--inputs", "float:2x8"])  # the wrong shape, named
    assert "float:2x8" in capsys.readouterr().err


def test_a_tied_head_and_a_square_positional_table_copy_without_rules():
    """GPT-2's head shares its tensor with the embedding (the port calls Embed.attend): not a
    missing module. A (1, T, d) table with T == d is no matrix of a matmul: copied as it is."""
    class TorchTied(tnn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.pos = tnn.Embedding(10, 4), tnn.Parameter(torch.randn(1, 4, 4))
            self.head = tnn.Linear(4, 10, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, ids):
            return self.head(self.wte(ids) + self.pos[:, :ids.shape[1]])

    class FlaxTied(nnx.Module):
        def __init__(self):
            self.wte, self.pos = nnx.Embed(10, 4, rngs=nnx.Rngs(0)), nnx.Param(jax.numpy.zeros((1, 4, 4)))

        def __call__(self, ids):
            return self.wte.attend(self.wte(ids) + self.pos[...][:, :ids.shape[1]])

    tm, fm = TorchTied(), FlaxTied()
    pairs = {t: f for t, f, _ in copy_weights(tm, fm)}
    assert pairs == {"pos": "pos", "wte.weight": "wte.embedding", "head.weight": None}
    assert compare(tm, fm, np.array([[1, 2, 3, 4]])).ok


def test_jax_nn_dot_product_attention_is_exact_in_the_float64_run():
    """jax.nn.dot_product_attention computes its softmax in float32 whatever the inputs (as
    nnx.MultiHeadAttention's default attention, which calls it): a correct port on it is still
    equal to torch's scaled_dot_product_attention within 1e-12, and the function is restored."""
    class TorchSDPA(tnn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = tnn.Linear(16, 48)

        def forward(self, x):
            q, k, v = (a.unflatten(-1, (2, 8)).transpose(1, 2) for a in self.qkv(x).chunk(3, -1))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)

    class FlaxSDPA(nnx.Module):
        def __init__(self):
            self.qkv = nnx.Linear(16, 48, rngs=nnx.Rngs(0))

        def __call__(self, x):
            q, k, v = (a.reshape(*a.shape[:2], 2, 8) for a in jax.numpy.split(self.qkv(x), 3, -1))
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            return out.reshape(*out.shape[:2], 16)

    from parity_tests.port.runs import _exact_dot_product_attention

    original = jax.nn.dot_product_attention
    with jax.enable_x64(True):  # why the float64 run replaces it: its softmax rounds to float32
        q, k, v = (jax.numpy.asarray(np.random.default_rng(i).standard_normal((2, 6, 2, 8))) for i in range(3))
        exact = _exact_dot_product_attention(original)(q, k, v, is_causal=True)
        assert np.abs(np.asarray(original(q, k, v, is_causal=True)) - np.asarray(exact)).max() > 1e-9
    tm, fm = TorchSDPA(), FlaxSDPA()
    copy_weights(tm, fm)
    report = compare(tm, fm, np.random.default_rng(0).standard_normal((2, 6, 16)))
    assert report.ok and report.output_error <= 1e-12, str(report)
    assert jax.nn.dot_product_attention is original


def test_a_port_left_in_train_mode_is_named():
    """The modes are the caller's: torch in eval, its port left in train mode (nnx modules
    start there) draws dropout masks, and the check says so at the dropout."""
    torch.manual_seed(0)
    tm = tnn.Sequential(tnn.Linear(8, 8), tnn.Dropout(0.5), tnn.Linear(8, 2)).eval()
    fm = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(1)),
                        nnx.Linear(8, 2, rngs=nnx.Rngs(0)))
    copy_weights(tm, fm)
    x = np.random.default_rng(0).standard_normal((4, 8))
    d = compare(tm, fm, x, grads=False).first_divergence
    assert d is not None and d.torch_path == "1" and "train mode" in d.explanation, d
    fm.eval()
    assert compare(tm, fm, x).ok and not tm.training and fm.layers[1].deterministic


def test_a_swapped_activation_is_named_and_inputs_that_do_not_fit_say_so():
    """A GLU whose port calls jax.nn.gelu (tanh by default) where torch calls silu; and inputs
    of the wrong width get one error naming what was given."""
    class TorchGLU(tnn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = tnn.Linear(6, 8), tnn.Linear(6, 8), tnn.Linear(8, 6)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    class FlaxGLU(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(0)
            self.gate, self.up, self.down = nnx.Linear(6, 8, rngs=r), nnx.Linear(6, 8, rngs=r), nnx.Linear(8, 6, rngs=r)

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.gate(x)) * self.up(x))  # the mistake: gelu for silu

    tm, fm = TorchGLU(), FlaxGLU()
    copy_weights(tm, fm)
    d = compare(tm, fm, np.random.default_rng(0).standard_normal((2, 3, 6)), grads=False).first_divergence
    assert d.torch_path == "down" and "tanh GELU (jax.nn.gelu's default) where torch computes silu" in d.explanation, d
    with pytest.raises(ValueError, match=r"torch module cannot run on the inputs given \(\(2, 3, 7\)"):
        compare(tm, fm, np.zeros((2, 3, 7)))
