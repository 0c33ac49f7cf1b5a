"""Parity check for your own checkpoint: `python -m parity_tests.check CHECKPOINT --num-heads N`.

Loads a torch-named checkpoint (.pt/.pth or .safetensors; a stock nn.TransformerEncoder,
a TransformerEncoderLayer or a torch_blocks module) into both torch_blocks and flax_blocks,
runs both on random inputs with a padding mask, and prints max abs / rel errors of the
output and of the gradients (random cotangent), per layer. Exits 1 past tolerance, naming
the layer; a tensor with non-finite values or the wrong shape is reported by name too.

References: the torch_blocks twin always; stock torch too where it can hold the config (the
source module itself when `check` is given a stock nn.TransformerEncoder(Layer), whose own
heads, norm placement, activation and eps are then checked against the flags; else stock
torch rebuilt from the state dict and the flags, which cannot tell a wrong head count: a
state dict does not record it, and the table says so). A file holding a whole pickled stock
module (`torch.save(model, path)`) is checked against that module, its own heads included,
with `--trust-pickle` (loading it runs the file's pickle code).
A Hugging Face save_pretrained folder is checked against the
HF model rebuilt from it, with its config's settings (`python -m parity_tests.check FOLDER`).
The table's header names the reference used.
"""

from __future__ import annotations

import argparse
import re
import sys

import numpy as np

from flax_blocks.checkpoints.convert import ConversionError, infer_config, read_state_dict
from flax_blocks.core.config import BlockConfig

from ..twins.harness import TOL, Case, Inputs, flax_twin, precision, rel_err, run_flax, run_torch
from .report import CheckReport


def _layer_of(name: str) -> str:
    m = re.match(r"layers\.(\d+)\.", name)
    return f"layer {m.group(1)}" if m else "top"


def check(checkpoint, *, num_heads: int | None = None, norm: str = "post", activation: str = "relu",
          layer_norm_eps: float = 1e-5,
          causal: bool = False, prefix: str = "", dtype: str = "float32", batch: int = 2, seq: int = 8,
          seed: int = 0, pad_keys: int | None = None, mask_check: bool = True) -> CheckReport:
    """Run the parity check; returns the figures (see CheckReport).

    pad_keys: padded keys at the end of the last batch element (None: seq // 2).
    mask_check: print a warning when a batch element's every query row is fully masked.
    A Hugging Face folder (config.json + weights) is checked against the HF model rebuilt
    from it (`parity_tests.check.hf.check_hf`); its settings come from its config, and
    num_heads, when given, overrides the config's."""
    import os

    if pad_keys is not None and not 0 <= pad_keys <= seq:  # before either reference uses it
        raise ValueError(f"pad_keys must be in [0, {seq}], got {pad_keys}")
    if isinstance(checkpoint, (str, os.PathLike)) and os.path.isdir(checkpoint):
        from .hf import check_hf

        return check_hf(os.fspath(checkpoint), num_heads=num_heads, dtype=dtype, batch=batch, seq=seq, seed=seed,
                        pad_keys=pad_keys)
    if num_heads is None:
        raise ValueError("--num-heads is required for a torch checkpoint (it cannot be read from the tensors)")
    import torch

    import torch_blocks as tb

    sd = read_state_dict(checkpoint)
    if prefix:
        sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    bad = [f"{k} ({_layer_of(k)}): {int((~np.isfinite(np.asarray(v, np.float64))).sum())} non-finite values"
           for k, v in sd.items() if not np.isfinite(np.asarray(v, np.float64)).all()]
    info = infer_config(sd).inferred
    if "kind" not in info or "d_model" not in info:
        raise ConversionError([f"no transformer parameters found under prefix {prefix!r}: this checks checkpoints of "
                               "stock torch, torch_blocks and Hugging Face folders; a model of your own and its Flax "
                               "port are checked with python -m parity_tests.port TORCH FLAX --inputs SPEC "
                               "(docs/porting.md)"], header="cannot check")
    cfg = BlockConfig(d_model=info["d_model"], num_heads=num_heads, d_ff=info.get("d_ff", 4 * info["d_model"]),
                      dropout=0.0, activation=activation, layer_norm_eps=layer_norm_eps, bias=info["bias"],
                      norm=norm if info["layer_norms"] else "none", scaling=info.get("scaling", "none"),
                      causal=causal, param_dtype=dtype)
    case = Case(info["kind"], cfg, num_layers=info.get("num_layers", 1), batch=batch, seq=seq,
                final_norm=info.get("final_norm"), key_mask=info["kind"] != "FeedForward", seed=seed)
    report = CheckReport(case.kind, dtype, failures=bad)
    stock = None
    with precision(dtype):
        cls = getattr(tb, case.kind)
        tmod = cls(cfg, **case.kwargs).train()
        try:
            tmod.load_state_dict({k: torch.as_tensor(np.asarray(v)).to(getattr(torch, dtype)) for k, v in sd.items()},
                                 strict=True)
        except RuntimeError as e:
            raise ConversionError([str(e)], header="torch_blocks cannot load the checkpoint") from e
        fmod = flax_twin(case, tmod, dtype)
        rng = np.random.default_rng(seed)
        keys = np.ones((batch, seq), bool)
        keys[-1, seq - (seq // 2 if pad_keys is None else pad_keys):] = False
        if mask_check and case.key_mask and (elements := fully_masked_elements(keys)):
            print(mask_warning(elements), file=sys.stderr)
        inp = Inputs(rng.normal(size=(batch, seq, cfg.d_model)), rng.normal(size=(batch, seq, cfg.d_model)),
                     key_mask=keys if case.key_mask else None)
        f, t = run_flax(case, fmod, inp, dtype), run_torch(case, tmod, inp, dtype)
        stock = _stock_reference(checkpoint, sd, info, cfg, case, dtype)
        if stock is not None:
            what, module = stock
            report.failures += _contradictions(checkpoint, cfg)
            ys, dxs = _run_stock(module, case, inp, dtype)
            live = keys if case.key_mask else np.ones_like(keys)
            report.reference = f"the torch_blocks twin and {what}"
            if "rebuilt from the state dict" in what:
                report.notes.append(
                    f"num_heads={cfg.num_heads}, norm, activation and eps come from the flags: a state dict does not "
                    "record them, so both references share a wrong value; check the module itself to verify them "
                    "(a torch.save(model, path) file with --trust-pickle, or check(model) from Python)")
            stock_row = ("stock torch", float(np.abs(f.y - ys)[live].max()), _rel_at(f.y, ys, live),
                         _rel_at(f.dx, dxs, live))

    layers = range(case.num_layers) if case.kind == "Encoder" else []
    for i in layers:
        a, b = f.per_layer[i], t.per_layer[i]
        g = max((rel_err(f.grads[k], t.grads[k]) for k in t.grads if k.startswith(f"layers.{i}.")), default=0.0)
        report.rows.append((f"layer {i}", float(np.abs(a - b).max()), rel_err(a, b), g))
    g_top = max((rel_err(f.grads[k], t.grads[k]) for k in t.grads if not k.startswith("layers.")), default=0.0)
    report.rows.append(("output", float(np.abs(f.y - t.y).max()), rel_err(f.y, t.y), max(g_top, rel_err(f.dx, t.dx))))
    if stock is not None:
        report.stock_rows.append(stock_row)
    for where, _, fwd, grad in report.rows + report.stock_rows:
        if not fwd <= TOL["forward", dtype]:
            report.failures.append(f"{where}: forward rel error {fwd:.2e} > {TOL['forward', dtype]:.0e}")
        if not grad <= TOL["grad", dtype]:
            report.failures.append(f"{where}: gradient rel error {grad:.2e} > {TOL['grad', dtype]:.0e}")
    return report


def _rel_at(a: np.ndarray, b: np.ndarray, live: np.ndarray) -> float:
    """rel_err over the real (non-padded) query positions only."""
    return rel_err(a[live], b[live])


def _contradictions(checkpoint, cfg: BlockConfig) -> list[str]:
    """A source module's own settings that the given flags contradict, one line each (the
    converter's own check, `check_against_source`)."""
    from flax_blocks.checkpoints.dialects import check_against_source

    try:
        check_against_source(cfg, checkpoint)
    except ConversionError as e:
        return [f"settings: {p}" for p in e.problems]
    return []


def _stock_reference(checkpoint, sd: dict, info: dict, cfg: BlockConfig, case: Case, dtype: str):
    """(description, module) of stock torch to compare with: the source module itself when
    it is a stock nn.TransformerEncoder(Layer); else stock torch rebuilt from the state dict
    and the flags when it can hold that config; else None."""
    import copy

    import torch

    if isinstance(checkpoint, (torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer)):
        module = copy.deepcopy(checkpoint).to(getattr(torch, dtype))
        for m in module.modules():  # dropout off, train mode: no fast path, gradients flow
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
            if isinstance(m, torch.nn.MultiheadAttention):
                m.dropout = 0.0
        return f"the source {type(checkpoint).__name__} itself", module.train()
    stock_ok = (case.kind in ("Encoder", "TransformerBlock") and cfg.norm in ("pre", "post")
                and cfg.activation in ("relu", "gelu") and cfg.scaling == "none" and cfg.residual == "add"
                and not info.get("gated_mlp") and not info.get("qk_norm")
                and info.get("norm_type", "layernorm") == "layernorm"
                and info.get("num_kv_heads", cfg.num_heads) == cfg.num_heads)
    if not stock_ok:
        return None
    layer = torch.nn.TransformerEncoderLayer(cfg.d_model, cfg.num_heads, cfg.d_ff, 0.0, activation=cfg.activation,
                                             layer_norm_eps=cfg.layer_norm_eps, batch_first=True,
                                             norm_first=cfg.norm == "pre", bias=cfg.bias, dtype=getattr(torch, dtype))
    module = layer
    if case.kind == "Encoder":
        norm = torch.nn.LayerNorm(cfg.d_model, cfg.layer_norm_eps, bias=cfg.bias, dtype=getattr(torch, dtype)) \
            if case.final_norm else None
        module = torch.nn.TransformerEncoder(layer, case.num_layers, norm=norm, enable_nested_tensor=False)
    module.load_state_dict({k: torch.as_tensor(np.asarray(v)).to(getattr(torch, dtype)) for k, v in sd.items()},
                           strict=True)
    return f"stock torch ({type(module).__name__} rebuilt from the state dict and the flags)", module.train()


def _run_stock(module, case: Case, inp: Inputs, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(output, gradient w.r.t. x for the cotangent) of a stock torch module."""
    import torch

    x = torch.tensor(np.asarray(inp.x), dtype=getattr(torch, dtype), requires_grad=True)
    kw = {}
    if inp.key_mask is not None:
        kw["src_key_padding_mask"] = torch.from_numpy(~np.asarray(inp.key_mask))
    if case.cfg.causal:
        t = x.shape[1]
        kw["src_mask" if isinstance(module, torch.nn.TransformerEncoderLayer) else "mask"] = \
            torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    y = module(x, **kw)
    y.backward(torch.tensor(np.asarray(inp.r), dtype=y.dtype))
    return y.detach().numpy(), x.grad.numpy()


def fully_masked_elements(key_mask: np.ndarray) -> list[int]:
    """Batch elements in which every query row has no key to attend to.

    key_mask: (B, T) in flax's convention (True = real key). Such an element is almost
    always a mask in the other framework's convention (torch: True = padding)."""
    return [int(b) for b in np.flatnonzero(~np.asarray(key_mask, bool).any(axis=-1))]


def mask_warning(elements: list[int]) -> str:
    """One line naming the fully masked batch elements and the likely cause."""
    return (f"warning: every query row of batch element(s) {elements} is fully masked; is the mask in the other "
            "framework's convention? (flax_blocks: True = may attend; torch_blocks / nn.MultiheadAttention: "
            "True = padding; flax_blocks.invert_mask converts)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m parity_tests.check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="torch-named checkpoint: .pt/.pth (a state dict) or .safetensors; or a "
                                       "Hugging Face save_pretrained folder "
                                       "(BERT, RoBERTa, DistilBERT, GPT-2, OPT, ViT, "
                                       "LLaMA, Mistral, Qwen2, Phi-3), "
                                       "checked against the HF model itself with the settings of its config.json")
    ap.add_argument("--num-heads", type=int, help="attention heads (not inferable from the tensors; required for a "
                                                  "torch checkpoint; for an HF folder it overrides the config's)")
    ap.add_argument("--norm", choices=["pre", "post"], default="post",
                    help="norm placement: torch's norm_first=True is 'pre' (default: post, torch's default)")
    ap.add_argument("--activation", choices=["relu", "gelu", "gelu_tanh"], default="relu",
                    help="feed-forward activation; 'gelu' is exact (erf) as in torch (default: relu)")
    ap.add_argument("--eps", type=float, default=1e-5, help="LayerNorm eps (default: 1e-5, torch's)")
    ap.add_argument("--causal", action="store_true", help="check with a causal mask")
    ap.add_argument("--prefix", default="", help="read only names under this prefix, e.g. 'encoder.'")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                    help="dtype both twins run in (float64 tightens the tolerances)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs and cotangent")
    ap.add_argument("--pad-keys", type=int, default=None, metavar="N",
                    help="padded keys at the end of the last batch element (default: half the sequence)")
    ap.add_argument("--trust-pickle", action="store_true",
                    help="the file holds a whole pickled module (torch.save(model, path)) from a source you trust: "
                         "load it with weights_only=False, which runs the file's pickle code, and check against "
                         "that module itself, its own heads, norm placement, activation and eps included")
    ap.add_argument("--mask-check", action=argparse.BooleanOptionalAction, default=True,
                    help="warn when every query row of a batch element is fully masked, the mark of a mask "
                         "in the other framework's convention (default: on)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import pickle

    from flax_blocks.checkpoints.io_errors import describe_unpickling_error

    checkpoint = a.checkpoint
    try:
        if a.trust_pickle:
            import torch

            checkpoint = torch.load(a.checkpoint, map_location="cpu", weights_only=False)
        report = check(checkpoint, num_heads=a.num_heads, norm=a.norm, activation=a.activation,
                       layer_norm_eps=a.eps, causal=a.causal, prefix=a.prefix, dtype=a.dtype, seed=a.seed,
                       pad_keys=a.pad_keys, mask_check=a.mask_check)
    except pickle.UnpicklingError as e:  # --trust-pickle's torch.load on a file that is no torch pickle
        print(f"error: {describe_unpickling_error(a.checkpoint, e)}", file=sys.stderr)
        return 1
    except (ConversionError, FileNotFoundError, ValueError) as e:
        hint = " (or, for a file you trust, rerun with --trust-pickle)" if "holds a pickled object" in str(e) else ""
        print(f"error: {e}{hint}", file=sys.stderr)
        return 1
    print(report.table())
    return 0 if report.ok else 1

