"""The capacity issue's soak and flood, scaled to the CPU (`benchmarks/soak_bench.py` against a
real SGLang server on the CPU platform): a tiny random Llama served with `--kv-backend mosaickv`
and the traffic-independent config with the daemon (`read_rule: position`, `daemon: process`),
concurrent short, long, shared-prefix and aborted requests offering 2x the tokens the pool holds,
one daemon worker SIGKILLed while it holds pages; then an even sample of 8 finished requests
alone after a flush. Every claim must pass: no errors, aborts end early, bytes exact, the daemon
restarted once, the same greedy output as alone for every request re-run, nothing leaked after
the flush. The GPU version is `SOAK=1` in scripts/device_serving.sh."""
import json
import subprocess
import sys
from pathlib import Path

from server_utils import make_tiny_llama, running_server

# 160 new tokens: under the position rule a request's prompt pages before its window are sealed
# inline and only the window's and generated tokens' full pages go to the worker, so each
# finished request gives it a page
# (with 8 the worker was often idle and the kill, which waits for pages in flight, never came)

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"daemon": "process", "daemon_workers": 1, "read_rule": "position",
          "basis_fit": "first_page", "hot_tokens": 0}


def test_soak_and_flood_pass_on_a_cpu_server(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny", head_dim=64)
    out = tmp_path / "soak.json"
    with running_server(model, tmp_path / "server.log", "--kv-backend", "mosaickv",
                        "--dtype", "float32", "--max-total-tokens", "4096",
                        "--chunked-prefill-size", "512", "--context-length", "2048",
                        "--mosaickv-config", json.dumps(CONFIG)) as srv:
        run = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "soak_bench.py"), "--url", srv.url,
             "--system", "mosaickv_cpu", "--requests", "16", "--offer", "2", "--vocab", "49000",
             "--output", "160", "--short", "64,300", "--long", "700,1100", "--shared-prompts", "2",
             "--shared-tokens", "384", "--share-long", "0.15", "--share-shared", "0.3",
             "--share-abort", "0.15", "--abort-output", "1000", "--abort-within-s", "8",
             "--alone", "8", "--limit-s", "600", "--request-timeout-s", "600", "--json", str(out)],
            capture_output=True, text=True, timeout=840, cwd=REPO)
    report = json.loads(out.read_text()) if out.exists() else {}
    checks = {c["claim"]: c for c in report.get("checks", [])}
    assert run.returncode == 0 and checks and all(c["pass"] for c in checks.values()), (
        run.stdout[-4000:], run.stderr[-4000:])
    # the workload is what the claims are about: a flood, every kind, a worker killed
    kinds = {r["kind"] for r in report["requests"]}
    assert kinds == {"short", "long", "shared", "abort"}, kinds
    assert report["offered"] >= 2 * report["capacity"], (report["offered"], report["capacity"])
    assert report["watcher"]["killed"], report["watcher"]
    assert report["alone_checked"] == report["alone_equal"] == 8  # an even sample of 8 re-run
