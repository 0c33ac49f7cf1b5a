"""README.md runs as written: every ```python block and every shell command in it.

The Python blocks run in order in one fresh interpreter and one namespace, as a reader pastes
them into one session; each is compiled under the file name README.md with its own line
numbers, so a traceback points at the README line that broke. Shell commands (```bash / sh /
console / shell blocks, one command a line) run in order with `python` meaning this
interpreter. Both run in a folder holding `encoder.pt` (the fixture the README names), with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` as the README's sharding section says.
Only the two top-level make targets are skipped (SKIP, with the reason).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCH = ROOT / "experiments" / "results" / "bench" / "bench.md"
SHELL = ("bash", "sh", "shell", "console")
SKIP = {
    "make run": "creates .venv and runs the ~2-minute quick experiment; its code is tested in test_experiments.py",
    "make test": "runs the whole suite, this test included",
}
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)


@dataclass
class Snippet:
    """One runnable piece of a markdown file: a python block, or one shell command."""

    kind: str  # "python" or "shell"
    line: int  # 1-based line in the file where its text starts
    text: str


def extract(markdown: str) -> list[Snippet]:
    """The python blocks and shell commands of `markdown`, in order. A shell block gives one
    snippet per command: comment-only lines dropped, backslash continuations joined, a
    leading "$ " prompt stripped (console blocks show no output lines here)."""
    out: list[Snippet] = []
    for m in FENCE.finditer(markdown):
        lang, body = m.group(1).lower(), m.group(2)
        line = markdown.count("\n", 0, m.start(2)) + 1
        if lang == "python":
            out.append(Snippet("python", line, body))
        elif lang in SHELL:
            pending, start = "", line
            for i, raw in enumerate(body.splitlines()):
                text = raw.strip()
                if not pending:
                    start = line + i
                    text = text[2:] if text.startswith("$ ") else text
                    if not text or text.startswith("#"):
                        continue
                if text.endswith("\\"):
                    pending += text[:-1] + " "
                    continue
                out.append(Snippet("shell", start, pending + text))
                pending = ""
    return out


def skip_reason(cmd: str) -> str | None:
    """Why a shell command is not run (None: it is run)."""
    head = cmd.split("#")[0].strip()
    return SKIP.get(head)


def stock_encoder_pt(folder: Path) -> Path:
    """The fixture README.md names: folder/encoder.pt, the state_dict() of a stock
    nn.TransformerEncoder of 2 pre-LN GELU layers (d_model 64, 4 heads, d_ff 256, no final norm)."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 256, 0.0, activation="gelu", batch_first=True, norm_first=True)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    path = folder / "encoder.pt"
    torch.save(encoder.state_dict(), path)
    return path


RUNNER = """
import json, sys
blocks = json.loads(sys.argv[1])
namespace = {"__name__": "__main__"}
for b in blocks:
    code = compile("\\n" * (b["line"] - 1) + b["text"], b["file"], "exec")  # tracebacks name the file's lines
    exec(code, namespace)
print("ALL BLOCKS RAN")
"""


def _env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    return env


def _workdir(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A folder with the README's files, and an environment whose `python` is this interpreter."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python"  # a script, not a symlink: a venv's python finds its venv by its own path
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    work = tmp / "work"
    work.mkdir()
    stock_encoder_pt(work)
    return work, _env(bin_dir)


def run_python_blocks(snippets: list[Snippet], cwd: Path, env: dict[str, str], name: str = "README.md"):
    blocks = [{"file": name, "line": s.line, "text": s.text} for s in snippets if s.kind == "python"]
    return subprocess.run([sys.executable, "-c", RUNNER, json.dumps(blocks)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def run_shell(cmd: str, cwd: Path, env: dict[str, str]):
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """(snippets, work folder, env) for README.md; the python blocks have run there once."""
    snippets = extract(README.read_text())
    work, env = _workdir(tmp_path_factory.mktemp("readme"))
    return snippets, work, env


def test_extract_reads_python_and_shell_blocks():
    md = ("text\n```python\nx = 1\n```\n\n```bash\n# a comment\nmake run   # skipped\n"
          "python -m a \\\n  --b 1\n```\n```console\n$ python -m c --help\n```\n```text\nnot code\n```\n")
    got = [(s.kind, s.line, s.text) for s in extract(md)]
    assert got == [("python", 3, "x = 1\n"), ("shell", 8, "make run   # skipped"),
                   ("shell", 9, "python -m a  --b 1"), ("shell", 13, "python -m c --help")]
    assert skip_reason("make run   # skipped") and skip_reason("python -m a") is None


def test_readme_has_examples_and_only_make_is_skipped(readme_run):
    snippets, _, _ = readme_run
    shell = [s.text for s in snippets if s.kind == "shell"]
    assert sum(s.kind == "python" for s in snippets) >= 4 and len(shell) >= 4
    skipped = {s.split("#")[0].strip() for s in shell if skip_reason(s)}
    assert skipped == set(SKIP)  # each skip-list entry is still in the README, nothing else is skipped


def test_readme_python_blocks_run(readme_run):
    snippets, work, env = readme_run
    out = run_python_blocks(snippets, work, env)
    assert out.returncode == 0 and "ALL BLOCKS RAN" in out.stdout, out.stderr[-4000:]


def test_readme_shell_commands_run(readme_run):
    snippets, work, env = readme_run
    failures = []
    for s in snippets:
        if s.kind != "shell" or skip_reason(s.text):
            continue
        out = run_shell(s.text, work, env)
        if out.returncode != 0:
            failures.append(f"README.md:{s.line}: {s.text}\n  exit {out.returncode}: {out.stderr.strip()[-1500:]}")
    assert not failures, "\n".join(failures)
    import torch

    back = torch.load(work / "back.pt", weights_only=True)  # the round trip the README promises
    ref = torch.load(work / "encoder.pt", weights_only=True)
    assert sorted(back) == sorted(ref) and all(torch.equal(back[k], ref[k]) for k in ref)


def test_broken_readme_copy_fails(tmp_path):
    """The test has teeth: a README whose first example misspells a function fails, naming the line."""
    text = README.read_text()
    first = next(s for s in extract(text) if s.kind == "python")
    assert "fb.BlockConfig(" in first.text
    broken_block = first.text.replace("fb.BlockConfig(", "fb.BlockConfg(", 1)
    broken = text.replace(first.text, broken_block, 1)
    (tmp_path / "README.md").write_text(broken)
    bad_line = first.line + broken_block.splitlines().index(
        next(ln for ln in broken_block.splitlines() if "fb.BlockConfg(" in ln))
    work, env = _workdir(tmp_path)
    out = run_python_blocks(extract((tmp_path / "README.md").read_text()), work, env)
    assert out.returncode != 0 and "ALL BLOCKS RAN" not in out.stdout
    assert f'File "README.md", line {bad_line}' in out.stderr and "BlockConfg" in out.stderr, out.stderr[-2000:]
    cmd = next(s for s in extract(text) if s.kind == "shell" and "flax_blocks.convert" in s.text)
    out = run_shell(cmd.text.replace("--num-heads", "--num-heds"), work, env)  # a broken command fails too
    assert out.returncode != 0 and "--num-heds" in out.stderr


def test_readme_speed_rows_are_the_committed_benchmark():
    """Every ratio in README's speed table is one of bench.md's, and every JAX / torch ratio
    row of bench.md is in the README (unfavourable ones included)."""
    readme, bench = README.read_text(), BENCH.read_text()
    ratio = re.compile(r"\d+\.\d\d \[\d+\.\d\d, \d+\.\d\d\]")
    section = readme[readme.index("**Speed**"):readme.index("An Encoder's compile time")]
    table = "\n".join(line for line in section.splitlines() if re.match(r"\| (block|encoder) ", line))
    shown = ratio.findall(table)
    measured = re.findall(r"\| jax(?: unrolled)? / torch(?:\.compile)? \| (\d+\.\d\d \[\d+\.\d\d, \d+\.\d\d\]) \|", bench)
    assert shown and measured
    assert set(shown) <= set(measured), set(shown) - set(measured)
    assert sorted(shown) == sorted(measured)
    rows = re.findall(r"^\| ((?:block|encoder) [^|]+) \| (forward|train) \|.*\| (\d+) % \|$", section, re.M)
    assert len(rows) == len(re.findall(r"\| jax(?: unrolled)? / torch \|", bench))  # one README row per JAX / torch ratio
    for shape, step, peak in rows:  # JAX's % of peak, from the same row of bench.md
        mode = "fwd" if step == "forward" else "train"
        shape, unrolled, _ = shape.partition(", unrolled (scan_layers=False)")
        jax = "jax unrolled" if unrolled else "jax"
        row = re.search(rf"^\| {re.escape(shape)} float32 \| {jax} {mode} \|[^|]*\|[^|]*\| (\d+) \|", bench, re.M)
        assert row and row.group(1) == peak, (shape, step, peak)
