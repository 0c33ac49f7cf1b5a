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
