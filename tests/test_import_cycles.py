"""No import cycles among the project's modules, counting imports inside functions: every
`import` / `from ... import` anywhere in a module is an edge, and so is a name taken through
a package's lazy table (`flax_blocks._LAZY`: `fb.from_hf` imports flax_blocks.checkpoints.hf)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flax_blocks", "torch_blocks", "parity_tests", "experiments")


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _lazy_table(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """{package: {name: module}} from each package __init__'s `_LAZY = {...}` literal."""
    out = {}
    for name, path in modules.items():
        if path.name != "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
                out[name] = {k: f"{name}.{v}" for k, v in ast.literal_eval(node.value).items()}
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: modules it imports}, among the project's modules only."""
    modules = _modules(root)
    lazy = _lazy_table(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}

    def target(name: str) -> str | None:  # the module `name`, or the nearest package holding it
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        aliases: dict[str, str] = {}  # local name -> imported package, for lazy attribute use
        for node in ast.walk(ast.parse(path.read_text())):
            found: list[str] = []
            if isinstance(node, ast.Import):
                for a in node.names:
                    found.append(a.name)
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    found.append(sub if sub in modules else lazy.get(base, {}).get(a.name, base))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                pkg = aliases.get(node.value.id)
                if pkg in lazy and node.attr in lazy[pkg]:
                    found.append(lazy[pkg][node.attr])
            for name in found:
                t = target(name)
                if t is not None and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions count): " + "; ".join(" <-> ".join(c) for c in found)


def test_a_planted_cycle_is_found(tmp_path):
    """The same walk over a copy of the packages with one import planted inside a function."""
    import shutil

    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "results"))
    config = tmp_path / "flax_blocks" / "core" / "config.py"
    config.write_text(config.read_text() + "\n\ndef _planted():\n    from ..checkpoints.convert import load  # noqa\n")
    found = cycles(import_graph(tmp_path))
    assert any("flax_blocks.core.config" in c and "flax_blocks.checkpoints.convert.load" in c for c in found), found


def test_lazy_names_count_as_imports(tmp_path):
    """`import flax_blocks as fb; fb.from_hf` inside flax_blocks.convert is a cycle through the lazy table."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "flax_blocks" / "__init__.py").write_text('_LAZY = {"from_hf": "hf"}\n')
    (tmp_path / "flax_blocks" / "hf.py").write_text("from .convert import x\n")
    (tmp_path / "flax_blocks" / "convert.py").write_text(
        "def f():\n    import flax_blocks as fb\n    return fb.from_hf\n")
    assert cycles(import_graph(tmp_path)) == [["flax_blocks.convert", "flax_blocks.hf"]]
