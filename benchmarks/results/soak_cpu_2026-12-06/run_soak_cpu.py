import json, subprocess, sys
from pathlib import Path
sys.path.insert(0, "tests")
from server_utils import make_tiny_llama, running_server
model = make_tiny_llama(Path("/tmp/soak_tiny"), head_dim=64)
cfg = {"daemon": "process", "daemon_workers": 1, "read_rule": "position", "basis_fit": "first_page", "hot_tokens": 0}
with running_server(model, Path("/tmp/soak_server.log"), "--kv-backend", "mosaickv", "--dtype", "float32",
                    "--max-total-tokens", "8192", "--chunked-prefill-size", "512", "--context-length", "2048",
                    "--mosaickv-config", json.dumps(cfg)) as srv:
    rc = subprocess.run([sys.executable, "benchmarks/soak_bench.py", "--url", srv.url, "--system", "mosaickv_cpu",
        "--requests", "40", "--offer", "2", "--vocab", "49000", "--output", "8", "--short", "64,300",
        "--long", "1200,1800", "--shared-prompts", "2", "--shared-tokens", "512", "--share-long", "0.15",
        "--share-shared", "0.3", "--share-abort", "0.1", "--abort-output", "1000", "--abort-within-s", "15",
        "--limit-s", "1500", "--json", "/tmp/soak_cpu.json"]).returncode
    print("rc", rc)
