"""Every GPU-capable test in one call, as evidence: which tree, which GPU, which outcome.

    python3 scripts/gpu_tests.py run --out $OUT/gpu-tests.json      # on the device (bash
                                        # scripts/device_gpu_tests.sh sets up the environment)
    python3 scripts/gpu_tests.py record FILE [--out benchmarks/results/gpu-tests.json]
                                        # here: name the commit the device tested

`run` runs GPU_TEST_FILES with pytest in --jobs processes at once (one GPU; the time goes to
Triton's compiles, which use host cores), each writing --junitxml, and converts the XML into one
JSON (`junit_to_tests`): per test nodeid, outcome, duration (and the message of a failure or a
skip), the GPU (torch.cuda.get_device_name), torch/Triton/CUDA versions, the UTC date, the
files that could not run (SGLang missing) and a summary; it prints a short table. The device
gets a copy of the working tree without .git, so `run` records each source file's git blob id
(`fingerprints`); `record` compares them with this checkout's recent commits: `commit` is the
newest commit whose files are exactly those the device ran (else HEAD, `dirty` true, and the
paths that differ), `kernels_commit` the last commit touching triton_kernels/ as of it.
Exit status: 0 when every test passed (skips allowed), 1 otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "mosaickv-gpu-tests/1"

# Every test file with a test that runs on CUDA: marked `gpu`, or on DEVICE = "cuda" when CUDA
# is there (the Triton kernels then compile for real: conftest.py sets TRITON_INTERPRET only
# without CUDA). Value: relative cost, to spread the files over the parallel pytest processes.
GPU_TEST_FILES = {
    "tests/test_band_decode_kernel.py": 6,  # band decode kernel (+ dense hot-buffer partial)
    "tests/test_page_select_kernel.py": 4,  # page bounds, top pages, rows; decode with selection
    "tests/test_select_sizes_gpu.py": 1,  # top pages at 1K-32K pages (4-32 warps)
    "tests/test_packed_decode.py": 4,  # PackedDecode over a CUDA pool: decode, merge of rows
    "tests/test_pack_install.py": 3,  # pack kernel == torch install; unpack through the pool
    "tests/test_band_pack_kernel.py": 2,
    "tests/test_band_unpack_kernel.py": 2,
    "tests/test_band_errors_kernel.py": 1,  # the chooser's error check; errors_first == cascade
    "tests/test_band_encode_kernel.py": 1,  # the chooser's band encode == the codec's, bit for bit
    "tests/test_transfer.py": 1,  # pinned, non-blocking host-to-device index copies
    "tests/test_basis_fit.py": 1,  # jacobi_tf32's axes on a GPU (the rest runs there too)
    "tests/test_decode_graph_gpu.py": 3,  # the breakable decode CUDA graph, captured for real
    "tests/test_adopt_in_place.py": 2,  # daemon results adopted in place (row_copy) on CUDA
    "tests/test_extend_attention.py": 2,  # prefill attention: SDPA and FlashInfer on CUDA
    "tests/test_chunk_plan.py": 1,  # a forward's chunks in one FlashInfer batch prefill
    "tests/test_batch_invariance.py": 1,  # the same bits whatever the chunking, on FlashInfer
    "tests/test_row_merge_kernel.py": 1,
    "tests/test_row_copy_kernel.py": 1,
    "tests/test_page_gather_kernel.py": 1,
    "tests/test_basis_rotate_kernel.py": 1,  # rows through their bases read by address
    "tests/test_dense_decode_kernel.py": 1,  # the hot partial, gathered and in place
    "tests/test_graph_decode.py": 3,  # the full decode CUDA graph, captured for real
    "tests/test_class_partition_kernel.py": 1,  # a selection grouped by width class
    "tests/test_request_decode_kernel.py": 2,  # the decode graph's attention kernels
    "tests/test_decode_tables_kernel.py": 1,  # the decode graph's per-step tables, one launch
    "tests/test_page_rescore_kernel.py": 1,  # selection's second stage on the compressed K
}
# Files of GPU_TEST_FILES that import SGLang (the server bundle): without it they are reported
# as not run, the others still run.
NEEDS_SGLANG = {"tests/test_packed_decode.py", "tests/test_batch_invariance.py", "tests/test_pack_install.py",
                "tests/test_decode_graph_gpu.py",
                "tests/test_graph_decode.py", "tests/test_request_decode_kernel.py",
                "tests/test_decode_tables_kernel.py", "tests/test_page_rescore_kernel.py"}
# Test files that name CUDA but run on the CPU only (tests/test_gpu_tests_script.py checks that
# every file naming CUDA is in one of the two lists).
CPU_ONLY = {
    "tests/test_decode_graph.py": "drives the backend's graph path on a CPU pool (its triton "
                                  "case needs the interpreter); test_decode_graph_gpu.py is the "
                                  "GPU one",
    "tests/test_daemon.py": "CPU pools; its CUDA mention skips a CPU-interpreter case",
    "tests/test_daemon_position.py": "CPU pools (test_daemon.py's, under read_rule position); "
                                     "its CUDA mention skips a CPU-interpreter case",
    "tests/test_sm90_compile.py": "compiles the kernels for sm_90 without a GPU",
    "tests/test_gpu_tests_script.py": "this runner's converter and lists",
    "tests/test_plugin_hooks.py": "resolves decode_cuda_graph 'auto' for a device named 'cuda' "
                                  "(argument values only)",
}
# A test file "names CUDA" when it matches this (tests/test_gpu_tests_script.py).
NAMES_CUDA = r"mark\.gpu|cuda\.is_available|[\"']cuda[\"']"
# What `run` fingerprints: the sources the tests import and the tests themselves.
TREE = ("triton_kernels", "mosaickv_sglang", "tests", "scripts", "benchmarks", "pyproject.toml")
SKIP_PARTS = ("__pycache__", ".pytest_cache", "results")


# ---- junit XML -> tests -------------------------------------------------------------------

def _nodeid(classname: str, name: str) -> str:
    """pytest's junit classname (dotted module path, then classes) + name -> its nodeid."""
    if not classname:  # a collection error: name is the dotted module path
        parts = name.split(".")
        return "/".join(parts) + ".py" if parts and parts[-1].startswith("test") else name
    parts = classname.split(".")
    # the module is the last part named test*; classes (Test*, upper case) follow it
    mod = max((i for i, p in enumerate(parts) if p.startswith("test")), default=len(parts) - 1)
    return "/".join(parts[:mod + 1]) + ".py" + "".join(f"::{c}" for c in parts[mod + 1:]) + \
        f"::{name}"


def junit_to_tests(xml_text: str) -> list[dict]:
    """Every <testcase> of a pytest --junitxml file -> {nodeid, outcome (passed, failed,
    error, skipped, xfailed), duration (s), message (failures, errors, skips)}. A test that
    failed and then errored in teardown appears once, failed."""
    root = ET.fromstring(xml_text)
    out: dict[str, dict] = {}
    rank = {"passed": 0, "skipped": 1, "xfailed": 1, "error": 2, "failed": 3}
    for case in root.iter("testcase"):
        nodeid = _nodeid(case.get("classname", ""), case.get("name", ""))
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                message = (child.get("message") or (child.text or "").strip())[:500] or None
                if child.tag == "failure":
                    outcome = "failed"
                elif child.tag == "error":
                    outcome = "error"
                else:
                    outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                break
        row = {"nodeid": nodeid, "outcome": outcome,
               "duration": round(float(case.get("time") or 0.0), 3)}
        if message:
            row["message"] = message
        old = out.get(nodeid)
        if old is None or rank[outcome] > rank[old["outcome"]]:
            out[nodeid] = row
    return list(out.values())


def summarize(tests: list[dict]) -> dict:
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped", "xfailed")}
    for t in tests:
        counts[t["outcome"]] += 1
    counts["total"] = len(tests)
    return counts


# ---- the tree the device ran ---------------------------------------------------------------

def blob_id(data: bytes) -> str:
    """git's blob id of a file's bytes (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fingerprints(root: Path = REPO, tree=TREE) -> dict[str, str]:
    out = {}
    for top in tree:
        base = root / top
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for p in paths:
            rel = p.relative_to(root)
            if any(part in SKIP_PARTS or part.endswith(".egg-info") for part in rel.parts) or \
                    p.suffix == ".pyc" or p.is_symlink():
                continue
            out[rel.as_posix()] = blob_id(p.read_bytes())
    return out


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def tree_diff(root: Path, commit: str, prints: dict[str, str], tree=TREE) -> list[str]:
    """Paths whose blob differs between `commit` and `prints` (changed, only on one side)."""
    listed = {}
    for line in _git(root, "ls-tree", "-r", commit, "--", *tree).splitlines():
        meta, path = line.split("\t", 1)
        if any(part in SKIP_PARTS for part in Path(path).parts) or meta.split()[0] == "120000":
            continue  # results/ and symlinks are not fingerprinted
        listed[path] = meta.split()[2]
    return sorted(p for p in set(listed) | set(prints) if listed.get(p) != prints.get(p))


def identify(root: Path, prints: dict[str, str], depth: int = 30) -> dict:
    """The newest of the last `depth` commits whose files equal `prints`, else HEAD (dirty)."""
    head = _git(root, "rev-parse", "HEAD")
    commit, diff = head, tree_diff(root, head, prints)
    if diff:
        for c in _git(root, "rev-list", "-n", str(depth), "HEAD").splitlines()[1:]:
            if not tree_diff(root, c, prints):
                commit, diff = c, []
                break
    kernels = _git(root, "log", "-1", "--format=%H", commit, "--", "triton_kernels")
    return {"commit": commit, "kernels_commit": kernels or None, "dirty": bool(diff),
            "kernels_dirty": any(p.startswith("triton_kernels/") for p in diff),
            "dirty_paths": diff[:200], "head_when_recorded": head}


# ---- run ----------------------------------------------------------------------------------

def device_meta() -> dict:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None,
            "gpu_count": torch.cuda.device_count() if cuda else 0,
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host": platform.node(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET")}


def groups_of(files: list[str], jobs: int) -> list[list[str]]:
    """Longest first onto the lightest group (by GPU_TEST_FILES' costs)."""
    groups = [[] for _ in range(max(1, min(jobs, len(files))))]
    load = [0] * len(groups)
    for f in sorted(files, key=lambda f: -GPU_TEST_FILES.get(f, 1)):
        i = load.index(min(load))
        groups[i].append(f)
        load[i] += GPU_TEST_FILES.get(f, 1)
    return [g for g in groups if g]


def _run_groups(groups, pytest_args, limit_s, log_path, work) -> list[dict]:
    procs = []
    t0 = time.monotonic()
    for i, files in enumerate(groups):
        xml = work / f"junit{i}.xml"
        log = open(work / f"pytest{i}.log", "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
               f"--junitxml={xml}", *pytest_args, *files]
        procs.append((files, xml, log, cmd, subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)))
    results = []
    for files, xml, log, cmd, p in procs:
        interrupted = False
        try:
            p.wait(timeout=max(1.0, limit_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:  # SIGINT: pytest stops and still writes its XML
            interrupted = True
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        log.close()
        results.append({"files": files, "rc": p.returncode, "interrupted": interrupted,
                        "seconds": round(time.monotonic() - t0, 1), "command": cmd[1:],
                        "junit": xml.read_text() if xml.exists() else None})
    with open(log_path, "w") as out:
        for i, (files, *_rest) in enumerate(procs):
            out.write(f"===== group {i}: {' '.join(files)}\n")
            out.write((work / f"pytest{i}.log").read_text())
    return results


def table(report: dict) -> str:
    by_file: dict[str, dict] = {}
    for t in report["tests"]:
        f = t["nodeid"].split("::")[0]
        row = by_file.setdefault(f, {k: 0 for k in ("passed", "failed", "error", "skipped",
                                                    "xfailed")} | {"s": 0.0})
        row[t["outcome"]] += 1
        row["s"] += t["duration"]
    lines = [f"{'file':<40} {'pass':>5} {'fail':>5} {'err':>4} {'skip':>5} {'s':>7}"]
    for f, r in sorted(by_file.items()):
        lines.append(f"{f:<40} {r['passed']:>5} {r['failed']:>5} {r['error']:>4} "
                     f"{r['skipped'] + r['xfailed']:>5} {r['s']:>7.1f}")
    for f, why in report["not_run"].items():
        lines.append(f"{f:<40} NOT RUN: {why}")
    for t in report["tests"]:
        if t["outcome"] in ("failed", "error", "skipped"):
            first = (t.get("message") or "").strip().splitlines()[:1]
            lines.append(f"  {t['outcome'].upper():<7} {t['nodeid']}: "
                         f"{first[0][:150] if first else ''}")
    s = report["summary"]
    lines.append(f"{s['passed']} passed, {s['failed']} failed, {s['error']} errors, "
                 f"{s['skipped']} skipped, {s['xfailed']} xfailed of {s['total']} in "
                 f"{report['seconds']} s on {report['gpu'] or 'no GPU'}; "
                 f"{'OK' if report['ok'] else 'NOT OK'}")
    return "\n".join(lines)


def run(args) -> int:
    import importlib.util

    t0 = time.monotonic()
    prints = fingerprints()  # before pytest writes anything
    git = None
    try:
        git = {"commit": _git(REPO, "rev-parse", "HEAD"),
               "kernels_commit": _git(REPO, "log", "-1", "--format=%H", "--", "triton_kernels"),
               "dirty": bool(_git(REPO, "status", "--porcelain", "--", *TREE))}
    except (OSError, subprocess.CalledProcessError):
        pass  # the device's copy has no .git: `record` names the commit from the fingerprints
    files = list(args.files or GPU_TEST_FILES)
    not_run = {}
    if importlib.util.find_spec("sglang") is None:
        for f in files:
            if f in NEEDS_SGLANG:
                not_run[f] = ("imports SGLang: carry .device/server/server-base.tar.xz "
                              "(scripts/device_gpu_tests.sh)")
    missing = [f for f in files if not (REPO / f).is_file()]
    not_run.update({f: "no such file" for f in missing})
    files = [f for f in files if f not in not_run]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_tests_") as work:
        groups = _run_groups(groups_of(files, args.jobs), args.pytest_args, args.limit_s,
                             out.with_suffix(".log"), Path(work))
    tests = []
    for g in groups:
        if g["junit"] is not None:
            tests += junit_to_tests(g.pop("junit"))
        else:
            g.pop("junit")
            g["error"] = "no junit XML (pytest did not finish; see the log)"
    tests.sort(key=lambda t: t["nodeid"])
    summary = summarize(tests)
    report = {"schema": SCHEMA,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"),
              **(git or {"commit": None, "kernels_commit": None, "dirty": None}),
              "git_on_device": git is not None, **device_meta(),
              "seconds": round(time.monotonic() - t0, 1), "jobs": args.jobs,
              "files": files, "not_run": not_run, "groups": groups, "summary": summary,
              "ok": bool(tests) and not not_run and summary["failed"] == summary["error"] == 0
              and all(g["rc"] == 0 and not g["interrupted"] for g in groups),
              "tests": tests, "fingerprints": prints}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    return 0 if report["ok"] else 1


def record(args) -> int:
    report = json.loads(Path(args.file).read_text())
    if report.get("schema") != SCHEMA:
        raise SystemExit(f"{args.file}: not a {SCHEMA} report")
    if "fingerprints" not in report:  # `record` drops them: e.g. the repo's copy sent back
        raise SystemExit(f"{args.file}: a report recorded already ({report.get('commit')}, "
                         f"recorded {report.get('recorded_utc')}), not one `run` wrote: record "
                         f"the $OUT/gpu-tests.json of the device call")
    found = identify(REPO, report["fingerprints"])
    if report.get("git_on_device") and report["commit"] != found["commit"]:
        found["note"] = f"the device's git named {report['commit']}"
    prints = report.pop("fingerprints")
    report.update(found, fingerprinted_files=len(prints), recorded_utc=datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{args.out}: commit {found['commit'][:12]} (kernels {str(found['kernels_commit'])[:12]})"
          f"{', DIRTY: ' + ' '.join(found['dirty_paths'][:10]) if found['dirty'] else ', clean'}; "
          f"{report['summary']}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the GPU tests, write the JSON report")
    r.add_argument("--out", required=True)
    r.add_argument("--jobs", type=int, default=4, help="pytest processes at once")
    r.add_argument("--limit-s", type=float, default=420,
                   help="then pytest is interrupted (its results so far are kept)")
    r.add_argument("--files", nargs="+", default=None, help="instead of GPU_TEST_FILES")
    r.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    c = sub.add_parser("record", help="name the tested commit; copy into benchmarks/results")
    c.add_argument("file")
    c.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu-tests.json"))
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else record(args)


if __name__ == "__main__":
    sys.exit(main())
