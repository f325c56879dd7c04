"""benchmarks/plot_serving.py on small synthetic serving_bench / agent_bench JSON."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plot_serving.py"
spec = importlib.util.spec_from_file_location("plot_serving", SCRIPT)
plot_serving = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_serving)


def _serving_row(system, ctx, batch, tok_s, mosaickv=None):
    return {"system": system, "context": ctx, "batch": batch, "decode_tok_s": tok_s,
            "itl_ms_p50": 1000 * batch / tok_s, "itl_ms_p99": 3000 * batch / tok_s,
            "max_total_num_tokens": 1000 if system == "dense" else 1600,
            "kv_cache_gb": 1000 * 131072 / 2**30 if system == "dense" else 0.5,
            "mosaickv": mosaickv}


def _agent_row(system, sealed_bpt=None):
    memory = {"token_capacity": 1000, "dense_bytes_per_token": 131072,
              "peak_used_tokens": 900}
    if sealed_bpt:
        memory["sealed_bytes_per_token"] = sealed_bpt
    return {"system": system, "workload": "native", "sessions": 2, "turns": 2,
            "itl_ms_p50": 20.0, "itl_ms_p99": 90.0, "memory": memory,
            "per_turn": [{"turn": t, "output_tok_s": 50.0 + t, "cached_ratio": 0.9 + t / 20}
                         for t in range(2)]}


def test_plots_from_serving_and_agent_json(tmp_path, capsys):
    mk = {"sealed_bytes_per_token": 45000.0, "dense_bytes_per_token": 131072}
    serving = [_serving_row("dense", c, b, 50.0 * b) for c in (8192, 32768) for b in (1, 8)]
    serving += [_serving_row("mosaickv", c, 1, 5.0, mk) for c in (8192, 32768)]
    serving.append({"system": "mosaickv", "error": "OutOfMemoryError(...)"})
    (tmp_path / "serving_run").mkdir()
    (tmp_path / "serving_run" / "s.json").write_text(json.dumps(serving))
    (tmp_path / "agent.json").write_text(json.dumps([_agent_row("dense"),
                                                     _agent_row("mosaickv", 40000.0)]))
    out = tmp_path / "plots"
    assert plot_serving.main([str(tmp_path / "serving_run"), str(tmp_path / "agent.json"),
                              "--out", str(out)]) == 0
    names = {"throughput_vs_context.png", "throughput_vs_batch.png", "latency.png",
             "memory.png", "agent_turns.png"}
    assert {p.name for p in out.iterdir()} == names
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mosaickv failed, left out: OutOfMemoryError" in capsys.readouterr().out

    rows, agent = plot_serving.load_rows([tmp_path / "serving_run", tmp_path / "agent.json"])
    mem = plot_serving._memory(rows, agent)
    # dense serving rows carry no byte counts: the reserved cache per token slot stands in
    assert mem["dense\nserving_run"] == {"capacity": 1000, "dense_bytes_per_token": 131072,
                                         "bytes_per_token": 131072,
                                         "reserved_bytes_per_slot": 131072}
    assert mem["mosaickv\nserving_run"]["bytes_per_token"] == 45000.0
    assert mem["mosaickv\nagent"]["bytes_per_token"] == 40000.0
    assert mem["dense\nagent"]["bytes_per_token"] == 131072


def test_unknown_rows_and_empty_inputs_are_refused(tmp_path):
    (tmp_path / "odd.json").write_text(json.dumps([{"system": "dense", "foo": 1}]))
    with pytest.raises(SystemExit, match="neither serving_bench's nor agent_bench's"):
        plot_serving.load_rows([tmp_path / "odd.json"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no JSON files"):
        plot_serving.load_rows([tmp_path / "empty"])


def test_memory_counts_reserved_bytes_per_slot_for_every_system(tmp_path):
    """FP8 rows keep what SGLang reserved (not bf16); MosaicKV reserves hot buffer + store."""
    mk = {"sealed_bytes_per_token": 45000.0, "dense_bytes_per_token": 131072,
          "bytes": {"hot_buffer_capacity": 300 * 2**20},
          "segment_store": {"reserved_bytes": 700 * 2**20}}
    fp8 = _serving_row("fp8", 8192, 1, 60.0)
    fp8["kv_cache_gb"] = 1600 * 65536 / 2**30  # _serving_row: 1600 slots
    rows = [fp8, _serving_row("mosaickv", 8192, 1, 5.0, mk)]
    for r in rows:
        r["source"] = "run"
    mem = plot_serving._memory(rows, [])
    assert mem["fp8\nrun"]["bytes_per_token"] == mem["fp8\nrun"]["reserved_bytes_per_slot"]
    assert mem["fp8\nrun"]["bytes_per_token"] == pytest.approx(65536)
    assert mem["mosaickv\nrun"]["bytes_per_token"] == 45000.0
    assert mem["mosaickv\nrun"]["reserved_bytes_per_slot"] == 1000 * 2**20 / 1600


def test_files_of_the_same_name_from_two_calls_stay_apart(tmp_path):
    for call, tok_s in (("call1", 10.0), ("call2", 20.0)):
        (tmp_path / call).mkdir()
        (tmp_path / call / "serving.json").write_text(
            json.dumps([_serving_row("dense", 1024, 1, tok_s)]))
    serving, _ = plot_serving.load_rows([tmp_path / "call1" / "serving.json",
                                         tmp_path / "call2" / "serving.json"])
    assert {(r["source"], r["decode_tok_s"]) for r in serving} == {
        ("call1/serving", 10.0), ("call2/serving", 20.0)}


def test_largest_batch_ratios_compare_within_one_call_only():
    def row(system, ctx, batch, tok_s, source):
        return {"system": system, "context": ctx, "batch": batch, "decode_tok_s": tok_s,
                "is_largest_batch": True, "source": source}
    rows = [row("dense_flashinfer", 32768, 6, 500.0, "a"), row("mosaickv", 32768, 15, 200.0, "a"),
            row("dense_flashinfer", 65536, 3, 300.0, "b"), row("mosaickv", 65536, 7, 90.0, "b"),
            row("mosaickv", 131072, 3, 30.0, "c")]  # no reference in call c: no ratio
    rows.append({**row("mosaickv", 32768, 1, 10.0, "a"), "is_largest_batch": False})
    assert plot_serving.largest_batch_ratios(rows, "dense_flashinfer") == {
        "mosaickv": [(32768, 0.4), (65536, 0.3)]}


def test_batch_sweep_plot_only_when_a_system_has_several_batches(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one_each = [_serving_row("dense", 8192, 1, 50.0), _serving_row("mosaickv", 8192, 4, 90.0)]
    for r in one_each:
        r["source"] = "run"
    assert not plot_serving.plot_batch_sweep(one_each, tmp_path, plt)
    assert not (tmp_path / "throughput_vs_batch.png").exists()
    swept = one_each + [{**_serving_row("dense", 8192, 2, 80.0), "source": "run"}]
    assert plot_serving.plot_batch_sweep(swept, tmp_path, plt)
    assert (tmp_path / "throughput_vs_batch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
