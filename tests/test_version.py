"""Both packages say their version (pyproject.toml's) and that they are typed (PEP 561)."""

import tomllib
from pathlib import Path

import flax_blocks
import torch_blocks

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_pyprojects_and_packages_are_typed():
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert flax_blocks.__version__ == torch_blocks.__version__ == want
    for package in (flax_blocks, torch_blocks):
        assert (Path(package.__file__).parent / "py.typed").is_file()
    assert f"## {want}" in (ROOT / "CHANGELOG.md").read_text()


def test_public_names_are_one_list_for_run_time_and_static_tools():
    """flax_blocks' lazy names (imported on first use) are also in __all__ and imported under
    TYPE_CHECKING from the module _LAZY names, so mypy and IDEs see what `fb.X` gives."""
    import ast
    from pathlib import Path

    import flax_blocks as fb

    tree = ast.parse(Path(fb.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    static = {(node.module, alias.name) for node in guarded.body if isinstance(node, ast.ImportFrom)
              for alias in node.names}
    assert static == {(module, name) for name, module in fb._LAZY.items()}
    assert set(fb._LAZY) <= set(fb.__all__) and len(fb.__all__) == len(set(fb.__all__))
    assert all(getattr(fb, name) is not None for name in fb.__all__)
