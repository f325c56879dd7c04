"""`benchmarks/soak_bench.py` keeps its time limit when the loaded phase does not finish: it
checks what answered, fails 'load finished', writes its JSON and exits, instead of being killed by
an outer timeout with nothing written (a GPU soak on 2026-12-07 lost its report so)."""
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class _SlowServer(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer({"internal_states": [{}], "context_length": 4096})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/generate":
            time.sleep(60)  # never within the limit
        self._answer({})


def test_a_cut_loaded_phase_writes_its_report(tmp_path):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _SlowServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    out = tmp_path / "soak.json"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "soak_bench.py"), "--url",
             f"http://127.0.0.1:{srv.server_address[1]}", "--capacity", "2000", "--max-prompt",
             "300", "--requests", "6", "--offer", "1", "--short", "10,20", "--long", "200",
             "--shared-tokens", "50", "--abort-within-s", "2", "--limit-s", "6", "--reserve-s",
             "2", "--json", str(out)], capture_output=True, text=True, timeout=50)
    finally:
        srv.shutdown()
    wall = time.perf_counter() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert wall < 40, wall  # the 60 s requests were not waited for
    report = json.loads(out.read_text())
    checks = {c["claim"]: c for c in report["checks"]}
    assert not checks["load finished"]["pass"]
    assert "answered" in checks["load finished"]["detail"]
    assert not checks["same output as alone"]["pass"]
