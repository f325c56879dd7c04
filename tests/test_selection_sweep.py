"""benchmarks/selection_sweep.py on real SmolLM2 K/V at 2K: one row per variant, and reading
fewer pages never lowers the attention error below reading all of them."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_selection_sweep_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("selection_sweep",
                                                  ROOT / "benchmarks/selection_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.json"
    assert sweep.main(["--tokens", "2048", "--meta-channels", "8", "--budgets", "512",
                       "--rescore", "4", "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["no selection", "meta_channels=8 (default)", "budget_tokens=512",
                          "budget_tokens=512 meta_channels=all",
                          "budget_tokens=512 quest (dense values)",
                          "budget_tokens=512 rescore_factor=4",
                          "budget_tokens=512 rescore_factor=4 meta_only"]
    full, tight = rows["no selection"], rows["budget_tokens=512"]
    assert full["pages_read"] == 1.0 and 0 < tight["pages_read"] < 1.0
    assert tight["attn_rel_err"] > full["attn_rel_err"] > 0
    rescored = rows["budget_tokens=512 rescore_factor=4"]
    assert rescored["pages_read"] == tight["pages_read"]  # the same budget read
    assert rescored["pages_rescored"] > rescored["pages_read"]  # more pages' K scored
    assert tight["pages_rescored"] == 0
    quest = rows["budget_tokens=512 quest (dense values)"]  # nothing compressed: bytes above bf16
    assert quest["physical_ratio"] < 1.0 < tight["physical_ratio"]
    assert 0 < quest["pages_read"] < 1.0
