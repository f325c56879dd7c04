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
