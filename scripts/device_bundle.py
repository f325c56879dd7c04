"""Build the SGLang 0.5.17 runtime bundle for the H200 device machine from pinned wheels.

The device machine has Python 3.12, torch 2.11 + CUDA 13 and Triton, but no SGLang, no
FlashInfer and no registry. Everything must travel with the working tree, 64 MiB per transfer
(notes/device-runtime.md). This script downloads the exact wheels below (`pip download --no-deps`
for cp312 / manylinux x86_64), checks their sha256 against `scripts/device_bundle.lock`, installs
each archive's wheels with `pip install --no-deps --target`, trims what the server path never
imports, and writes one `tar.xz` per archive under `.device/` (gitignored, never committed):

    python scripts/device_bundle.py --profile kernel   # .device/kernel/kernel.tar.xz
    python scripts/device_bundle.py --profile server   # .device/server/server-*.tar.xz

An archive larger than the transfer limit minus the margin left for the project tree is refused
(exit 1, named). Carry `.device/<profile>` (not `.device`: it holds the wheels too); on the device:
`source scripts/device_env.sh .device/<profile>/<archive>.tar.xz ...` (docs/device.md).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from mosaickv_sglang.assets.wheels import sha256_file

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "scripts" / "device_bundle.lock"
TRANSFER_LIMIT = 64 << 20  # bytes per device call: working tree + carried paths
DEFAULT_MARGIN_MIB = 8  # left for the project tree (the tree's measured size, if larger)
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64",) + tuple(f"manylinux_2_{n}_x86_64"
                                              for n in (17, 24, 26, 27, 28, 31, 34, 35))

# Exact versions (SGLang 0.5.17's pins where it pins; otherwise what its resolver picked on the
# CPU venv, notes/cpu-ci.md; the rest as seen working on the H200, notes/device-runtime.md).
SGLANG = {"sglang": "0.5.17", "sglang-kernel": "0.4.5"}
FLASHINFER = {"flashinfer-python": "0.6.15.post1"}
TVM_FFI = {"apache-tvm-ffi": "0.1.11"}
SERVER_DEPS = {
    "xgrammar": "0.2.1", "transformers": "5.12.1", "tokenizers": "0.22.2",
    "orjson": "3.13.0", "pybase64": "1.5.1", "starlette": "1.10.0", "fastapi": "0.165.0",
    "pydantic": "2.14.4", "pydantic-core": "2.50.5", "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5", "typing-extensions": "4.16.0", "msgspec": "0.23.0",
    "pyzmq": "27.3.0", "setproctitle": "1.3.8", "uvicorn": "0.54.0", "interegular": "0.3.3",
    "partial-json-parser": "0.2.1.1.post7", "python-multipart": "0.0.34",
    "ipython": "9.18.1", "traitlets": "5.16.1", "parso": "0.8.7", "prompt-toolkit": "3.0.53",
    "wcwidth": "0.9.4", "decorator": "5.3.1", "matplotlib-inline": "0.2.2", "pexpect": "4.9.0",
    "ptyprocess": "0.7.0", "stack-data": "0.6.3", "asttokens": "3.0.2", "executing": "2.3.0",
    "pure-eval": "0.2.4", "ipython-pygments-lexers": "1.1.1",
    "torch-memory-saver": "0.0.10", "compressed-tensors": "0.20.1", "loguru": "0.7.3",
    "openai": "2.6.1", "jiter": "0.19.0", "distro": "1.9.0", "sniffio": "1.3.1",
    "openai-harmony": "0.0.4", "blobfile": "3.0.0", "easydict": "1.14", "gguf": "0.19.0",
    "opentelemetry-api": "1.45.2", "opentelemetry-sdk": "1.45.2",
    "opentelemetry-semantic-conventions": "0.66b2", "importlib-metadata": "10.2.0",
    "zipp": "4.1.2", "dill": "0.4.1", "jsonschema": "4.26.0",
    "jsonschema-specifications": "2025.9.1", "referencing": "0.37.0", "rpds-py": "2026.9.1",
    "soundfile": "0.13.1", "cffi": "2.1.1", "pycparser": "3.12", "zstandard": "0.25.0",
    "setuptools-scm": "10.3.4", "nvtx": "0.2.17",
}
PINS = {**SGLANG, **FLASHINFER, **TVM_FFI, **SERVER_DEPS}

# Paths (globs, relative to the install target) removed after install. Every rule must match:
# a rule that matches nothing means the pinned wheel changed and the rule needs a look.
TRIM = {
    "sglang": ["sglang/multimodal_gen", "sglang/test"],  # not imported by the server path
    "sglang-kernel": ["sgl_kernel/flash_ops.abi3.so",  # 1.1 GB, FA3 only
                      "sgl_kernel/sm100", "sgl_kernel/infllm_ops*", "sgl_kernel/flashmla_ops*"],
    "xgrammar": ["xgrammar/lib/libxgrammar.a"],  # 65 MB static library
}
ALWAYS_TRIM = ("bin", "**/__pycache__")  # console scripts (host paths), byte code
# SGLang's dense Triton decode kernel, loaded from source by benchmarks/kernel_bench.py
# (--sglang-src) without importing the rest of SGLang.
SGLANG_KERNEL_SOURCES = ("sglang/kernels/ops/attention/decode_attention.py",
                         "sglang/kernels/ops/attention/score_mod.py")


@dataclass(frozen=True)
class Archive:
    """One tar.xz: wheels installed under site/, optional SGLang kernel sources under
    sglang_src/, and BUNDLE.json with the imports device_env.sh checks after unpacking."""
    name: str
    packages: tuple[str, ...]
    imports: tuple[str, ...]
    sglang_sources: bool = False
    note: str = ""


PROFILES: dict[str, tuple[Archive, ...]] = {
    "kernel": (Archive("kernel", tuple(FLASHINFER) + tuple(TVM_FFI), ("flashinfer", "tvm_ffi"),
                       sglang_sources=True,
                       note="kernel bench: FlashInfer decode + SGLang's Triton decode source"),),
    # xz of everything is ~63 MB (device-runtime.md): over the limit with any project tree, so
    # FlashInfer (only for --attention-backend flashinfer) is its own archive.
    "server": (
        Archive("server-base", tuple(SGLANG) + tuple(TVM_FFI) + tuple(SERVER_DEPS),
                ("sglang.srt.server_args", "sgl_kernel", "xgrammar", "transformers",
                 "tokenizers", "fastapi", "uvicorn", "zmq", "openai"),
                note="SGLang server with the triton attention backend"),
        Archive("server-flashinfer", tuple(FLASHINFER), ("flashinfer",),
                note="add for --attention-backend flashinfer (JIT compiles on first use)"),
    ),
}


@dataclass
class Built:
    archive: Archive
    path: Path
    nbytes: int
    sha256: str
    installed_bytes: int
    trimmed: dict[str, int] = field(default_factory=dict)


# ---- pins and wheels --------------------------------------------------------------------------

def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def wheel_project(filename: str) -> tuple[str, str]:
    """'flashinfer_python-0.6.15.post1-py3-none-any.whl' -> ('flashinfer-python',
    '0.6.15.post1')."""
    if not filename.endswith(".whl") or filename.count("-") < 4:
        raise ValueError(f"not a wheel file name: {filename!r}")
    name, version = filename.split("-")[:2]
    return normalize(name), version


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """sha256sum format: '<sha256>  <wheel file>' per line; '#' lines are comments."""
    out = {}
    if not path.exists():
        return out
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 64:
            raise ValueError(f"{path}:{i}: expected '<sha256>  <wheel>', got {line!r}")
        out[parts[1]] = parts[0]
    return out


def write_lock(entries: dict[str, str], path: Path = LOCK) -> None:
    lines = ["# sha256 of the pinned wheels scripts/device_bundle.py downloads (sha256sum format).",
             "# Regenerate with --update-lock only after changing a pin."]
    lines += [f"{sha}  {name}" for name, sha in sorted(entries.items())]
    path.write_text("\n".join(lines) + "\n")


def find_wheels(wheel_dir: Path, packages) -> dict[str, Path]:
    """package -> its pinned wheel in wheel_dir (exactly one; missing packages omitted)."""
    found: dict[str, list[Path]] = {}
    for p in sorted(wheel_dir.glob("*.whl")):
        name, version = wheel_project(p.name)
        if name in packages and version == PINS[name]:
            found.setdefault(name, []).append(p)
    dup = {k: [p.name for p in v] for k, v in found.items() if len(v) > 1}
    if dup:
        raise SystemExit(f"device_bundle: several wheels for one pin in {wheel_dir}: {dup}")
    return {k: v[0] for k, v in found.items()}


def download(packages, wheel_dir: Path) -> None:
    """pip download of the pinned wheels that are not in wheel_dir yet."""
    have = find_wheels(wheel_dir, packages)
    missing = [f"{p}=={PINS[p]}" for p in packages if p not in have]
    if not missing:
        return
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(wheel_dir)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    print(f"[bundle] pip download {len(missing)} wheels", flush=True)
    subprocess.run(cmd + missing, check=True)


def verify(wheels: dict[str, Path], lock: dict[str, str], update: bool) -> dict[str, str]:
    """sha256 of each wheel; a mismatch with the lock is an error, so is a wheel not in it
    (unless update). Returns file name -> sha256."""
    shas = {p.name: sha256_file(p) for p in wheels.values()}
    bad = {n: (lock[n], s) for n, s in shas.items() if n in lock and lock[n] != s}
    if bad and not update:
        raise SystemExit(f"device_bundle: sha256 mismatch against {LOCK.name} (lock, got): {bad}")
    unknown = sorted(n for n in shas if n not in lock)
    if unknown and not update:
        raise SystemExit(f"device_bundle: wheels not in {LOCK.name}: {unknown}; check them and "
                         f"re-run with --update-lock")
    return shas


# ---- install, trim, archive --------------------------------------------------------------------

def install(wheels: list[Path], target: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--no-index",
           "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
           "--target", str(target), "--quiet"]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd + [str(w) for w in wheels], check=True)


def tree_bytes(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file())


def trim_paths(root: Path, packages) -> list[tuple[str, list[Path]]]:
    """(rule, matched paths) for every TRIM rule of `packages` and ALWAYS_TRIM; raises if a
    package rule matches nothing."""
    out = []
    for pkg in packages:
        for rule in TRIM.get(pkg, ()):
            hits = sorted(root.glob(rule))
            if not hits:
                raise SystemExit(f"device_bundle: trim rule {rule!r} of {pkg}=={PINS[pkg]} "
                                 f"matches nothing under {root}: update TRIM for this wheel")
            out.append((rule, hits))
    for rule in ALWAYS_TRIM:
        out.append((rule, sorted(root.glob(rule))))
    return out


def trim(root: Path, packages) -> dict[str, int]:
    """Delete the trim paths; returns rule -> bytes removed."""
    removed = {}
    for rule, hits in trim_paths(root, packages):
        removed[rule] = 0
        for p in hits:
            if not p.exists():  # under a path an earlier rule removed
                continue
            removed[rule] += tree_bytes(p)
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return removed


def extract_sglang_sources(sglang_wheel: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(sglang_wheel) as z:
        for member in SGLANG_KERNEL_SOURCES:
            (dest / Path(member).name).write_bytes(z.read(member))


def write_tar_xz(stage: Path, out: Path, preset: int = 6) -> None:
    """Deterministic archive: sorted entries, zero mtimes and owners."""
    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        return info

    tmp = out.with_suffix(out.suffix + ".part")
    with tarfile.open(tmp, "w:xz", preset=preset) as tar:
        for p in sorted(stage.rglob("*")):
            if p.is_dir() and not p.is_symlink():
                continue
            tar.add(p, arcname=str(p.relative_to(stage)), recursive=False, filter=clean)
    tmp.replace(out)


def project_tree_bytes() -> int:
    """Bytes of what travels with every call besides carried paths: tracked and untracked,
    not ignored files (git ls-files)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    return sum((REPO / n.decode()).stat().st_size for n in names
               if n and (REPO / n.decode()).is_file())


def archive_limit(margin_mib: float, tree: int) -> int:
    return TRANSFER_LIMIT - max(int(margin_mib * 2**20), tree)


def check_size(name: str, nbytes: int, limit: int) -> None:
    if nbytes > limit:
        raise SystemExit(f"device_bundle: archive {name} is {nbytes / 2**20:.1f} MiB, over the "
                         f"{limit / 2**20:.1f} MiB allowed (64 MiB transfer limit minus the "
                         f"margin for the project tree): trim more or split it")


def split_parts(out: Path, part_mib: int) -> list[Path]:
    """`out` cut into `part_mib`-MiB pieces beside it (`server-base.tar.xz` ->
    `base.part.00`, `base.part.01`, ...), each carried in its own call and joined with `cat`
    on the device (docs/device.md)."""
    stem = out.name.removesuffix(".tar.xz").removeprefix("server-")
    for old in out.parent.glob(f"{stem}.part.*"):
        old.unlink()
    data, step, parts = out.read_bytes(), part_mib * 2**20, []
    for i in range(0, len(data), step):
        parts.append(out.parent / f"{stem}.part.{i // step:02d}")
        parts[-1].write_bytes(data[i:i + step])
    return parts


def build(archive: Archive, wheels: dict[str, Path], out_dir: Path, limit: int,
          split_mib: int = 0) -> Built:
    stage = out_dir / f"stage-{archive.name}"
    if stage.exists():
        shutil.rmtree(stage)
    site = stage / "site"
    print(f"[bundle] {archive.name}: installing {len(archive.packages)} wheels", flush=True)
    install([wheels[p] for p in archive.packages], site)
    removed = trim(site, archive.packages)
    if archive.sglang_sources:
        extract_sglang_sources(wheels["sglang"], stage / "sglang_src")
    meta = {"archive": archive.name, "note": archive.note, "imports": list(archive.imports),
            "pins": {p: PINS[p] for p in archive.packages},
            "sglang_src": archive.sglang_sources, "python": PYTHON_VERSION}
    (stage / "BUNDLE.json").write_text(json.dumps(meta, indent=1) + "\n")
    installed = tree_bytes(stage)
    out = out_dir / f"{archive.name}.tar.xz"
    print(f"[bundle] {archive.name}: compressing {installed / 2**20:.0f} MiB (xz -6)", flush=True)
    write_tar_xz(stage, out)
    nbytes = out.stat().st_size
    shutil.rmtree(stage)
    if nbytes > limit and split_mib:
        parts = split_parts(out, split_mib)
        print(f"[bundle] {archive.name}: {nbytes / 2**20:.1f} MiB is over the "
              f"{limit / 2**20:.1f} MiB one call carries: split into "
              f"{', '.join(p.name for p in parts)}", flush=True)
    elif nbytes > limit:
        out.unlink()
        check_size(archive.name, nbytes, limit)
    return Built(archive, out, nbytes, sha256_file(out), installed, removed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, choices=sorted(PROFILES))
    ap.add_argument("--out", default=str(REPO / ".device"), help="archives, wheels, manifest")
    ap.add_argument("--margin-mib", type=float, default=DEFAULT_MARGIN_MIB,
                    help="MiB kept free for the project tree in each transfer (the tree's "
                         "measured size is used if larger)")
    ap.add_argument("--split-mib", type=int, default=0,
                    help="keep an archive over the limit and cut it into pieces of this many "
                         "MiB (`base.part.NN`), each carried in its own call")
    ap.add_argument("--update-lock", action="store_true",
                    help=f"record the downloaded wheels' sha256 in {LOCK.relative_to(REPO)}")
    args = ap.parse_args(argv)
    if args.margin_mib < 0:
        raise SystemExit(f"device_bundle: --margin-mib={args.margin_mib} must be >= 0")
    out_dir = Path(args.out).resolve()
    wheel_dir = out_dir / "wheels"
    archives = PROFILES[args.profile]
    packages = sorted({p for a in archives
                       for p in a.packages + (("sglang",) if a.sglang_sources else ())})
    tree = project_tree_bytes()
    limit = archive_limit(args.margin_mib, tree)
    print(f"[bundle] project tree {tree / 2**20:.1f} MiB; archive limit {limit / 2**20:.1f} MiB",
          flush=True)

    download(packages, wheel_dir)
    wheels = find_wheels(wheel_dir, packages)
    missing = [p for p in packages if p not in wheels]
    if missing:
        raise SystemExit(f"device_bundle: no pinned wheel for {missing} in {wheel_dir}")
    lock = read_lock()
    shas = verify(wheels, lock, args.update_lock)
    if args.update_lock:
        write_lock({**lock, **shas})

    dest = out_dir / args.profile  # what a call carries: `.device/<profile>` or one file
    dest.mkdir(parents=True, exist_ok=True)
    built = [build(a, wheels, dest, limit, args.split_mib) for a in archives]
    manifest = {"profile": args.profile, "transfer_limit": TRANSFER_LIMIT,
                "project_tree_bytes": tree, "archive_limit": limit,
                "wheels": {wheels[p].name: shas[wheels[p].name] for p in packages},
                "archives": [{"name": b.archive.name, "file": b.path.name, "bytes": b.nbytes,
                              "sha256": b.sha256, "installed_bytes": b.installed_bytes,
                              "trimmed_bytes": b.trimmed, "imports": list(b.archive.imports),
                              "note": b.archive.note} for b in built]}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(b.nbytes for b in built)
    print(f"\n{'archive':<20} {'MiB':>7}  note")
    for b in built:
        print(f"{b.path.name:<20} {b.nbytes / 2**20:>7.2f}  {b.archive.note}")
    fits = total + tree <= TRANSFER_LIMIT
    print(f"together {total / 2**20:.2f} MiB + tree {tree / 2**20:.1f} MiB: "
          + ("fits one call (carry all)" if fits else
             "over one call: carry them in back-to-back calls (docs/device.md)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
