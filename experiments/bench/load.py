"""Loading a real-size Hugging Face checkpoint: `fb.from_hf` against transformers' `from_pretrained`
and against the memory's own speed.

    python -m experiments.bench.load            # ~200M LLaMA, float32 and bfloat16 -> experiments/bench/results/load/
    python -m experiments.bench.load --small    # tiny checkpoints, seconds (smoke run)

Checkpoints: a LlamaForCausalLM with random weights (torch.manual_seed(0)), written once per
dtype by `save_pretrained(folder, max_shard_size=...)` (safetensors shards + index) and reused
while config.json and every shard are there. Default size: hidden 1024, 10 layers, d_ff 2816,
vocab 32000, untied head: ~194M parameters, 0.78 GB in float32, 0.39 GB in bfloat16.

Each load runs in its own fresh subprocess (so its memory is that loader's alone), rounds
interleaved (every loader of every dtype once per round, in the order of LOADERS):
  limit     the bandwidth limit: every tensor's bytes copied (`numpy.copyto`) from a memory
            map of its shard into a new array, the page cache to fresh memory and nothing else
            (`limit`: numpy's `np.empty`, which asks the kernel for huge pages; `limit-4k`: the
            loader's own buffers, `place.host_buffer`, small pages)
  ours      `fb.from_hf(folder, part="causal-lm")`, the default reader threads (`place.READERS`)
  ours-1    the same with one reader thread: what the parallel reads buy
  hf        transformers' `AutoModelForCausalLM.from_pretrained(folder)` (dtype "auto": the
            checkpoint's own)
  mesh      `fb.from_hf(..., mesh=make_mesh(data=2, model=4))` on 8 simulated CPU devices
            (XLA_FLAGS=--xla_force_host_platform_device_count=8): each device's slices only
Each worker measures:
  baseline  VmRSS (/proc/self/status) after the imports and a warm-up (one small array
            computed, so the runtime is up)
  time      wall clock of the load (ours: until `jax.block_until_ready(nnx.state(model))`)
  peak      VmHWM read right after the load minus the baseline. VmHWM is reset to the current
            RSS just before the load (writing 5 to /proc/self/clear_refs) where the kernel
            allows it; otherwise it is the lifetime high-water mark (`hwm_reset` says which).
            RSS counts the checkpoint's pages a loader maps (mmap) as well as its own copies.
  read      then the first read of every weight (an integer sum of its bytes, each device's
            shard on a mesh), timed, and VmHWM / RSS after it: transformers 5 maps the shards
            (private mmap) and returns before reading them, so its load alone touches almost
            nothing; this column is where its weights arrive
The shards are read once by the parent first, so every load finds them in the page cache.
The parent also computes the memory each device holds on the 2 x 4 mesh under each sharding
layout (`flax_blocks.sharding.describe` on the abstract model: the placement loading and
`shard_model` give), for the bench's LLaMA and for Qwen2.5-0.5B's shape (2 KV heads, 14
query heads: fewer than and indivisible by the 4-way "model" axis).
On the first round the ours, hf and mesh workers also compute logits for tokens
arange(32).reshape(2, 16) % vocab after the measurement; the parent reports max|ours - hf| /
max|hf| and max|mesh - ours| / max|ours|.
Writes <out>/summary.md and <out>/summary.json (raw numbers, and a hash of the flax_blocks
sources at the start and the end of the run, which differ if the library changed meanwhile).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SIZES: dict[str, dict[str, Any]] = {
    "200m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=10,
                 num_attention_heads=16, num_key_value_heads=16, max_shard_size="200MB"),
    "small": dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_shard_size="100KB"),
}
DTYPES = ("float32", "bfloat16")
CACHE = Path("~/.cache/twin_blocks").expanduser()
LOADERS = ("limit", "limit-4k", "ours", "ours-1", "hf", "mesh")
MESH = (2, 4)  # (data, model) of the simulated mesh
OURS = ("ours", "ours-1", "mesh", "ours-f32")  # ours-f32: fb.from_hf(..., dtype="float32") (the FP8 folder)
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
       "modules_to_not_convert": ["lm_head"]}
KEYS = ("seconds", "peak_over_baseline", "rss_after", "rss_file_after", "read_seconds", "load_read_seconds",
        "peak_read_over_baseline", "rss_anon_read", "rss_file_read", "baseline_rss", "device_bytes")


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def library_state(root: Path) -> dict[str, Any]:
    """Where flax_blocks is read from: its git commit, uncommitted changes, a hash of its sources."""
    h = hashlib.sha256()
    for f in sorted((root / "flax_blocks").rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + f.read_bytes())
    def git(*a):
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "HEAD") or None
    dirty = len(git("status", "--porcelain", "flax_blocks").splitlines()) if commit else None
    return dict(root=str(root), commit=commit, dirty=dirty, sha256=h.hexdigest()[:16])


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def tensors(path: Path) -> list[tuple[int, int]]:
    """(offset, nbytes) of every tensor of a safetensors file, from its header."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return [(8 + n + t["data_offsets"][0], t["data_offsets"][1] - t["data_offsets"][0])
            for name, t in header.items() if name != "__metadata__"]


def is_built(folder: Path) -> bool:
    index = folder / "model.safetensors.index.json"
    if not (folder / "config.json").exists():
        return False
    if index.exists():
        return all((folder / f).exists() for f in set(json.loads(index.read_text())["weight_map"].values()))
    return (folder / "model.safetensors").exists()


def _llama_config(size: str) -> dict[str, Any]:
    """The bench's LLaMA as a config.json dict."""
    kw = {k: v for k, v in SIZES[size].items() if k != "max_shard_size"}
    return dict(model_type="llama", **kw, tie_word_embeddings=False, max_position_embeddings=2048)


def build(folder: Path, size: str, dtype: str) -> None:
    """Writes the random LLaMA checkpoint (into a temporary folder, renamed when complete)."""
    if is_built(folder):
        print(f"reusing {folder}")
        return
    import torch
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in _llama_config(size).items() if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"building {folder}: {n / 1e6:.1f}M parameters, {n * model.dtype.itemsize / 1e9:.3f} GB {dtype}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    model.save_pretrained(tmp, max_shard_size=SIZES[size]["max_shard_size"])
    if folder.exists():  # a partial earlier build
        import shutil
        shutil.rmtree(folder)
    tmp.rename(folder)


def first_read(a: np.ndarray) -> None:
    """Read every byte of `a` once (an integer sum: the same work for any float dtype)."""
    a.view(f"u{a.itemsize}").sum()


def copy_all(folder: Path, small_pages: bool) -> list[np.ndarray]:
    """The bandwidth limit: every tensor copied from a memory map of its shard into a new array."""
    import mmap

    from flax_blocks.checkpoints.convert.place import host_buffer

    out = []
    for path in shards(folder):
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        for offset, nbytes in tensors(path):
            dst = host_buffer((nbytes,), np.uint8) if small_pages else np.empty(nbytes, np.uint8)
            np.copyto(dst, np.frombuffer(m, np.uint8, nbytes, offset))
            out.append(dst)
        m.close()
    return out


def worker(loader: str, folder: str, logits_out: str | None) -> dict[str, Any]:
    """One load in this (fresh) process; returns the measurements."""
    if loader in OURS:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        import flax_blocks as fb
        from flax_blocks.checkpoints import stream
        from flax_blocks.checkpoints.convert import place
        for name in ("flax_blocks.checkpoints.hf", "flax_blocks.checkpoints.checkpoint", "flax_blocks.lm"):  # lazy ones
            importlib.import_module(name)
        if loader == "ours-1":
            place.READERS = 1
        mesh = None
        if loader == "mesh":
            from flax_blocks.sharding import make_mesh
            mesh = make_mesh(*MESH)
        jax.block_until_ready(jnp.ones(8) + 1)
    elif loader == "hf":
        import torch
        from transformers import AutoModelForCausalLM
        importlib.import_module("transformers.models.llama.modeling_llama")  # lazy in transformers
        torch.ones(8).add_(1)
    else:
        import flax_blocks.checkpoints.convert.place  # noqa: F401 (host_buffer, imported before the baseline)
    base = proc_status()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        hwm_reset = proc_status()["VmHWM"] <= base["VmRSS"] * 1.01 + (1 << 20)
    except OSError:
        hwm_reset = False
    before = stream.bytes_read() if loader in OURS else 0
    t0 = time.perf_counter()
    if loader in OURS:
        model = fb.from_hf(folder, part="causal-lm", mesh=mesh, dtype="float32" if loader == "ours-f32" else None)
        jax.block_until_ready(nnx.state(model))
    elif loader == "hf":
        model = AutoModelForCausalLM.from_pretrained(folder)
    else:
        arrays = copy_all(Path(folder), small_pages=loader == "limit-4k")
    seconds = time.perf_counter() - t0
    after = proc_status()
    t0 = time.perf_counter()
    if loader in OURS:
        leaves = jax.tree.leaves(nnx.state(model))
        weights = [np.asarray(s.data) for w in leaves for s in w.addressable_shards]  # zero-copy views on CPU
        dtypes = sorted({str(w.dtype) for w in leaves})
        extra = dict(staged_bytes=stream.staged_bytes(), bytes_read=stream.bytes_read() - before,
                     readers=place.READERS)
    elif loader == "hf":
        weights = [w.detach().view(torch.int16 if w.dtype == torch.bfloat16 else w.dtype).numpy()
                   for w in model.parameters()]
        dtypes = sorted({str(w.dtype) for w in model.parameters()})
        extra = {}
    else:
        weights, dtypes, extra = arrays, ["uint8"], {}
    for w in weights:
        first_read(w)
    read_seconds = time.perf_counter() - t0
    read = proc_status()
    if logits_out and loader in ("ours", "hf", "mesh"):
        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        tokens = np.arange(32).reshape(2, 16) % vocab
        if loader == "hf":
            with torch.no_grad():
                logits = model(torch.as_tensor(tokens)).logits.float().numpy()
        else:
            logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(tokens))).astype(np.float32)
        np.save(logits_out, logits)
    return dict(loader=loader, seconds=seconds, baseline_rss=base["VmRSS"], baseline_hwm=base["VmHWM"],
                hwm_reset=hwm_reset, peak_hwm=after["VmHWM"], peak_over_baseline=after["VmHWM"] - base["VmRSS"],
                rss_after=after["VmRSS"], rss_anon_after=after["RssAnon"], rss_file_after=after["RssFile"],
                read_seconds=read_seconds, load_read_seconds=seconds + read_seconds,
                peak_read_over_baseline=read["VmHWM"] - base["VmRSS"], rss_anon_read=read["RssAnon"],
                rss_file_read=read["RssFile"], device_bytes=sum(w.nbytes for w in weights), dtypes=dtypes, **extra)


def run_worker(loader: str, folder: Path, logits_out: Path | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "experiments.bench.load", "--_worker", loader, "--folder", str(folder)]
    if logits_out:
        cmd += ["--logits-out", str(logits_out)]
    env = dict(os.environ)
    if loader == "mesh":
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={MESH[0] * MESH[1]}"])
    root = Path(__file__).resolve().parents[2]  # the repository's root: its flax_blocks first on sys.path
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env)
    if proc.returncode:
        raise RuntimeError(f"{loader} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stats(xs: list[float]) -> dict[str, float]:
    return dict(min=min(xs), median=statistics.median(xs), max=max(xs))


def _table(ck: dict[str, Any], st: dict[str, Any]) -> list[str]:
    gb = 1e9

    def x(v):
        return f"{v / ck['bytes']:.2f}"

    rows = ["| loader | load (s) min / med / max | peak over baseline after load: GB, x ckpt min / med / max "
            "| + first read (s) | load + read (s) | peak after read: GB, x ckpt | RSS after read: anon / file (GB) "
            "| bytes held (GB) |", "|---|---|---|---|---|---|---|---|"]
    for name in LOADERS:
        s = st[name]
        t, p, q = s["seconds"], s["peak_over_baseline"], s["peak_read_over_baseline"]
        rows.append(f"| {name} | {t['min']:.3f} / {t['median']:.3f} / {t['max']:.3f} | {p['median'] / gb:.3f}, "
                    f"{x(p['min'])} / {x(p['median'])} / {x(p['max'])} | {s['read_seconds']['median']:.3f} | "
                    f"{s['load_read_seconds']['median']:.3f} | {q['median'] / gb:.3f}, {x(q['median'])} | "
                    f"{s['rss_anon_read']['median'] / gb:.3f} / {s['rss_file_read']['median'] / gb:.3f} | "
                    f"{s['device_bytes']['median'] / gb:.3f} |")
    return rows


def write_summary(out: Path, res: dict[str, Any]) -> None:
    gb, lib = 1e9, res["library"]
    text = [
        "# Loading a Hugging Face checkpoint: fb.from_hf vs transformers vs the bandwidth limit",
        "",
        f"Machine: {res['machine']['cpus']} CPUs, {res['machine']['platform']}, 1-min load average "
        f"{res['machine']['loadavg_before'][0]:.2f} before the run. {res['repeats']} rounds, each loader in a fresh "
        f"process, interleaved (every loader of every dtype once per round). Medians unless said.",
    ]
    for dtype, d in res["dtypes"].items():
        ck, st = d["checkpoint"], d["stats"]

        def med(loader: str, key: str) -> float:
            return st[loader][key]["median"]  # noqa: B023 (used at once)

        ours, hf = med("ours", "seconds"), med("hf", "load_read_seconds")
        text += [
            "",
            f"## {dtype}: LLaMA, {ck['parameters'] / 1e6:.1f}M parameters, {ck['bytes'] / gb:.3f} GB in "
            f"{ck['shards']} safetensors shards",
            "",
            *_table(ck, st),
            "",
            f"- ours (`fb.from_hf(folder, part=\"causal-lm\")`, {d['readers']} reader threads): {ours:.3f} s, "
            f"**{ours / hf:.2f}x** transformers' `from_pretrained` + first read ({hf:.3f} s; its load alone "
            f"{med('hf', 'seconds'):.3f} s); ours + first read {med('ours', 'load_read_seconds'):.3f} s "
            f"({med('ours', 'load_read_seconds') / hf:.2f}x).",
            f"- Peak host memory over the baseline: ours {med('ours', 'peak_over_baseline') / ck['bytes']:.2f}x the "
            f"checkpoint's bytes (max over rounds {st['ours']['peak_over_baseline']['max'] / ck['bytes']:.2f}x), "
            f"transformers {med('hf', 'peak_read_over_baseline') / ck['bytes']:.2f}x after its first read.",
            f"- The bandwidth limit (the same bytes copied from a memory map into new arrays): "
            f"{med('limit', 'seconds'):.3f} s into numpy's arrays, {med('limit-4k', 'seconds'):.3f} s into small-page "
            f"buffers; ours is {ours / med('limit-4k', 'seconds'):.2f}x the latter.",
            f"- One reader thread: {med('ours-1', 'seconds'):.3f} s ({med('ours-1', 'seconds') / ours:.2f}x the "
            f"default's time).",
            f"- On the simulated {MESH[0]} x {MESH[1]} mesh (8 CPU devices, each holding its own slices: "
            f"{med('mesh', 'device_bytes') / gb:.3f} GB on all devices together, "
            f"{med('mesh', 'device_bytes') / ck['bytes']:.2f}x the checkpoint): {med('mesh', 'seconds'):.3f} s, "
            f"{med('mesh', 'bytes_read') / gb:.3f} GB read from the files.",
            f"- Bytes passed through a temporary (moves not fused into the copy): ours "
            f"{int(med('ours', 'staged_bytes'))}, mesh {int(med('mesh', 'staged_bytes'))}.",
            f"- Logits (2x16 tokens): max|ours - hf| / max|hf| = {d['logits']['ours_vs_hf']:.2e}, "
            f"max|mesh - ours| / max|ours| = {d['logits']['mesh_vs_ours']:.2e}. Weight dtypes: ours "
            f"{d['weight_dtypes']['ours']}, hf {d['weight_dtypes']['hf']}.",
        ]
    layouts = res["per_device"]
    text += [
        "",
        f"## Memory per device on the {MESH[0]} x {MESH[1]} mesh, by layout",
        "",
        "Parameters' bytes each device holds, as loading with `mesh=` and `shard_model` place them "
        "(`sharding.describe` on the abstract model; an axis its mesh axes do not divide is replicated over them):",
        "",
        "| model | " + " | ".join(k.replace("|", "\\|") for k in LAYOUTS) + " |",
        "|---|" + "---|" * len(LAYOUTS),
        *[f"| {name} | " + " | ".join(f"{v[k] / gb:.3f} GB ({v[k] / v['DATA_PARALLEL']:.2f})" for k in LAYOUTS) + " |"
          for name, v in layouts.items()],
        "",
        "(In brackets: the share of the whole model; DATA_PARALLEL replicates every parameter.)",
        "",
        f"Peak = VmHWM - VmRSS before the load (high-water mark reset before each load: {res['hwm_reset']}); "
        "file pages a loader maps count too. Shards in the page cache for every load. The mesh's 8 devices are one "
        "process's: its host holds all of their slices (replicated tensors 8 times).",
        f"flax_blocks: {lib['root']}, " + (f"commit {lib['commit']}, {lib['dirty']} uncommitted files"
                                           if lib["commit"] else "not a git checkout") + ", sources "
        f"{lib['sha256']}" + ("" if lib["sha256_end"] == lib["sha256"] else
                                f" -> {lib['sha256_end']}: CHANGED DURING THE RUN, rounds may differ") + ".",
        f"Versions: {res['versions']}.",
    ]
    text += ["", "bf16_folder: the bfloat16 folder the FP8 one was quantized from (not quantized), loaded the same way "
             "for comparison. bytes read: from the files (FP8 weights, scales and the bfloat16 rest); staged: the "
             "float32 values that went through a temporary (every dequantized weight)."]
    (out / "summary.md").write_text("\n".join(text) + "\n")
    (out / "summary.json").write_text(json.dumps(res, indent=1) + "\n")
    print("\n".join(text))


QWEN25_05B = dict(  # Qwen/Qwen2.5-0.5B's config.json, the keys that size it (no weights needed)
    model_type="qwen2", hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
    num_hidden_layers=24, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
    max_position_embeddings=32768, hidden_act="silu")
LAYOUTS = ("DATA_PARALLEL", "TENSOR_PARALLEL", "FSDP", "FSDP | TENSOR_PARALLEL")  # rules of flax_blocks.sharding


def per_device_bytes(config: dict[str, Any], itemsize: int) -> dict[str, float]:
    """{layout: bytes of parameters each device holds on the MESH} for a causal LM of this HF
    config, placed as loading and `shard_model` place it (an indivisible axis replicated)."""
    from flax import nnx
    from jax.sharding import AbstractMesh

    from flax_blocks import sharding
    from flax_blocks.checkpoints.checkpoint import lm_config
    from flax_blocks.lm import LanguageModel

    _, cfg, lm = lm_config(config, "causal-lm")
    state = nnx.state(nnx.eval_shape(lambda: LanguageModel(cfg, lm, rngs=nnx.Rngs(0))))
    mesh = AbstractMesh(MESH, ("data", "model"))
    out = {}
    for layout in LAYOUTS:
        rules = sharding.as_rules(None)
        for name in layout.split(" | "):
            rules = rules | getattr(sharding, name)
        total = 0.0
        for _, shape, spec in sharding.describe(state, rules, mesh=mesh):
            axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
            total += float(np.prod(shape)) * itemsize / float(np.prod([mesh.shape[a] for a in axes]))
        out[layout] = total
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("experiments/bench/results/load"))
    ap.add_argument("--folder", type=Path, default=None, help="(workers) the checkpoint folder")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="the FP8 folder's loads only (-> results/load-fp8/)")
    ap.add_argument("--_worker", choices=LOADERS + ("ours-f32",), help=argparse.SUPPRESS)
    ap.add_argument("--logits-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        print(json.dumps(worker(args._worker, str(args.folder), args.logits_out)))
        return
    size = "small" if args.small else "200m"
    if args.fp8:
        fp8_main(args, size)
        return
    folders = {dtype: CACHE / f"llama-{'tiny' if args.small else '200m'}{'' if dtype == 'float32' else '-' + dtype}"
               for dtype in DTYPES}
    checkpoints = {}
    for dtype, folder in folders.items():
        build(folder, size, dtype)
        files = shards(folder)
        for f in files:  # warm the page cache, so no loader pays the first disk read
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
        from safetensors import safe_open
        params = 0
        for f in files:
            with safe_open(str(f), "np") as sf:
                params += sum(int(np.prod(sf.get_slice(k).get_shape())) for k in sf.keys())  # noqa: SIM118 (safe_open is no dict: it has keys(), no __iter__)
        checkpoints[dtype] = dict(folder=str(folder), parameters=params, bytes=sum(f.stat().st_size for f in files),
                                  shards=len(files))
        print(f"{dtype} checkpoint: {params / 1e6:.1f}M parameters, {checkpoints[dtype]['bytes'] / 1e9:.3f} GB in "
              f"{len(files)} shards")

    root = Path(__file__).resolve().parent.parent
    library, load_before = library_state(root), os.getloadavg()
    runs: list[dict[str, Any]] = []
    logits: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for dtype, folder in folders.items():
                for loader in LOADERS:
                    npy = Path(tmp) / f"{dtype}-{loader}.npy" if r == 0 else None
                    res = run_worker(loader, folder, npy)
                    print(f"round {r} {dtype} {loader}: {res['seconds']:.3f} s, peak "
                          f"+{res['peak_over_baseline'] / 1e9:.3f} GB "
                          f"({res['peak_over_baseline'] / checkpoints[dtype]['bytes']:.2f}x)", flush=True)
                    runs.append(dict(res, round=r, dtype=dtype, loadavg=os.getloadavg()[0]))
        for dtype in DTYPES:
            got = {n: np.load(Path(tmp) / f"{dtype}-{n}.npy") for n in ("ours", "hf", "mesh")}
            logits[dtype] = dict(ours_vs_hf=_rel(got["ours"], got["hf"]), mesh_vs_ours=_rel(got["mesh"], got["ours"]))

    import importlib.metadata as md
    versions = {p: md.version(p) for p in ("jax", "flax", "torch", "transformers", "safetensors", "numpy")}
    by_dtype = {}
    for dtype in DTYPES:
        mine = [r for r in runs if r["dtype"] == dtype]
        keys = {name: KEYS + (("staged_bytes", "bytes_read") if name in ("ours", "ours-1", "mesh") else ())
                for name in LOADERS}
        by_dtype[dtype] = dict(
            checkpoint=checkpoints[dtype], logits=logits[dtype],
            readers=next(r["readers"] for r in mine if r["loader"] == "ours"),
            weight_dtypes={name: next(r["dtypes"] for r in mine if r["loader"] == name) for name in ("ours", "hf")},
            stats={name: {k: stats([r[k] for r in mine if r["loader"] == name]) for k in keys[name]}
                   for name in LOADERS})
    summary = dict(
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(), loadavg_before=load_before,
                     loadavg_after=os.getloadavg()), repeats=args.repeats, versions=versions,
        library=dict(library, sha256_end=library_state(root)["sha256"]),
        hwm_reset=all(r["hwm_reset"] for r in runs), dtypes=by_dtype, runs=runs,
        per_device={f"LLaMA {size} float32 (this bench)": per_device_bytes(_llama_config(size), 4),
                    "Qwen2.5-0.5B bfloat16 (its shape)": per_device_bytes(QWEN25_05B, 2)})
    args.out.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, summary)


def build_fp8(folder: Path, source: Path) -> None:
    """The bfloat16 LLaMA in block-scaled FP8 as the published releases hold it (DeepSeek-V3,
    Qwen3-FP8): every projection of the layers float8_e4m3fn with a float32 weight_scale_inv per
    128 x 128 block (`flax_blocks.checkpoints.quantized.fp8_quantize`), the embeddings, norms and
    lm_head (modules_to_not_convert) in bfloat16; one shard per source shard."""
    if is_built(folder):
        print(f"reusing {folder}")
        return
    from safetensors.numpy import save_file

    from flax_blocks.checkpoints import quantized, stream

    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    weight_map: dict[str, str] = {}
    for path in shards(source):
        out: dict[str, np.ndarray] = {}
        for name, t in stream.read_safetensors(path).items():
            if ".layers." in name and name.endswith("proj.weight"):
                out[name], out[name + "_scale_inv"] = quantized.fp8_quantize(t.read().astype(np.float32), (128, 128))
            else:
                out[name] = t.read()
        save_file(out, str(tmp / path.name), metadata={"format": "pt"})
        weight_map.update({n: path.name for n in out})
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((source / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "quantization_config": FP8}, indent=2))
    if folder.exists():
        import shutil
        shutil.rmtree(folder)
    tmp.rename(folder)


def fp8_main(args: argparse.Namespace, size: str) -> None:
    """Peak host memory of loading the FP8 folder, dequantized as read, against the bytes of
    the model it gives (bfloat16, the config's dtype; float32 when asked)."""
    source = CACHE / f"llama-{'tiny' if args.small else '200m'}-bfloat16"
    folder = CACHE / f"llama-{'tiny' if args.small else '200m'}-fp8"
    build(source, size, "bfloat16")
    build_fp8(folder, source)
    files = shards(folder)
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    ckpt = sum(f.stat().st_size for f in files)
    runs = []
    cases = {"ours": folder, "ours-f32": folder, "bf16": source}  # bf16: the unquantized folder, side by side
    for r in range(args.repeats):
        for loader, where in cases.items():
            res = dict(run_worker("ours" if loader == "bf16" else loader, where, None), loader=loader)
            print(f"round {r} {loader}: {res['seconds']:.3f} s, peak +{res['peak_over_baseline'] / 1e9:.3f} GB "
                  f"({res['peak_over_baseline'] / res['device_bytes']:.3f}x the model's bytes)", flush=True)
            runs.append(dict(res, round=r))
    rows = {}
    for loader in cases:
        mine = [r for r in runs if r["loader"] == loader]
        rows[loader] = dict(dtypes=mine[0]["dtypes"], model_bytes=mine[0]["device_bytes"],
                            seconds=stats([r["seconds"] for r in mine]),
                            peak_over_model=stats([r["peak_over_baseline"] / r["device_bytes"] for r in mine]),
                            peak_read_over_model=stats([r["peak_read_over_baseline"] / r["device_bytes"]
                                                        for r in mine]),
                            bytes_read=mine[0]["bytes_read"], staged_bytes=mine[0]["staged_bytes"])
    root = Path(__file__).resolve().parent.parent
    summary = dict(machine=dict(cpus=os.cpu_count(), platform=platform.platform(), loadavg=os.getloadavg()),
                   repeats=args.repeats, checkpoint=dict(folder=str(folder), bytes=ckpt, shards=len(files)),
                   library=library_state(root), loaders=rows, runs=runs)
    out = args.out.parent / "load-fp8" if args.out == Path("experiments/bench/results/load") else args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = ["# Loading an FP8 checkpoint (block-scaled, 128 x 128), dequantized while read", "",
            f"LLaMA {size} (the load bench's, bfloat16) with every projection of its layers in float8_e4m3fn: "
            f"{ckpt / 1e9:.3f} GB in {len(files)} shards. {args.repeats} rounds, each load in a fresh process, "
            f"{os.cpu_count()} CPUs, 1-minute load average {summary['machine']['loadavg'][0]:.1f} at the end. Peak: "
            "VmHWM over the baseline, against the bytes of the model loaded.", "",
            "| load | weights | load (s) min / med / max | peak over baseline, x model bytes min / med / max "
            "| after first read | bytes read (GB) | staged (GB) |", "|---|---|---|---|---|---|---|"]
    for loader, row in rows.items():
        s, p, q = row["seconds"], row["peak_over_model"], row["peak_read_over_model"]
        call = ('fb.from_hf(fp8_folder, part="causal-lm"' + (', dtype="float32")' if loader == "ours-f32" else ")")
                if loader != "bf16" else 'fb.from_hf(bf16_folder, part="causal-lm")')
        text.append(f"| `{call}` | {row['dtypes']} {row['model_bytes'] / 1e9:.3f} GB | {s['min']:.3f} / "
                    f"{s['median']:.3f} / {s['max']:.3f} | {p['min']:.3f} / {p['median']:.3f} / {p['max']:.3f} | "
                    f"{q['median']:.3f} | {row['bytes_read'] / 1e9:.3f} | {row['staged_bytes'] / 1e9:.3f} |")
    text += ["", "bf16_folder: the bfloat16 folder the FP8 one was quantized from (not quantized), loaded the same way "
             "for comparison. bytes read: from the files (FP8 weights, scales and the bfloat16 rest); staged: the "
             "float32 values that went through a temporary (every dequantized weight)."]
    (out / "summary.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
