"""The fidelity benchmark over several seeds: means with 95% t-intervals, and claims against the
baselines as paired margins that hold only when the margin's interval is above 0."""
import math

import pytest

from mosaickv_sglang.bench.fidelity import mean_interval, over_seeds, paired_claims


def test_mean_interval_matches_the_t_formula():
    m, lo, hi = mean_interval([1.0, 2.0, 4.0])
    sd = math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    assert m == pytest.approx(7 / 3)
    assert hi - m == pytest.approx(4.303 * sd / math.sqrt(3))
    assert m - lo == pytest.approx(hi - m)
    assert mean_interval([0.5]) == (0.5, 0.5, 0.5)


def _records(default_errs, kivi_errs, ratio=3.2, kivi_ratio=3.0):
    out = []
    for seed, (d, k) in enumerate(zip(default_errs, kivi_errs)):
        out.append({"method": "mosaickv (default)", "default": True, "seed": seed,
                    "context_tokens": 8192, "physical_ratio": ratio, "attn_rel_err": d,
                    "mass_recall": 1.0, "pages_read": 0.5})
        out.append({"method": "kivi-int4", "default": False, "seed": seed,
                    "context_tokens": 8192, "physical_ratio": kivi_ratio, "attn_rel_err": k,
                    "mass_recall": 1.0, "pages_read": 1.0})
    return out


def test_paired_margin_decides_not_the_means():
    # KIVI worse on every seed by a steady margin: holds
    ok = dict((c.split(" (")[0], p) for p, c in paired_claims(
        _records([0.07, 0.08, 0.09], [0.075, 0.086, 0.094])))
    assert ok["beats 'kivi-int4'"]
    # same means, but the margin changes sign between seeds: the interval covers 0, fails
    ok = dict((c.split(" (")[0], p) for p, c in paired_claims(
        _records([0.07, 0.08, 0.09], [0.10, 0.06, 0.095])))
    assert not ok["beats 'kivi-int4'"]


def test_over_seeds_groups_by_length_and_method():
    rows = over_seeds(_records([0.07, 0.08, 0.09], [0.1, 0.1, 0.1]))
    assert [(r["method"], r["seeds"]) for r in rows] == [
        ("mosaickv (default)", [0, 1, 2]), ("kivi-int4", [0, 1, 2])]
    assert rows[0]["attn_rel_err"] == pytest.approx(0.08)
    assert rows[1]["attn_rel_err_low"] == pytest.approx(0.1)
