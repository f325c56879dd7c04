"""The codec's acceptance run on real SmolLM2 KV (4K tokens of essay haystack): the quick
fidelity benchmark as a user runs it, and its claims (ratio >= 3, beats the global mask and
no-rotation top-r at equal bytes, not dominated by KIVI-like quantization)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mosaickv_sglang.assets.smollm2 import DEFAULT_OUT
from mosaickv_sglang.bench.fidelity import check_claims

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not (DEFAULT_OUT / "CHECKSUMS.sha256").exists(),
                    reason="SmolLM2 assets not built: run bash scripts/setup.sh")
def test_quick_fidelity_run(tmp_path: Path):
    out = tmp_path / "fidelity.json"
    proc = subprocess.run([sys.executable, "-m", "mosaickv_sglang.bench.fidelity", "--quick",
                           "--json", str(out)], capture_output=True, text=True,
                          timeout=1800)  # ~90 s alone; >900 s on a 2-core box shared with servers
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    for r in records:
        assert {"method", "physical_ratio", "attn_rel_err"} <= r.keys()
        assert r["attn_rel_err"] == r["attn_rel_err"], f"NaN error for {r['method']}"
    assert sum(r["default"] for r in records) == 1
    dense = next(r for r in records if r["method"] == "dense")
    assert dense["attn_rel_err"] < 1e-5
    failed = [claim for ok, claim in check_claims(records) if not ok]
    assert not failed, failed
