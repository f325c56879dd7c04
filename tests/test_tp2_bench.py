"""benchmarks/tp2_bench.py: how two runs' greedy outputs part (near-ties vs real faults)."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tp2_bench.py"
spec = importlib.util.spec_from_file_location("tp2_bench", SCRIPT)
tp2_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tp2_bench)
Run = tp2_bench.Run


def _run(ids, top1, top2):
    return Run(ids, [[(a, i), (b, -1)] for i, a, b in zip(ids, top1, top2)])


def test_divergence_at_a_near_tie_is_reported_as_one():
    a = [_run([5, 6, 7], [-0.1, -0.5, -0.69], [-3.0, -2.0, -0.70]), _run([1], [-0.2], [-4.0])]
    b = [_run([5, 6, 8], [-0.1, -0.502, -0.695], [-3.0, -2.0, -0.698]), _run([1], [-0.2], [-4.0])]
    got = tp2_bench.divergence(a, b)
    assert got["differing_requests"] == 1 and got["only_near_ties"]
    assert got["top2_gap_at_divergence"] == [0.003]  # the smaller of the two runs' gaps
    assert got["max_logprob_diff_before"] == 0.002


def test_divergence_where_the_choice_was_clear_is_not_a_near_tie():
    a = [_run([5, 6], [-0.1, -0.2], [-3.0, -3.5])]
    b = [_run([5, 9], [-0.1, -0.3], [-3.0, -3.1])]
    got = tp2_bench.divergence(a, b)
    assert got["differing_requests"] == 1 and not got["only_near_ties"]
    assert tp2_bench.divergence(a, a) == {"differing_requests": 0, "top2_gap_at_divergence": [],
                                          "max_logprob_diff_before": 0.0,
                                          "only_near_ties": True}
