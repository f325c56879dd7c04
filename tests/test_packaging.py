"""The package list in pyproject.toml must cover every package folder (it is explicit because
triton_kernels/ is mapped to the import name mosaickv_kernels)."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "mosaickv_sglang").rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {found - listed}"
    assert cfg["package-dir"]["mosaickv_kernels"] == "triton_kernels"
    assert "triton_kernels" not in listed


def test_the_kernels_import_nothing_from_the_package():
    """Data flows one way: triton_kernels/ (mosaickv_kernels) defines the packed layout it reads
    (layout.py) and imports nothing from mosaickv_sglang, at module level or inside functions."""
    import ast

    kernels = ROOT / "triton_kernels"
    arrows = []
    for path in sorted(kernels.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            arrows += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "mosaickv_sglang"]
    assert not arrows, arrows
