"""The RULER CLI end to end on the real SmolLM2: it starts a dense and a MosaicKV SGLang server
itself, runs RULER niah_single_1 at 2K (2 samples) and two DSL multiple-choice questions on each,
and writes per-task scores, losses, the measured compression ratio and the DSL agreement; a rerun
resumes from the results file without starting any server."""
import json

import pytest

from mosaickv_sglang.assets.smollm2 import DEFAULT_OUT as SMOLLM2
from mosaickv_sglang.eval import ruler

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(),
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh")]


def test_ruler_cli_dense_vs_mosaickv_with_dsl(tmp_path, monkeypatch):
    out = tmp_path / "ruler.json"
    argv = ["--tasks", "niah_single_1", "--length", "2048", "--samples", "2",
            "--systems", "dense", "mosaickv", "--dsl", "2", "--concurrency", "2",
            "--json", str(out), "--report", str(tmp_path / "report"), "--no-progress"]
    assert ruler.main(argv) == 0
    s = json.loads(out.read_text())
    dense, mosaic = s["systems"]["dense"], s["systems"]["mosaickv"]
    cell = "niah_single_1@2048"
    assert dense["status"] == mosaic["status"] == "ok"
    assert dense["scores"][cell]["n"] == mosaic["scores"][cell]["n"] == 2
    assert dense["scores"][cell]["score"] >= 50  # SmolLM2 finds a 2K needle (measured: 100)
    # MosaicKV loses nothing here: these are ruler_cpu_2k's two niah_single_1@2048 prompts (same
    # seed, length and sample count), where it scored 100 like dense, and it scored 100 on all
    # 50 of the cell's samples on the H200 (benchmarks/RESULTS.md). With 2 samples any looser
    # bound would let it lose half the needles.
    assert mosaic["scores"][cell]["score"] >= dense["scores"][cell]["score"], (mosaic, dense)
    assert dense["prompt_token_mismatches"] == 0  # the server tokenized what was generated
    assert s["competent_cells"] == [cell]
    assert mosaic["loss"]["average"] == dense["scores"][cell]["score"] - mosaic["scores"][cell]["score"]
    assert mosaic["ratio_source"].startswith("measured") and mosaic["ratio"] >= 2.5
    assert mosaic["stats"]["sealed_pages"] > 0
    dsl = s["dsl"]["systems"]
    assert set(dsl) == {"dense", "mosaickv"} and s["dsl"]["questions"] == 2
    assert dsl["dense"]["select"]["agreement_with_dense"] == 100.0
    # MosaicKV answers as dense does on at least one of the two questions for each program:
    # `select` (option log-probs over one context) and `fork` (adds a free 16-token greedy
    # branch). Question 2 is a near tie: length-normalised option log-probs -0.284 vs -0.323
    # under dense, -0.316 vs -0.285 under the default config (the chunk read rule: the context's
    # pages computed dense, then sealed with group bases), which picks the other option; the
    # position rule (pages computed from compressed reads, first-page bases) kept dense's order
    # (-0.272 vs -0.316), and 2/2 was this test's bar while it was the default. Measured
    # 2026-12-04 (bisected to the default's change, 9c66c50); over 20 questions on the H200
    # 95% and 80% (benchmarks/RESULTS.md).
    agree = {p: dsl["mosaickv"][p]["agreement_with_dense"] for p in ("select", "fork")}
    assert agree["select"] >= 50.0 and agree["fork"] >= 50.0, agree
    assert (tmp_path / "report" / "ruler.png").stat().st_size > 1000
    assert "| niah_single_1@2048 |" in (tmp_path / "report" / "ruler.md").read_text()

    def no_server(*a, **k):
        raise AssertionError("a resumed run must not start a server")
    monkeypatch.setattr(ruler, "running_server", no_server)
    assert ruler.main(argv) == 0
    assert json.loads(out.read_text())["systems"]["mosaickv"]["scores"] == mosaic["scores"]


def test_a_system_whose_server_cannot_start_is_reported_unsupported(tmp_path):
    """The server's own error line becomes the system's status; nothing is silently skipped."""
    from types import SimpleNamespace

    from mosaickv_sglang.eval.runner import ResultStore
    from mosaickv_sglang.eval.systems import System

    bad = System("bogus", "a KV dtype SGLang does not know", kv_backend="default",
                 extra_args=("--kv-cache-dtype", "fp3"), nominal_ratio=5.0)
    store = ResultStore(tmp_path / "r.jsonl")
    args = SimpleNamespace(model=SMOLLM2, startup_s=300, concurrency=1, retries=0, timeout=60,
                           no_progress=True)
    ruler.run_system(bad, [], [], store, "fp", args, bad.server_args(), tmp_path / "logs")
    rec = store.system_record("bogus", "fp")
    assert rec["kind"] == "unsupported"
    assert "--kv-cache-dtype" in rec["reason"] and "fp3" in rec["reason"], rec["reason"]
