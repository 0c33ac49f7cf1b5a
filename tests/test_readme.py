"""README.md and docs/*.md run as written: every ```python block and every shell command.

One test per page that holds examples (`test_examples_run[<page>]`), so that a failure names
its page and the pages spread over pytest-xdist's workers. A page's Python blocks run in order
in one fresh interpreter, in one namespace, as a reader pastes them into one session; each
block is compiled under the page's name (README.md, docs/usage.md, ...) with its own line
numbers, so a traceback points at the line that broke. Then the page's shell commands
(```bash / sh / console / shell blocks, one command a line, indented ones in lists too) run in
order with `python` meaning this interpreter, in a work folder of the page's own holding
`encoder.pt` (the fixture the README names) and a copy of docs/ (for the commands that
regenerate a page), with `XLA_FLAGS=--xla_force_host_platform_device_count=8` as the sharding
example says. No subprocess has a timeout: a busy machine makes a page slower, never red (a
page's heavy command runs in the light mode the page documents). Only the two top-level make
targets are skipped (SKIP, with the reason). The README stays short and every relative link
resolves. The generated tables stay where their writers put them: docs/speed.md's is what the
benchmark writes from its committed run, and docs/parity.md holds the parity report's markers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))]  # paths relative to ROOT
MAX_README_LINES = 250
BENCH = ROOT / "experiments" / "bench" / "results" / "blocks" / "bench.md"
BENCH_JSON = BENCH.with_suffix(".json")
SPEED = DOCS / "speed.md"
SHELL = ("bash", "sh", "shell", "console")
SKIP = {
    "make run": "creates .venv and runs the ~2-minute quick experiment; its code is tested in test_experiments.py",
    "make test": "runs the whole suite, this test included",
}
FENCE = re.compile(r"^([ \t]*)```([\w-]*)[^\n]*\n(.*?)^\1```", re.S | re.M)  # indented too (in a list)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


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
        indent, lang = m.group(1), m.group(2).lower()
        body = "".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in m.group(3).splitlines(True))
        line = markdown.count("\n", 0, m.start(3)) + 1
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
import json, sys, traceback, warnings
failed = []
for page in json.loads(sys.argv[1]):
    namespace = {"__name__": "__main__"}  # a page's own session: nothing of another page's names
    with warnings.catch_warnings():  # a page's warning filters end with it
        try:
            for b in page["blocks"]:
                # compiled under the page's name and lines, so a traceback points at the line
                code = compile("\\n" * (b["line"] - 1) + b["text"], page["file"], "exec")
                exec(code, namespace)
        except BaseException:
            failed.append(page["file"])
            traceback.print_exc()
            continue
    print("PAGE RAN", page["file"], flush=True)
sys.exit(1 if failed else 0)
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
    """A folder with the files the examples read (encoder.pt, a copy of docs/ for the
    commands that regenerate a page), and an environment whose `python` is this interpreter."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python"  # a script, not a symlink: a venv's python finds its venv by its own path
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    work = tmp / "work"
    work.mkdir()
    stock_encoder_pt(work)
    shutil.copytree(DOCS, work / "docs")
    return work, _env(bin_dir)


def run_python_pages(pages: list[tuple[str, list[Snippet]]], cwd: Path, env: dict[str, str]):
    """Each page's python blocks in order, in one namespace of its own, the pages one after
    another in one fresh interpreter (a page that fails is reported and the next one runs).
    stdout says "PAGE RAN <page>" for each page that ran through."""
    payload = [{"file": name, "blocks": [{"line": s.line, "text": s.text} for s in snippets if s.kind == "python"]}
               for name, snippets in pages]
    return subprocess.run([sys.executable, "-c", RUNNER, json.dumps(payload)], cwd=cwd, env=env,
                          capture_output=True, text=True)


def run_python_blocks(snippets: list[Snippet], cwd: Path, env: dict[str, str], name: str = "README.md"):
    return run_python_pages([(name, snippets)], cwd, env)


def run_shell(cmd: str, cwd: Path, env: dict[str, str]):
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True)


def test_extract_reads_python_and_shell_blocks():
    md = ("text\n```python\nx = 1\n```\n\n```bash\n# a comment\nmake run   # skipped\n"
          "python -m a \\\n  --b 1\n```\n```console\n$ python -m c --help\n```\n```text\nnot code\n```\n"
          "1. a step\n\n   ```python\n   if x:\n       y = 2\n   ```\n")
    got = [(s.kind, s.line, s.text) for s in extract(md)]
    assert got == [("python", 3, "x = 1\n"), ("shell", 8, "make run   # skipped"),
                   ("shell", 9, "python -m a  --b 1"), ("shell", 13, "python -m c --help"),
                   ("python", 21, "if x:\n    y = 2\n")]
    assert skip_reason("make run   # skipped") and skip_reason("python -m a") is None


def test_readme_has_examples_and_only_make_is_skipped():
    snippets = extract(README.read_text())
    shell = [s.text for s in snippets if s.kind == "shell"]
    assert sum(s.kind == "python" for s in snippets) >= 4 and len(shell) >= 4
    skipped = {s.split("#")[0].strip() for s in shell if skip_reason(s)}
    assert skipped == set(SKIP)  # each skip-list entry is still in the README, nothing else is skipped


def test_readme_is_short_and_docs_pages_exist():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the long parts belong in docs/"
    for page in ("options", "usage", "dialects", "parity", "lab", "speed", "adding-an-option"):
        assert f"](docs/{page}.md)" in README.read_text(), f"README.md does not link docs/{page}.md"


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_point_to_files(page):
    path = ROOT / page
    broken = []
    for m in LINK.finditer(path.read_text()):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # an anchor, or http:, mailto:, ...
            continue
        if not (path.parent / target).exists():
            broken.append(f"{page}:{path.read_text().count(chr(10), 0, m.start()) + 1}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def run_pages(pages: list[str], folder: Path, env: dict[str, str]) -> list[str]:
    """Run these pages' examples: their python blocks in one fresh interpreter (each page in
    its own namespace, as a reader pastes a page into one session), then each page's shell
    commands in order (they may read what its blocks wrote). Returns the failures."""
    snippets = {page: extract((ROOT / page).read_text()) for page in pages}
    with_python = [p for p in pages if any(s.kind == "python" for s in snippets[p])]
    failures = []
    if with_python:
        out = run_python_pages([(p, snippets[p]) for p in with_python], folder, env)
        ran = set(re.findall(r"^PAGE RAN (\S+)$", out.stdout, re.M))
        if out.returncode != 0 or ran != set(with_python):
            failures.append(f"{sorted(set(with_python) - ran)}: python blocks failed (exit {out.returncode}):\n"
                            f"{out.stderr[-4000:]}")
    for page in pages:
        for s in snippets[page]:
            if s.kind != "shell" or skip_reason(s.text):
                continue
            out = run_shell(s.text, folder, env)
            if out.returncode != 0:
                failures.append(f"{page}:{s.line}: {s.text}\n  exit {out.returncode}: {out.stderr.strip()[-1500:]}")
    return failures


EXAMPLE_PAGES = [p for p in PAGES if extract((ROOT / p).read_text())]  # the pages with examples


def test_the_pages_with_examples_are_found():
    assert {"README.md", "docs/usage.md", "docs/dialects.md", "docs/adding-a-family.md"} <= set(EXAMPLE_PAGES)


@pytest.mark.parametrize("page", EXAMPLE_PAGES)
def test_examples_run(page, tmp_path):
    """A page's examples, as a reader runs them: its python blocks in one fresh interpreter
    (one namespace), then its shell commands in order, in a work folder of its own. One test
    per page: a failure names its page, and the pages spread over pytest-xdist's workers. No
    clock: a busy machine makes a page slower, never red."""
    folder, env = _workdir(tmp_path)
    failures = run_pages([page], folder, env)
    assert not failures, "\n\n".join(failures)
    if page == "README.md":
        import torch

        back = torch.load(folder / "back.pt", weights_only=True)  # the round trip the README promises
        ref = torch.load(folder / "encoder.pt", weights_only=True)
        assert sorted(back) == sorted(ref) and all(torch.equal(back[k], ref[k]) for k in ref)


NUMBER = re.compile(r"(?<![\w.])(?:\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)(?!\w|\.\d)")  # 0.96, 7.2e-7, 1e-12


GENERATED = re.compile(r"<!-- (?:parity-report|bench-table):start.*?<!-- (?:parity-report|bench-table):end -->", re.S)


def test_readme_figures_are_in_the_pages_they_link():
    """Each decimal figure of README's "What is measured" bullets is printed by the code: in
    the generated table of the docs page the bullet links (between its markers), or in the
    generated reports that page links (the .md files under a results/ folder: the lab's
    report.md files, the XLA flag study, the generation bench, the HF config fuzzer's run)."""
    text = README.read_text()
    section = text[text.index("## What is measured"):text.index("\n## ", text.index("## What is measured") + 1)]
    bullets = re.split(r"\n(?=- )", section)[1:]
    assert len(bullets) >= 3
    for bullet in bullets:
        page = DOCS / re.search(r"\]\(docs/([\w-]+\.md)\)", bullet).group(1)
        sources = GENERATED.findall(page.read_text())
        for target in LINK.findall(page.read_text()):
            linked = (page.parent / target.split("#")[0]).resolve()
            if linked.suffix == ".md" and "results" in linked.parts and linked.exists():
                sources.append(linked.read_text())
        printed = {float(n) for s in sources for n in NUMBER.findall(s)}
        figures = NUMBER.findall(" ".join(bullet.split()))
        missing = [n for n in figures if float(n) not in printed]
        assert not missing, f"README's figures {missing} are not printed in {page.name} (or the reports it links)"


def test_readme_parity_figures_are_the_worst_of_the_table():
    """README's parity bullet quotes the table's worst errors (float32 forward, float64
    forward and gradient) and the float64 trajectory's, not some row's."""
    text = README.read_text()
    bullet = " ".join(text[text.index("- **Parity**"):text.index("- **The lab**")].split())
    quoted = {float(n) for n in NUMBER.findall(bullet)}
    table = GENERATED.findall((DOCS / "parity.md").read_text())[0]
    num = r"(\d\.\de-\d\d)"
    rows = [[float(x) for x in m]
            for m in re.findall(rf"^\| [^|]+ \| {num} \| {num} \| {num} \| {num} \|$", table, re.M)]
    assert len(rows) > 10
    worst = {max(r[i] for r in rows) for i in (0, 2, 3)}  # f32 forward, f64 forward, f64 gradient
    traj = re.search(r"^\| float64 \| (\S+) \| (\S+) \|", table, re.M)
    worst |= {float(traj.group(1)), float(traj.group(2))}
    assert worst <= quoted, f"the table's worst figures {sorted(worst - quoted)} are not the README's"
    assert f"over {len(rows)} cases" in bullet


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
    assert out.returncode != 0 and "PAGE RAN" not in out.stdout
    assert f'File "README.md", line {bad_line}' in out.stderr and "BlockConfg" in out.stderr, out.stderr[-2000:]
    cmd = next(s for s in extract(text) if s.kind == "shell" and "flax_blocks.checkpoints.convert" in s.text)
    out = run_shell(cmd.text.replace("--num-heads", "--num-heds"), work, env)  # a broken command fails too
    assert out.returncode != 0 and "--num-heds" in out.stderr


def test_a_docs_page_error_names_its_file_and_line(tmp_path):
    md = "# page\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = x +\n```\n"
    out = run_python_blocks(extract(md), tmp_path, dict(os.environ), name="docs/page.md")
    assert out.returncode != 0 and 'File "docs/page.md", line 10' in out.stderr, out.stderr[-2000:]


def test_pages_in_one_interpreter_keep_their_own_names_and_failures(tmp_path):
    """A page cannot lean on an earlier page's names or warning filters, and a failing page
    is named while the next one still runs."""
    pages = {"a.md": "```python\nimport warnings\nshared = 1\nwarnings.simplefilter('error')\n```\n",
             "b.md": "```python\nimport warnings\nwarnings.warn('fine')\nshared\n```\n",
             "c.md": "```python\nok = True\n```\n"}
    out = run_python_pages([(name, extract(md)) for name, md in pages.items()], tmp_path, dict(os.environ))
    assert out.returncode == 1
    assert re.findall(r"^PAGE RAN (\S+)$", out.stdout, re.M) == ["a.md", "c.md"]
    assert 'File "b.md", line 4' in out.stderr and "NameError: name 'shared'" in out.stderr, out.stderr


def _speed_table() -> str:
    text = SPEED.read_text()
    start, end = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
    assert text.count(start) == 1 and text.count(end) == 1, f"{SPEED} needs one pair of bench-table markers"
    return text[text.index(start):text.index(end)]


def test_speed_rows_are_the_committed_benchmark():
    """Every ratio in docs/speed.md's table is one of bench.md's, and every JAX / torch ratio
    row of bench.md is in the table (unfavourable ones included)."""
    section, bench = _speed_table(), BENCH.read_text()
    ratio = re.compile(r"\d+\.\d\d \[\d+\.\d\d, \d+\.\d\d\]")
    table = "\n".join(line for line in section.splitlines() if re.match(r"\| (block|encoder) ", line))
    shown = ratio.findall(table)
    measured = re.findall(r"\| jax(?: unrolled)? / torch(?:\.compile)? \| "
                          r"(\d+\.\d\d \[\d+\.\d\d, \d+\.\d\d\]) \|", bench)
    assert shown and measured
    assert set(shown) <= set(measured), set(shown) - set(measured)
    assert sorted(shown) == sorted(measured)
    rows = re.findall(r"^\| ((?:block|encoder) [^|]+) \| (forward|train) \|.*\| (\d+) % \|$", section, re.M)
    assert len(rows) == len(re.findall(r"\| jax(?: unrolled)? / torch \|", bench))  # one row per JAX / torch ratio
    for shape, step, peak in rows:  # JAX's % of peak, from the same row of bench.md
        mode = "fwd" if step == "forward" else "train"
        shape, unrolled, _ = shape.partition(", unrolled (scan_layers=False)")
        jax = "jax unrolled" if unrolled else "jax"
        row = re.search(rf"^\| {re.escape(shape)} float32 \| {jax} {mode} \|[^|]*\|[^|]*\| (\d+) \|", bench, re.M)
        assert row and row.group(1) == peak, (shape, step, peak)


def test_speed_table_is_what_the_bench_writes(tmp_path):
    """docs/speed.md's table is exactly what `experiments.bench --from-json ... --doc` writes
    from the committed bench.json: regenerated, not edited."""
    copy = tmp_path / "speed.md"
    copy.write_text(SPEED.read_text())
    out = subprocess.run([sys.executable, "-m", "experiments.bench", "--from-json", str(BENCH_JSON),
                          "--doc", str(copy)],
                         cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert copy.read_text() == SPEED.read_text(), "docs/speed.md's table differs from the committed bench.json's"


def test_parity_table_lives_between_the_report_markers():
    """`python -m parity_tests.twins.report --doc docs/parity.md` finds its markers there (and only there)."""
    from parity_tests.twins.report import DOC, END, START, splice

    assert ROOT / DOC == DOCS / "parity.md"
    text = (ROOT / DOC).read_text()
    assert text.count(START) == 1 and text.count(END) == 1 and text.index(START) < text.index(END)
    table = text[text.index(START) + len(START):text.index(END)].lstrip("\n")
    assert splice(text, table) == text  # what the writer would put back is what is there
    assert re.search(r"^\| case \| f32 forward \| f32 grad \| f64 forward \| f64 grad \|$", table, re.M)
    assert re.search(r"^\| float64 \| \d\.\de-\d\d \|", table, re.M)  # the trajectories
    assert "parity-report:start" not in README.read_text()


def test_only_rows_are_replaced_in_a_generated_table(tmp_path):
    """`--only` (parity_tests.hf.families / published): the named rows replaced in their places,
    the table's other rows kept; a row the table lacks is refused (the whole table is needed)."""
    from parity_tests.markers import replace_rows

    start, end = "<!-- t:start -->", "<!-- t:end -->"
    page = tmp_path / "page.md"
    page.write_text(f"head\n{start}\n| name | x |\n|---|---|\n| a (fam) | 1 |\n| b | 2 |\n| c | 3 |\n{end}\ntail\n")
    replace_rows(str(page), "| name | x |\n|---|---|\n| c | 30 |\n| a (fam) | 10 |\n", start, end, "t")
    assert page.read_text() == (f"head\n{start}\n| name | x |\n|---|---|\n| a (fam) | 10 |\n| b | 2 |\n| c | 30 |\n"
                                f"{end}\ntail\n")
    with pytest.raises(ValueError, match=r"has no rows \['d'\]"):
        replace_rows(str(page), "| d | 4 |\n", start, end, "t")
