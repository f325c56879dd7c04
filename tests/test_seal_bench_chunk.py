"""`benchmarks/seal_bench.py --chunk-layers` on the CPU: the position rule's layer-by-layer
sealing runs, and the batched read-back of a chunk's own pages (`read_back_block`, what the
pool's prefill reads) equals the codec's decode per segment bit for bit over every layer."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_chunk_layers_read_back_is_the_codecs(tmp_path):
    out = tmp_path / "chunk.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "seal_bench.py"), "--device", "cpu",
                    "--tokens", "1152", "--layers", "2", "--heads", "2", "--head-dim", "64",
                    "--chunk-layers", "--config", '{"basis_block_tokens": 512}',
                    "--json", str(out)], check=True, cwd=REPO, timeout=600)
    res = json.loads(out.read_text())
    assert res["pages"] == 9 and res["layers"] == 2
    assert res["max_abs_diff"] == 0.0, res  # three blocks, both layers: the same bits
    assert set(res["segments_per_s"]) == {"batched", "per_segment"}
