"""Checkpoints streamed in (flax_blocks.checkpoints.stream, flax_blocks.checkpoints.convert.place): lazy tensors equal
numpy's moves on any slice, read whole or written into any buffer; a folder loads bit for
bit as the in-memory model does, reading nothing before every check has passed; every placed
value of LLaMA, Phi-3 (fused q/k/v), GPT-NeoX (per-head q/k/v) and GPT-2 (transposed Conv1D)
folders in float32, bfloat16 and float16 equals numpy's moves bit for bit, each move done in
the one copy; the CPU's arrays are their host buffers, kept alive; bfloat16 stays bfloat16;
.bin files through a memory map; on 8 simulated devices each parameter is created sharded
(logits and greedy tokens equal the unsharded model's; 2 KV heads on a 4-way "model" axis
replicated), every family bit for bit; two processes read only their devices' slices."""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from xla_env import xla_flags  # the suite's XLA flags, the device count replaced

import flax_blocks as fb
from flax_blocks.checkpoints import stream
from flax_blocks.checkpoints.io import ConversionError
from flax_blocks.checkpoints.io_errors import CheckpointReadError

ROOT = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

IDS = np.arange(24).reshape(2, 12) % 96


def _llama(folder: Path, *, dtype: str = "float32", shard: str = "20KB", safe: bool = True) -> Path:
    """A tiny LLaMA (4 heads, 4 KV heads, FFN 64: both split over 4 devices) saved in shards
    (safe=False: one pytorch_model.bin, as older repositories hold)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    if safe:
        model.save_pretrained(folder, max_shard_size=shard)
    else:
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


pytestmark = pytest.mark.xdist_group("streamed_loading")  # its module fixtures built by one worker (--dist loadgroup)

@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return _llama(tmp_path_factory.mktemp("llama") / "m")


FAMILIES = {  # name: (transformers class, config): tiny, 4 heads (GPT-NeoX's fused per head, GPT-2's transposed)
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(intermediate_size=64, num_attention_heads=4,
                                                      num_key_value_heads=2, tie_word_embeddings=False)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(intermediate_size=64, num_attention_heads=4,
                                                   num_key_value_heads=2, pad_token_id=0)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(intermediate_size=64, num_attention_heads=4)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)),
}


def _family(folder: Path, family: str, dtype: str) -> Path:
    model_cls, config_cls, kw = FAMILIES[family]
    size = dict(n_embd=32, n_layer=2) if family == "gpt2" else dict(hidden_size=32, num_hidden_layers=2)
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(vocab_size=96, **size, **kw)
    getattr(transformers, model_cls)(config).to(getattr(torch, dtype)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    """{"<family>-<dtype>": folder} for every family of FAMILIES in float32, bfloat16 and float16."""
    root = tmp_path_factory.mktemp("families")
    return {f"{f}-{d}": _family(root / f"{f}-{d}", f, d) for f in FAMILIES for d in ("float32", "bfloat16", "float16")}


def _params(model) -> dict:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# ------------------------------------------------------------------ lazy tensors


def test_lazy_moves_equal_numpys_on_any_slice(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((12, 8)).astype(np.float32), rng.standard_normal((6, 8)).astype(np.float32)
    save_file({"a": A, "b": B, "s": np.array(3.0, np.float32)}, str(tmp_path / "x.safetensors"))
    sd = stream.read_safetensors(tmp_path / "x.safetensors")
    a, b = sd["a"], sd["b"]
    assert np.asarray(sd["s"]) == 3.0
    cases = {
        "T": (a.T, A.T), "concat": (np.concatenate([a, b]), np.concatenate([A, B])),
        "concat axis 1": (np.concatenate([a.T, b.T], axis=1), np.concatenate([A.T, B.T], axis=1)),
        "split": (a.reshape(3, 4, 8), A.reshape(3, 4, 8)), "merge": (a.reshape(24, 4), A.reshape(24, 4)),
        "qkv-like": (a.reshape(-1, 2, 8)[np.array([3, 0, 5])].reshape(3, 2, 2, 4).transpose(3, 0, 1, 2),
                     A.reshape(-1, 2, 8)[np.array([3, 0, 5])].reshape(3, 2, 2, 4).transpose(3, 0, 1, 2)),
        "rows": (a[2:7], A[2:7]), "int": (a[3], A[3]), "negative": (a[-1], A[-1]),
        "regroup": (a.reshape(2, 6, 8).swapaxes(0, 1).reshape(12, 8), A.reshape(2, 6, 8).swapaxes(0, 1).reshape(12, 8)),
        "stack": (np.stack([a, a * 0, a.astype(np.float64)]), np.stack([A, A * 0, A.astype(np.float64)])),
        "scale": (a * 2, A * 2),
    }
    for name, (lz, ref) in cases.items():
        assert isinstance(lz, stream.Lazy), name
        assert (lz.shape, lz.dtype) == (ref.shape, ref.dtype), name
        assert np.array_equal(lz.read(), ref), name
        for _ in range(10):
            index = tuple(None if rng.random() < 0.4 else rng.choice(n, rng.integers(1, n + 1), replace=False)
                          for n in ref.shape)
            want = ref
            for axis, i in enumerate(index):
                want = want if i is None else np.take(want, i, axis=axis)
            assert np.array_equal(lz.read(index), want), (name, index)


@pytest.mark.parametrize("run_bytes", [stream.RUN_BYTES, 8])  # 8: transposing copies in blocks of 2 floats
def test_read_into_any_buffer_equals_numpys_moves(tmp_path, monkeypatch, run_bytes):
    """`read_into` writes through views of the buffer it is given (C order, Fortran order,
    transposed, another dtype): the same values as numpy's moves, on any slice."""
    import ml_dtypes
    from safetensors.numpy import save_file

    monkeypatch.setattr(stream, "RUN_BYTES", run_bytes)
    rng = np.random.default_rng(1)
    A, C = rng.standard_normal((12, 8)).astype(np.float32), rng.standard_normal((24, 5)).astype(np.float32)
    save_file({"a": A, "c": C, "s": np.array(3.0, np.float32)}, str(tmp_path / "x.safetensors"))
    sd = stream.read_safetensors(tmp_path / "x.safetensors")
    a, c, bf16 = sd["a"], sd["c"], ml_dtypes.bfloat16
    cases = {
        "qkv-like": (a.reshape(-1, 2, 8)[np.array([3, 0, 5])].reshape(3, 2, 2, 4).transpose(3, 0, 1, 2),
                     A.reshape(-1, 2, 8)[np.array([3, 0, 5])].reshape(3, 2, 2, 4).transpose(3, 0, 1, 2)),
        "per-head regroup": (c.reshape(2, 3, 4, 5).swapaxes(0, 1).reshape(24, 5).reshape(-1, 4, 5)[[5, 0, 3, 1, 2, 4]],
                             C.reshape(2, 3, 4, 5).swapaxes(0, 1).reshape(24, 5).reshape(-1, 4, 5)[[5, 0, 3, 1, 2, 4]]),
        "concat T": (np.concatenate([a.T, a.T * 2], axis=1), np.concatenate([A.T, A.T * 2], axis=1)),
        "stack": (np.stack([a.T, a.T]), np.stack([A.T, A.T])),
        "stacked scalars": (np.stack([sd["s"], sd["s"] * 2, sd["s"]]), np.array([3.0, 6.0, 3.0], np.float32)),
        "cast": (a.astype(bf16).T, A.astype(bf16).T),
        "rounded, then cast back": (a.astype(bf16).astype(np.float32).T, A.astype(bf16).astype(np.float32).T),
        "in memory": (stream.lazy(A).T.reshape(2, 4, 12), A.T.reshape(2, 4, 12)),
    }
    for name, (lz, ref) in cases.items():
        for trial in range(12):
            index = None if trial == 0 else tuple(
                None if rng.random() < 0.4 else rng.choice(n, rng.integers(1, n + 1), replace=False) for n in ref.shape)
            want = ref
            for axis, i in enumerate(index or ()):
                want = want if i is None else np.take(want, i, axis=axis)
            for out in (np.zeros(want.shape, want.dtype), np.zeros(want.shape, np.float64),
                        np.zeros(want.shape[::-1], want.dtype).T, np.asfortranarray(np.zeros(want.shape, want.dtype))):
                lz.read_into(out, index)
                assert np.array_equal(out, want.astype(out.dtype)), (name, index, out.dtype, out.strides)
    with pytest.raises(ValueError, match=r"out has shape \(8, 12\), the read gives \(12, 8\)"):
        a.read_into(np.zeros((8, 12), np.float32))


def test_a_slice_reads_only_its_rows(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones((64, 16), np.float32)}, str(tmp_path / "w.safetensors"))
    w = stream.read_safetensors(tmp_path / "w.safetensors")["w"]
    before = stream.bytes_read()
    w.T.reshape(16, 4, 16).read((None, np.array([1]), None))  # rows 16-31 of the file
    assert stream.bytes_read() - before == 16 * 16 * 4


# ------------------------------------------------------------------ folders


def test_folder_loads_as_the_model_object_bit_for_bit(folder):
    hf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded, with an index
    before = stream.bytes_read()
    model = fb.from_hf(folder, part="causal-lm")
    read = stream.bytes_read() - before
    files = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert 0.95 * files < read <= files  # every weight read once (the headers are the rest)
    ref = fb.from_hf(hf, part="causal-lm")
    mine, theirs = _params(model), _params(ref)
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(IDS)), want, rtol=1e-4, atol=1e-5)


def test_placed_values_equal_numpys_moves_bit_for_bit(families, monkeypatch):
    """Every value placed from a folder (LLaMA, Phi-3's fused q/k/v and gate-up, GPT-NeoX's q/k/v
    fused per head, GPT-2's transposed Conv1D; float32, bfloat16, float16; as stored and cast)
    equals numpy's moves on the file's tensors (`Lazy.read`, the way placement read before),
    bit for bit, and no byte goes through a temporary: each move is done in the one copy."""
    from flax_blocks.checkpoints.convert import place

    placed, real = [], place.read
    monkeypatch.setattr(place, "read", lambda a, index=None, pool=None: placed.append((a, index, real(a, index, pool)))
                        or placed[-1][2])
    for name, folder in families.items():
        for dtype in (None, "float32"):
            placed.clear()
            staged = stream.staged_bytes()
            fb.from_hf(folder, part="causal-lm", dtype=dtype)
            assert len(placed) >= 10 and stream.staged_bytes() == staged, (name, dtype)
            for a, index, got in placed:
                want = a.read(index)
                assert got.dtype == want.dtype and got.shape == want.shape, (name, a)
                bits = f"u{got.itemsize}"
                assert np.array_equal(got.view(bits), want.view(bits)), (name, dtype, a)


def test_reads_split_over_threads_equal_one_read(folder, monkeypatch):
    from flax_blocks.checkpoints.convert import place

    monkeypatch.setattr(place, "READERS", 1)
    whole = _params(fb.from_hf(folder, part="causal-lm"))
    tasks, real = [], place._tasks
    monkeypatch.setattr(place, "READERS", 3)
    monkeypatch.setattr(place, "TASK_BYTES", 1000)  # layers, then spans of the file's rows (the head: its columns)
    monkeypatch.setattr(place, "_tasks", lambda a, index, out: tasks.append(real(a, index, out)) or tasks[-1])
    split = _params(fb.from_hf(folder, part="causal-lm"))
    assert max(len(t) for t in tasks) >= 8 and sum(len(t) for t in tasks) >= 40, [len(t) for t in tasks]
    assert all(np.array_equal(split[k], whole[k]) for k in whole)


def test_cpu_arrays_are_their_host_buffers_kept_alive():
    """On a CPU the placed array is its host buffer (the memory bound: no second copy), and
    holds it: freed by nobody else, overwritten by nothing allocated after."""
    import jax

    from flax_blocks.checkpoints.convert import place

    want = np.arange(3 * 1024 * 1024, dtype=np.float32).reshape(3072, 1024)
    lz = stream.lazy(want).T
    host = place.read(lz)
    x = jax.device_put(host)
    assert x.unsafe_buffer_pointer() == host.ctypes.data and host.ctypes.data % place.ALIGN == 0
    x = place.place(lz)
    del host
    gc.collect()
    junk = [np.full(want.shape, 7.0, np.float32) for _ in range(8)]  # memory freed above would be reused here
    assert np.array_equal(np.asarray(x), want.T) and len(junk) == 8


def test_small_host_buffers_are_64_byte_aligned_and_adopted():
    """Buffers below a page come from numpy's allocator (16-byte aligned), aligned by hand to
    the 64 bytes XLA's CPU client needs to take a buffer as the array's own memory."""
    from flax_blocks.checkpoints.convert import place

    junk = []
    for n in range(1, 40):  # each size a fresh allocation, at whatever address the allocator gives
        for dtype in (np.float32, np.float16, np.int8):
            host = place.host_buffer((n, 3), dtype)
            host[...] = 1
            junk.append(np.empty(n, np.uint8))  # shift the allocator's next address
            assert host.ctypes.data % 64 == 0 and host.shape == (n, 3) and host.dtype == dtype, (n, dtype)
    host = place.read(stream.lazy(np.arange(12, dtype=np.float32).reshape(3, 4)).T)
    x = jax.device_put(host)
    assert x.unsafe_buffer_pointer() == host.ctypes.data
    assert np.array_equal(np.asarray(x), np.arange(12).reshape(3, 4).T)


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_a_half_precision_folder_stays_in_its_dtype_unless_asked(tmp_path, stored):
    """A half-precision folder gives a model of its dtype (bfloat16 and float16 alike, the
    stack and the causal LM alike): from the config's `dtype` (read, never listed as ignored),
    and from the tensors when the config names none (an older save)."""
    folder = _llama(tmp_path / stored, dtype=stored)
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == stored
    for named in (True, False):
        stack, model = fb.from_hf(folder), fb.from_hf(folder, part="causal-lm")
        for loaded in (stack, model):
            assert {str(v.dtype) for v in _params(loaded).values()} == {stored}, named
            assert loaded.cfg.param_dtype == stored, named
            assert not {"dtype", "torch_dtype", "model_type"} & set(fb.load_report(loaded).ignored_keys)
        (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "dtype"}))
    (folder / "config.json").write_text(json.dumps(config))
    if stored == "float16":
        return
    cast = fb.from_hf(folder, part="causal-lm", dtype="float32")
    got = _params(cast)
    assert {str(v.dtype) for v in got.values()} == {"float32"}
    assert all(np.array_equal(got[k], v.astype(np.float32)) for k, v in _params(model).items())
    as_torch = _params(fb.from_hf(folder, part="causal-lm", dtype=torch.float32))  # the other framework's dtype
    assert all(np.array_equal(as_torch[k], got[k]) and as_torch[k].dtype == got[k].dtype for k in got)


def test_bin_files_are_memory_mapped(tmp_path, folder):
    binary = _llama(tmp_path / "bin", safe=False)
    assert list(binary.glob("pytorch_model*.bin")) and not list(binary.glob("*.safetensors"))
    a, b = _params(fb.from_hf(binary, part="causal-lm")), _params(fb.from_hf(folder, part="causal-lm"))
    assert all(np.array_equal(a[k], b[k]) for k in a)


def _bad_copy(folder: Path, tmp_path: Path) -> tuple[Path, list[Path]]:
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in folder.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    return bad, sorted(bad.glob("*.safetensors"))


def _refused_before_reading(bad: Path, error: type, match: str) -> None:
    gc.collect()
    before, arrays = stream.bytes_read(), {id(a) for a in jax.live_arrays()}
    with pytest.raises(error, match=match):
        fb.from_hf(bad, part="causal-lm")
    assert stream.bytes_read() == before, "a weight was read before the folder was refused"
    assert {id(a) for a in jax.live_arrays()} <= arrays, "arrays were allocated before the folder was refused"


def test_truncated_file_refused_before_any_weight_is_read(folder, tmp_path):
    bad, shards = _bad_copy(folder, tmp_path)
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[:-100])
    _refused_before_reading(bad, CheckpointReadError, "truncated")


def test_index_naming_a_missing_shard_refused_before_any_weight_is_read(folder, tmp_path):
    bad, shards = _bad_copy(folder, tmp_path)
    shards[0].unlink()
    _refused_before_reading(bad, FileNotFoundError, "names shards that are not in the folder")


def test_header_with_a_wrong_shape_refused_before_any_weight_is_read(folder, tmp_path):
    bad, shards = _bad_copy(folder, tmp_path)
    for shard in shards:  # give one tensor a shape of the same size that the model does not have
        data = shard.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        name = next((k for k in header if k.endswith("layers.1.mlp.down_proj.weight")), None)
        if name is None:
            continue
        header[name]["shape"] = header[name]["shape"][::-1]  # (32, 64) -> (64, 32): same bytes
        text = json.dumps(header).encode().ljust(n)
        shard.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
        break
    else:
        pytest.fail("no shard holds layers.1.mlp.down_proj.weight")
    _refused_before_reading(bad, ConversionError, r"down_proj.weight|shape")


def test_hub_id_loads_from_the_local_cache_offline(folder, tmp_path, monkeypatch):
    """huggingface_hub's cache layout (models--org--name/refs/main, snapshots/<commit>/...)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for p in folder.iterdir():
        (snapshot / p.name).write_bytes(p.read_bytes())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    got, want = _params(fb.from_hf("org/tiny-llama", part="causal-lm")), _params(fb.from_hf(folder, part="causal-lm"))
    assert all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(FileNotFoundError, match="'org/missing' is not in the Hugging Face cache"):
        fb.from_hf("org/missing", part="causal-lm")


def test_progress_bar_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, log = Tty(), io.StringIO()
    for s in (tty, log):
        p = stream.Progress(2000, threshold=1000, stream=s)
        p.update(1000)
        p.update(1000)
        p.close()
    assert "#" * 30 in tty.getvalue() and tty.getvalue().endswith("\n")
    assert log.getvalue() == ""
    small = Tty()
    stream.Progress(10, threshold=1000, stream=small).update(10)
    assert small.getvalue() == ""


# ------------------------------------------------------------------ sharded as it loads

_MESH = textwrap.dedent("""
    import sys, json
    import jax, numpy as np
    from flax import nnx
    import flax_blocks as fb
    from flax_blocks import sharding as S
    from flax_blocks.checkpoints import stream
    folder = sys.argv[1]
    ids = np.arange(24).reshape(2, 12) % 96
    forward = nnx.jit(lambda m, x: m(x))  # one program per placement (eager: one per op, slower to compile)
    ref = fb.from_hf(folder, part="causal-lm")
    want = np.asarray(forward(ref, ids))
    mesh = S.make_mesh(data=2, model=4)
    model = fb.from_hf(folder, part="causal-lm", mesh=mesh)
    specs = {"/".join(map(str, p)): v.get_value().sharding.spec
             for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert all(isinstance(v.get_value().sharding, jax.sharding.NamedSharding)
               for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert "model" in str(specs["encoder/layers/self_attn/in_kernel"]), specs
    assert "model" in str(specs["encoder/layers/linear1/kernel"]), specs
    assert "model" in str(specs["encoder/layers/linear2/kernel"]), specs
    # each device holds its share of the sharded tensors (a quarter: split 4 ways, copied over "data")
    held, share = {d: 0 for d in mesh.devices.flat}, 0.0
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        a = v.get_value()
        if a.sharding.is_fully_replicated:
            continue
        share += a.nbytes / 4
        for s in a.addressable_shards:
            held[s.device] += s.data.nbytes
    assert share > 0 and max(held.values()) <= 1.1 * share, (held, share)
    got = np.asarray(forward(model, ids))
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err <= 1e-6, err
    stack_ref, stack = fb.from_hf(folder), fb.from_hf(folder, mesh=mesh)  # the stack alone, sharded too
    x = np.random.default_rng(0).standard_normal((2, 12, 32)).astype(np.float32)
    assert np.abs(np.asarray(forward(stack, x)) - np.asarray(forward(stack_ref, x))).max() <= 1e-5
    prompt = ids[:, :5]
    a = np.asarray(fb.generate(ref, prompt, max_new_tokens=6))
    b = np.asarray(fb.generate(model, prompt, max_new_tokens=6))
    assert (a == b).all(), (a, b)

    # every family and dtype: each device's slices equal the whole load's, bit for bit
    for name, path in json.loads(sys.argv[2]).items():
        whole, parts = fb.from_hf(path, part="causal-lm"), fb.from_hf(path, part="causal-lm", mesh=mesh)
        for (p, w), (_, v) in zip(nnx.to_flat_state(nnx.state(whole, nnx.Param)),
                                  nnx.to_flat_state(nnx.state(parts, nnx.Param)), strict=True):
            w = np.asarray(w.get_value())
            bits = f"u{w.itemsize}"
            for shard in v.get_value().addressable_shards:
                assert np.array_equal(np.asarray(shard.data).view(bits), w[shard.index].view(bits)), (name, p)

    # 2 KV heads on a 4-way "model" axis: the q/k/v kernel replicated over it, the rest split
    qwen = sys.argv[3]
    model = fb.from_hf(qwen, part="causal-lm", mesh=mesh)
    specs = {"/".join(map(str, p)): tuple(v.get_value().sharding.spec)
             for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert "model" not in specs["encoder/layers/self_attn/in_kernel"], specs  # (L, E, K=2, G+2, hd)
    assert "model" not in specs["encoder/layers/self_attn/in_bias"], specs
    assert specs["encoder/layers/self_attn/out_kernel"][1] == "model", specs  # (L, H=8, hd, E)
    assert specs["encoder/layers/linear1/kernel"][2] == "model", specs  # (L, E, F)
    assert specs["encoder/layers/linear2/kernel"][1] == "model", specs  # (L, F, E)
    assert S.misplaced(nnx.state(model), mesh, S.TENSOR_PARALLEL) == []
    unsharded = fb.from_hf(qwen, part="causal-lm")
    placed = S.shard_model(fb.from_hf(qwen, part="causal-lm"), mesh, S.TENSOR_PARALLEL)  # one policy
    assert {"/".join(map(str, p)): tuple(v.get_value().sharding.spec)
            for p, v in nnx.to_flat_state(nnx.state(placed, nnx.Param))} == specs
    want = np.asarray(forward(unsharded, ids))
    got = np.asarray(forward(model, ids))
    qerr = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert qerr <= 1e-6, qerr

    # a Qwen2-MoE (8 experts, a shared expert, dense and experts layers mixed) over 4-way expert parallelism:
    # each device holds and reads 2 of the 8 experts of every experts matrix, the router replicated
    moe = sys.argv[4]
    emesh = S.make_mesh(data=2, model=1, expert=4)
    before = stream.bytes_read()
    model = fb.from_hf(moe, part="causal-lm", mesh=emesh)
    read = stream.bytes_read() - before
    params = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    up = params["encoder/experts_mlps/experts/up"]  # (experts layers, X, E, F): the mixed stack's layer 2 alone
    assert up.shape[0] == 1 and params["encoder/dense_mlps/linear1/kernel"].shape[0] == 1
    assert up.sharding.spec[1] == "expert" and all(s.data.shape[1] == 2 for s in up.addressable_shards), up.sharding
    assert params["encoder/experts_mlps/experts/router"].sharding.is_fully_replicated
    unsharded = fb.from_hf(moe, part="causal-lm")
    want = np.asarray(forward(unsharded, ids))
    got = np.asarray(forward(model, ids))
    merr = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert merr <= 1e-6, merr
    print("OK", err, qerr, merr, read)
""")


def _env(devices: int) -> dict:
    """The suite's environment (its XLA flags kept: conftest's fast-compile settings) with
    `devices` simulated CPU devices."""
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))


def _qwen2(folder: Path) -> Path:
    """A Qwen2 of 8 query heads and 2 KV heads (fewer than a 4-way "model" axis)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    transformers.Qwen2ForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


def _qwen2_moe(folder: Path) -> Path:
    """A Qwen2-MoE of 8 experts (top 2, a shared expert), layer 1 dense by mlp_only_layers, layer 2 experts."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      mlp_only_layers=[0], max_position_embeddings=64)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises the routers at zero (every expert tied); routing needs distinct logits
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def _qwen3_fp8(folder: Path) -> Path:
    """A Qwen3 in block-scaled FP8 (blocks of 16 x 32: a device's 24 of 96 MLP rows cross them)."""
    from safetensors.numpy import save_file

    from flax_blocks.checkpoints.quantized import fp8_quantize

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64)
    tensors = {}
    for name, p in transformers.Qwen3ForCausalLM(cfg).state_dict().items():
        tensors[name] = p.detach().numpy()
        if name.endswith("proj.weight"):
            tensors[name], tensors[name + "_scale_inv"] = fp8_quantize(tensors[name], (16, 32))
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    quant = {"quant_method": "fp8", "weight_block_size": [16, 32], "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(cfg.to_dict() | {"quantization_config": quant}))
    return folder


def test_mesh_load_shards_every_parameter_as_it_is_read(folder, families, tmp_path):
    chosen = {k: str(v) for k, v in families.items() if not k.endswith("float16") or k.endswith("bfloat16")}
    qwen = _qwen2(tmp_path / "qwen")
    moe = _qwen2_moe(tmp_path / "moe")
    chosen["qwen3-fp8"] = str(_qwen3_fp8(tmp_path / "fp8"))  # each device dequantizes its slice only
    proc = subprocess.run([sys.executable, "-c", _MESH, str(folder), json.dumps(chosen), str(qwen), str(moe)],
                          env=_env(8),
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


_PROCESS = textwrap.dedent("""
    import sys, json
    import jax, numpy as np
    folder, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from flax import nnx
    from jax.experimental import multihost_utils
    import flax_blocks as fb
    from flax_blocks import sharding as S
    from flax_blocks.checkpoints import stream
    ids = np.arange(24).reshape(2, 12) % 96
    # "model" across the processes: its positions 0, 2 on process 0's devices, 1, 3 on process 1's
    mine, theirs = jax.local_devices(), [d for d in jax.devices() if d.process_index != jax.process_index()]
    first, second = (mine, theirs) if pid == 0 else (theirs, mine)
    mesh = S.make_mesh(data=2, model=4, devices=[d for pair in zip(first, second) for d in pair])
    before = stream.bytes_read()
    model = fb.from_hf(folder, part="causal-lm", mesh=mesh)
    read = stream.bytes_read() - before
    sharded = replicated = 0
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        a = v.get_value()
        if a.sharding.is_fully_replicated:
            replicated += a.nbytes
        else:
            sharded += a.nbytes
    got = multihost_utils.process_allgather(nnx.jit(lambda m, x: m(x))(model, ids), tiled=True)
    want = np.asarray(fb.from_hf(folder, part="causal-lm")(ids))
    err = float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))
    print(json.dumps({"read": read, "sharded": sharded, "replicated": replicated, "err": err}))
""")


def test_two_processes_read_only_their_slices(folder):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, str(folder), str(port), str(i)], env=_env(4), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate() for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    for out, _ in outs:
        r = json.loads(out.strip().splitlines()[-1])
        assert r["err"] <= 1e-6, r
        # each process reads every replicated tensor and half of each sharded one, nothing more
        assert r["read"] <= r["replicated"] + 0.5 * r["sharded"] + 1024, r
        assert r["read"] < r["replicated"] + r["sharded"], r


def test_rules_naming_an_axis_the_mesh_lacks_are_refused_by_name(folder):
    """A user's rules written for another mesh ("tensor" where the mesh says "model")."""
    from jax.sharding import Mesh

    from flax_blocks.sharding import TENSOR_PARALLEL, logical_to_spec

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    assert logical_to_spec(("embed", "heads"), TENSOR_PARALLEL, mesh) == jax.sharding.PartitionSpec(None, "model")
    with pytest.raises(ConversionError, match=r"rule 'heads' -> 'tensor': the mesh has no axis 'tensor'"):
        fb.from_hf(folder, part="causal-lm", mesh=mesh, rules={"heads": "tensor"})
