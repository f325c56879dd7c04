"""benchmarks/agent_bench.py end to end on SmolLM2 (CPU): dense and MosaicKV servers, 3 sessions x
2 turns over a 512-token shared system prompt, native and DSL workloads. The MosaicKV pool's
counters must show the prefix compressed once (one seal per prefix position) and read from the
radix tree by every session (reuses per position >= sessions). Sizes are small: the whole run
takes 5-25 min on the shared 2-core CPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from server_utils import SMOLLM2

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(),
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh")]

ROOT = Path(__file__).resolve().parents[1]
SESSIONS, TURNS, PREFIX = 3, 2, 512


def test_agent_bench_prefix_sealed_once_and_reused(tmp_path):
    out = tmp_path / "agent.json"
    # user messages of 64 tokens: the prefix's last page leaves the hot window on turn 1
    cmd = [sys.executable, str(ROOT / "benchmarks/agent_bench.py"), "--model", str(SMOLLM2),
           "--sessions", str(SESSIONS), "--turns", str(TURNS), "--system-tokens", str(PREFIX),
           "--user-tokens", "64", "--output", "4", "--dense-backend", "torch_native",
           "--server-arg=--dtype", "--server-arg=float32", "--server-arg=--max-total-tokens",
           "--server-arg=16384", "--logs", str(tmp_path / "logs"), "--json", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the bench stops its servers on SIGTERM
        pytest.fail(f"agent_bench timed out:\n{proc.communicate(timeout=120)[0][-3000:]}")
    assert proc.returncode == 0, stdout[-3000:]
    rows = {(r["system"], r.get("workload")): r for r in json.loads(out.read_text())}
    assert set(rows) == {(s, w) for s in ("dense", "mosaickv") for w in ("native", "dsl")}, \
        stdout[-3000:]
    for (system, workload), r in rows.items():
        assert r["requests"] == SESSIONS * TURNS and r["output_tokens"] == SESSIONS * TURNS * 4
        # every request of every session got the whole prefix from the cache
        assert r["requests_with_prefix_cached"] == SESSIONS * TURNS, (system, workload, r)
        assert r["cached_ratio"] > 0.8
        # the peak is polled: None when every request fell between polls, never a wrong 0
        assert r["memory"]["peak_used_tokens"] is None or \
            r["memory"]["peak_used_tokens"] >= PREFIX, (system, workload, r["memory"])
    assert any(r["memory"]["peak_used_tokens"] for r in rows.values()), rows  # the poller works
    for workload in ("native", "dsl"):
        mk = rows["mosaickv", workload]["mosaickv"]
        pages = PREFIX // 128
        assert mk["prefix_pages"] == pages
        assert mk["seals_by_prefix_position"] == [1] * pages, mk  # compressed once, not per session
        assert mk["prefix_pages_reused_by_every_session"] == pages, mk
        assert mk["sealed_pages"] < 2 * pages  # prefix once + each session's own pages
        assert rows["mosaickv", workload]["memory"]["sealed_ratio"] > 2.0
    assert any("prefix pg" in line for line in stdout.splitlines()[-8:])  # the table, last
