"""Loading a real-size Hugging Face checkpoint: `fb.from_hf` against transformers' `from_pretrained`.

    python -m experiments.load_bench                      # ~200M LLaMA, a few minutes -> experiments/results/load/
    python -m experiments.load_bench --small              # tiny checkpoint, seconds (smoke run)

Checkpoint: a LlamaForCausalLM with random weights (torch.manual_seed(0)), float32, written
once by `save_pretrained(folder, max_shard_size=...)` (safetensors shards + index) and reused
while config.json and every shard are there. Default size: hidden 1024, 10 layers, d_ff 2816,
vocab 32000, untied head: ~194M parameters, ~0.78 GB.

Each load runs in its own fresh subprocess (so its memory is that loader's alone), rounds
interleaved (ours, hf, ours, hf, ...):
  baseline  VmRSS (/proc/self/status) after the imports (flax_blocks + jax, or torch +
            transformers) and a warm-up (one small array computed, so the runtime is up)
  time      wall clock of the load: `fb.from_hf(folder, part="causal-lm")` until
            `jax.block_until_ready(nnx.state(model))`, or `AutoModelForCausalLM.from_pretrained`
  peak      VmHWM read right after the load minus the baseline. VmHWM is reset to the current
            RSS just before the load (writing 5 to /proc/self/clear_refs) where the kernel
            allows it; otherwise it is the lifetime high-water mark (`hwm_reset` says which).
            RSS counts the checkpoint's pages a loader maps (mmap) as well as its own copies.
  after     VmRSS after the load (and its anonymous / file-backed split)
  read      then the first read of every weight (a sum of each, timed) and VmHWM / RSS after it:
            transformers 5 maps the shards (private mmap) and returns before reading them, so
            its load alone touches almost nothing; this column is where its weights arrive
The shards are read once by the parent first, so every load finds them in the page cache.
On the first round both workers also compute logits for tokens arange(32).reshape(2, 16)
% vocab, after the measurement; the parent reports max|ours - hf| / max|hf|.
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
CACHE = Path("~/.cache/twin_blocks").expanduser()
LOADERS = ("ours", "hf")
KEYS = ("seconds", "peak_over_baseline", "rss_after", "rss_file_after", "read_seconds", "load_read_seconds",
        "peak_read_over_baseline", "rss_anon_read", "rss_file_read", "baseline_rss")


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


def is_built(folder: Path) -> bool:
    index = folder / "model.safetensors.index.json"
    if not (folder / "config.json").exists():
        return False
    if index.exists():
        return all((folder / f).exists() for f in set(json.loads(index.read_text())["weight_map"].values()))
    return (folder / "model.safetensors").exists()


def build(folder: Path, size: str) -> None:
    """Writes the random LLaMA checkpoint (into a temporary folder, renamed when complete)."""
    if is_built(folder):
        print(f"reusing {folder}")
        return
    import torch
    import transformers

    kw = dict(SIZES[size])
    max_shard_size = kw.pop("max_shard_size")
    config = transformers.LlamaConfig(**kw, tie_word_embeddings=False, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"building {folder}: {n / 1e6:.1f}M parameters, {n * 4 / 1e9:.3f} GB float32")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    model.save_pretrained(tmp, max_shard_size=max_shard_size)
    if folder.exists():  # a partial earlier build
        import shutil
        shutil.rmtree(folder)
    tmp.rename(folder)


def worker(loader: str, folder: str, logits_out: str | None) -> dict[str, Any]:
    """One load in this (fresh) process; returns the measurements."""
    if loader == "ours":
        import jax
        import jax.numpy as jnp
        from flax import nnx

        import flax_blocks as fb
        for name in ("flax_blocks.checkpoints.hf", "flax_blocks.checkpoints.hf_models"):  # lazy modules from_hf uses
            importlib.import_module(name)
        jax.block_until_ready(jnp.ones(8) + 1)
    else:
        import torch
        from transformers import AutoModelForCausalLM
        importlib.import_module("transformers.models.llama.modeling_llama")  # lazy in transformers
        torch.ones(8).add_(1)
    base = proc_status()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        hwm_reset = proc_status()["VmHWM"] <= base["VmRSS"] * 1.01 + (1 << 20)
    except OSError:
        hwm_reset = False
    t0 = time.perf_counter()
    if loader == "ours":
        model = fb.from_hf(folder, part="causal-lm")
        jax.block_until_ready(nnx.state(model))
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
    seconds = time.perf_counter() - t0
    after = proc_status()
    t0 = time.perf_counter()
    weights = jax.tree.leaves(nnx.state(model)) if loader == "ours" else list(model.parameters())
    for w in weights:  # numpy on both sides (zero-copy views on CPU): no compile, no autograd
        np.asarray(w if loader == "ours" else w.detach()).sum()
    dtypes = sorted({str(w.dtype) for w in weights})
    read_seconds = time.perf_counter() - t0
    read = proc_status()
    if logits_out:
        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        tokens = np.arange(32).reshape(2, 16) % vocab
        if loader == "ours":
            logits = np.asarray(model(jnp.asarray(tokens)))
        else:
            with torch.no_grad():
                logits = model(torch.as_tensor(tokens)).logits.numpy()
        np.save(logits_out, logits.astype(np.float32))
    return dict(loader=loader, seconds=seconds, baseline_rss=base["VmRSS"], baseline_hwm=base["VmHWM"],
                hwm_reset=hwm_reset, peak_hwm=after["VmHWM"], peak_over_baseline=after["VmHWM"] - base["VmRSS"],
                rss_after=after["VmRSS"], rss_anon_after=after["RssAnon"], rss_file_after=after["RssFile"],
                read_seconds=read_seconds, load_read_seconds=seconds + read_seconds,
                peak_read_over_baseline=read["VmHWM"] - base["VmRSS"], rss_anon_read=read["RssAnon"],
                rss_file_read=read["RssFile"], dtypes=dtypes, source=fb.__file__ if loader == "ours" else None)


def run_worker(loader: str, folder: Path, logits_out: Path | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "experiments.load_bench", "--_worker", loader, "--folder", str(folder)]
    if logits_out:
        cmd += ["--logits-out", str(logits_out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode:
        raise RuntimeError(f"{loader} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stats(xs: list[float]) -> dict[str, float]:
    return dict(min=min(xs), median=statistics.median(xs), max=max(xs))


def write_summary(out: Path, res: dict[str, Any]) -> None:
    ck, gb = res["checkpoint"], 1e9
    def x(v):
        return f"{v / ck['bytes']:.2f}"
    rows = ["| loader | load (s) min / med / max | peak over baseline after load: GB, x ckpt min / med / max "
            "| RSS after load (GB) | + first read of every weight (s) | peak over baseline after read: GB, x ckpt "
            "| RSS after read: anon / file (GB) |", "|---|---|---|---|---|---|---|"]
    for name in LOADERS:
        s = res["stats"][name]
        t, p, q = s["seconds"], s["peak_over_baseline"], s["peak_read_over_baseline"]
        rows.append(f"| {name} | {t['min']:.2f} / {t['median']:.2f} / {t['max']:.2f} | {p['median'] / gb:.3f}, "
                    f"{x(p['min'])} / {x(p['median'])} / {x(p['max'])} | {s['rss_after']['median'] / gb:.3f} | "
                    f"{s['read_seconds']['median']:.2f} | {q['median'] / gb:.3f}, {x(q['median'])} | "
                    f"{s['rss_anon_read']['median'] / gb:.3f} / {s['rss_file_read']['median'] / gb:.3f} |")
    o, h = res["stats"]["ours"], res["stats"]["hf"]

    def versus(key: str, less: str, more: str) -> str:  # ours against hf, medians: "2.10x faster"
        a, b = o[key]["median"], h[key]["median"]
        return f"{b / a:.2f}x {less}" if a <= b else f"{a / b:.2f}x {more}"

    lib = res["library"]
    text = [
        "# Loading a Hugging Face checkpoint: fb.from_hf vs transformers",
        "",
        f"Checkpoint: LLaMA, {ck['parameters'] / 1e6:.1f}M parameters, float32, {ck['bytes'] / gb:.3f} GB in "
        f"{ck['shards']} safetensors shards ({ck['folder']}). Machine: {res['machine']['cpus']} CPUs, "
        f"{res['machine']['platform']}, 1-min load average {res['machine']['loadavg_before'][0]:.2f} before the run. "
        f"{res['repeats']} rounds, each loader in a fresh process, interleaved.",
        "",
        *rows,
        "",
        f"Load alone (medians): ours (`fb.from_hf(folder, part=\"causal-lm\")`) is "
        f"{versus('seconds', 'faster', 'slower')} than transformers' `from_pretrained` and peaks at "
        f"{versus('peak_over_baseline', 'less', 'more')} host memory over its baseline "
        f"({x(o['peak_over_baseline']['median'])}x vs {x(h['peak_over_baseline']['median'])}x the checkpoint's bytes).",
        f"Load + first read of every weight: ours is {versus('load_read_seconds', 'faster', 'slower')} "
        f"({o['load_read_seconds']['median']:.2f} s vs {h['load_read_seconds']['median']:.2f} s) and peaks at "
        f"{versus('peak_read_over_baseline', 'less', 'more')} ({x(o['peak_read_over_baseline']['median'])}x vs "
        f"{x(h['peak_read_over_baseline']['median'])}x). The read adds "
        f"{(h['rss_file_read']['median'] - h['rss_file_after']['median']) / gb:.3f} GB of file-backed pages to hf's "
        f"RSS (weights mapped from the shards, shared with the page cache) and "
        f"{(o['rss_file_read']['median'] - o['rss_file_after']['median']) / gb:.3f} GB to ours.",
        "",
        f"Logits (2x16 tokens), max|ours - hf| / max|hf|: {res['logits_rel_err']:.2e}. "
        f"Weights dtypes: ours {res['dtypes']['ours']}, hf {res['dtypes']['hf']}.",
        f"Peak = VmHWM - VmRSS before the load (high-water mark reset before the load: {res['hwm_reset']}); "
        f"file pages a loader maps count too. Shards in the page cache for every load.",
        f"flax_blocks: {lib['root']}, " + (f"commit {lib['commit']}, {lib['dirty']} uncommitted files"
                                           if lib["commit"] else "not a git checkout") + ", sources "
        f"{lib['sha256']}" + ("" if lib["sha256_end"] == lib["sha256"] else
                                f" -> {lib['sha256_end']}: CHANGED DURING THE RUN, rounds may differ") + ".",
        f"Versions: {res['versions']}.",
    ]
    (out / "summary.md").write_text("\n".join(text) + "\n")
    (out / "summary.json").write_text(json.dumps(res, indent=1) + "\n")
    print("\n".join(text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("experiments/results/load"))
    ap.add_argument("--folder", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--_worker", choices=LOADERS, help=argparse.SUPPRESS)
    ap.add_argument("--logits-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        print(json.dumps(worker(args._worker, str(args.folder), args.logits_out)))
        return
    size = "small" if args.small else "200m"
    folder = (args.folder or CACHE / ("llama-tiny" if args.small else "llama-200m")).expanduser().resolve()
    build(folder, size)
    files = shards(folder)
    n_bytes = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache, so no loader pays the first disk read
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    from safetensors import safe_open
    params = 0
    for f in files:
        with safe_open(str(f), "np") as sf:
            params += sum(int(np.prod(sf.get_slice(k).get_shape())) for k in sf.keys())  # noqa: SIM118 (safe_open is no dict: it has keys(), no __iter__)
    print(f"checkpoint: {params / 1e6:.1f}M parameters, {n_bytes / 1e9:.3f} GB in {len(files)} shards")

    root = Path(__file__).resolve().parent.parent
    library, load_before = library_state(root), os.getloadavg()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for loader in LOADERS:
                npy = Path(tmp) / f"{loader}.npy" if r == 0 else None
                res = run_worker(loader, folder, npy)
                print(f"round {r} {loader}: {res['seconds']:.2f} s, peak +{res['peak_over_baseline'] / 1e9:.3f} GB "
                      f"({res['peak_over_baseline'] / n_bytes:.2f}x)", flush=True)
                runs.append(dict(res, round=r, loadavg=os.getloadavg()[0]))
        ours, hf = np.load(Path(tmp) / "ours.npy"), np.load(Path(tmp) / "hf.npy")
    rel_err = float(np.abs(ours - hf).max() / np.abs(hf).max())

    import importlib.metadata as md
    versions = {p: md.version(p) for p in ("jax", "flax", "torch", "transformers", "safetensors")}
    summary = dict(
        checkpoint=dict(folder=str(folder), parameters=params, bytes=n_bytes, shards=len(files)),
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(), loadavg_before=load_before,
                     loadavg_after=os.getloadavg()), repeats=args.repeats, versions=versions,
        library=dict(library, sha256_end=library_state(root)["sha256"]), logits_rel_err=rel_err,
        hwm_reset=all(r["hwm_reset"] for r in runs),
        dtypes={name: next(r["dtypes"] for r in runs if r["loader"] == name) for name in LOADERS},
        stats={name: {k: stats([r[k] for r in runs if r["loader"] == name]) for k in KEYS} for name in LOADERS},
        runs=runs)
    args.out.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, summary)


if __name__ == "__main__":
    main()
