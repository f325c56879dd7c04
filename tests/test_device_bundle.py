"""scripts/device_bundle.py without downloads: pins, lock, trim rules, size refusal, archives."""
import importlib.util
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_bundle.py"
spec = importlib.util.spec_from_file_location("device_bundle", SCRIPT)
db = importlib.util.module_from_spec(spec)
sys.modules["device_bundle"] = db  # dataclasses look their module up
spec.loader.exec_module(db)


def test_every_archive_package_is_pinned_and_locked():
    locked = {db.wheel_project(name) for name in db.read_lock()}
    for archives in db.PROFILES.values():
        for a in archives:
            for pkg in a.packages:
                assert (pkg, db.PINS[pkg]) in locked, f"{pkg}=={db.PINS[pkg]} has no lock entry"
    assert set(db.TRIM) <= set(db.PINS)


def test_wheel_name_parsing_and_lock_roundtrip(tmp_path):
    assert db.wheel_project("flashinfer_python-0.6.15.post1-py3-none-any.whl") == \
        ("flashinfer-python", "0.6.15.post1")
    with pytest.raises(ValueError, match="not a wheel"):
        db.wheel_project("sglang-0.5.17.tar.gz")
    lock = tmp_path / "lock"
    entries = {"a-1-py3-none-any.whl": "0" * 64, "b-2-py3-none-any.whl": "f" * 64}
    db.write_lock(entries, lock)
    assert db.read_lock(lock) == entries
    lock.write_text("abc  x.whl\n")
    with pytest.raises(ValueError, match="expected"):
        db.read_lock(lock)


def test_verify_refuses_mismatch_and_unknown(tmp_path):
    w = tmp_path / "zipp-4.1.2-py3-none-any.whl"
    w.write_bytes(b"wheel bytes")
    sha = db.sha256_file(w)
    assert db.verify({"zipp": w}, {w.name: sha}, update=False) == {w.name: sha}
    with pytest.raises(SystemExit, match="mismatch"):
        db.verify({"zipp": w}, {w.name: "0" * 64}, update=False)
    with pytest.raises(SystemExit, match="not in"):
        db.verify({"zipp": w}, {}, update=False)


def test_trim_removes_rules_and_refuses_stale_rule(tmp_path):
    site = tmp_path / "site"
    for rel in ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so",
                "sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/infllm_ops.cpython-310.so",
                "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/__pycache__/x.pyc", "bin/tool"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(b"x" * 10)
    removed = db.trim(site, ["sglang-kernel"])
    left = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert left == ["sgl_kernel/sm90/common_ops.abi3.so"]
    assert removed["sgl_kernel/flash_ops.abi3.so"] == 10 and removed["bin"] == 10
    with pytest.raises(SystemExit, match="matches nothing"):
        db.trim(site, ["sglang-kernel"])  # the .so files are gone now: stale rules are caught


def test_size_limit_and_deterministic_archive(tmp_path):
    limit = db.archive_limit(8, tree=1 << 20)
    assert limit == db.TRANSFER_LIMIT - (8 << 20)
    assert db.archive_limit(1, tree=5 << 20) == db.TRANSFER_LIMIT - (5 << 20)
    db.check_size("ok", limit, limit)
    with pytest.raises(SystemExit, match="over the"):
        db.check_size("big", limit + 1, limit)
    stage = tmp_path / "stage"
    (stage / "site" / "pkg").mkdir(parents=True)
    (stage / "site" / "pkg" / "m.py").write_text("x = 1\n")
    (stage / "BUNDLE.json").write_text("{}")
    db.write_tar_xz(stage, tmp_path / "a.tar.xz")
    db.write_tar_xz(stage, tmp_path / "b.tar.xz")
    assert db.sha256_file(tmp_path / "a.tar.xz") == db.sha256_file(tmp_path / "b.tar.xz")
    with tarfile.open(tmp_path / "a.tar.xz") as tar:
        assert sorted(tar.getnames()) == ["BUNDLE.json", "site/pkg/m.py"]
