"""benchmarks/daemon_bench.py end to end on the CPU (small shape): the step boundary it times is
the pool's step_boundary() (installing adopted pages into a SegmentStore, reads and copies within the
boundary share), and its JSON carries the breakdown."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("overlap", [False, True])
def test_daemon_bench_installs_adopted_pages_and_reports_the_boundary(tmp_path, overlap):
    out = tmp_path / "daemon.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/daemon_bench.py"),
                           "--shape", "small", "--device", "cpu", "--workers", "1",
                           "--steps", "100", "--step-ms", "10", "--nice", "0", "--share", "0",
                           "--warm-pages", "4", "--json", str(out)] + ["--overlap"] * overlap,
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          # this checkout's package, as its workers (-m from cwd) import it, not
                          # whichever one the environment has installed
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    sat, idle = result["saturated"], result["idle"]
    assert sat["pages_done"] >= 1, proc.stdout[-2000:]
    assert sat["install_ms"]["max"] > 0 and idle["install_ms"]["max"] < sat["install_ms"]["max"]
    slowest = sat["slowest_1pct_boundary_ms"]
    assert set(slowest) >= {"boundary", "alive", "install", "handle", "load", "unpickle", "pump",
                            "gc", "other", "steps"}
    # share 0: one operation (install, read or copy) per boundary, the rest deferred, so a
    # small-shape page (sealed in milliseconds) waits in the boundary, not for the worker
    assert result["bound_by"] == "step boundary" and sat["worker_busy_fraction"] < 0.9, sat
    assert result["daemon_pages_per_busy_core_s"] > result["daemon_pages_per_s"]
    assert "bound by the step boundary: workers busy" in proc.stdout
    assert set(sat["ops_per_boundary"]) <= {"0", "1"} and sat["deferred_ops"] > 0, sat
    assert result["args"]["share"] == 0
    assert result["args"]["nice"] == 0 and "install p50/p99/max ms" in proc.stdout
    assert result["args"]["overlap"] is overlap
    warm = result["warm_up"]  # the store saw the codec's layouts before the measured phases
    assert warm["pages_installed"] >= 4 and warm["layouts_registered"] >= 1, warm
    assert warm["open_jobs_left"] == 0 and "layouts_registered" in sat
    assert ("overlapped with the boundary" in proc.stdout) is overlap
    adopt = sat["adopt_page_ms"]
    assert adopt["pages"] >= 1 and adopt["install"]["max"] > 0 and adopt["load"]["max"] > 0
    # inside an install: the store's adoption timed apart (no kernel launch on this CPU path)
    parts = adopt["install_parts"]
    assert set(parts) == {"store", "launch", "release"} and parts["store"]["max"] > 0, parts
    assert parts["store"]["p50"] <= adopt["install"]["max"] and "inside an install" in proc.stdout
    # the device scripts' closing table: one row per run, its ratios as in the JSON
    table = subprocess.run([sys.executable, str(ROOT / "scripts/summarize_daemon_runs.py"),
                            str(out)], capture_output=True, text=True, timeout=60, check=True)
    row = table.stdout.splitlines()[-1].split(" | ")
    assert row[0] == "| daemon" and row[1] == f"{result['step_p50_ratio']:.3f}", table.stdout
    assert row[2] == f"{result['step_p99_ratio']:.3f}", table.stdout
    assert row[8] == f"{sat['worker_busy_fraction']:.2f}", table.stdout  # what bounds pages/s


def test_adopt_bench_compares_both_paths_on_the_same_bytes(tmp_path):
    """benchmarks/adopt_bench.py (small shape, CPU, kernels through the interpreter): every
    adoption path (a batch of 3 pages in one launch too) and both slot copies timed, stores
    equal."""
    out = tmp_path / "adopt.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/adopt_bench.py"), "--shape",
                           "small", "--device", "cpu", "--reps", "2", "--batch", "3", "--json",
                           str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["same_bytes"] and result["in_place"] and set(result["median_ms"]) == {
        "per_tensor", "arena_ready", "arena_ready_kernels", "in_place_kernels",
        "in_place_kernels_x3"}
    assert all(v["load"] > 0 and v["install"] > 0 for v in result["median_ms"].values())
    assert set(result["pump_host_ms"]) == {"torch", "kernel"}


def test_core_probe_reports_a_slowdown_per_core_and_per_antagonist(tmp_path):
    """scripts/core_probe.py (what slows the scheduler's core: an unreported SMT sibling, memory
    bandwidth, all-core load): every case measured, ratios finite and positive."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the probe needs two cores")
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/core_probe.py"), "--iters", "20",
                           "--reps", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    others = sorted(os.sched_getaffinity(0))[1:]
    assert sorted(int(c) for c in result["per_core_spin"]) == others
    assert set(result["all_others"]) == {"spin", "stream", "svd"}
    ratios = list(result["per_core_spin"].values()) + list(result["all_others"].values())
    assert all(0 < r < 100 for r in ratios), ratios  # NaN fails too
    assert set(result["hidden_siblings"]) <= set(others)
    assert "| svd | all" in proc.stdout
