"""The step boundary's time budget for daemon work (daemon/budget.py), on a fake clock."""
import pytest

from mosaickv_sglang.daemon import budget as budget_mod
from mosaickv_sglang.daemon.budget import BoundaryBudget


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(budget_mod.time, "perf_counter", lambda: now[0])
    return now


def run(b, clock, op, seconds, pages=1):
    clock[0] += seconds
    b.spent(op, seconds, pages)


def test_first_operation_always_runs_later_ones_only_within_the_share(clock):
    b = BoundaryBudget(share=0.04)
    b.open()
    assert b.allows("load")  # first boundary: no period known yet, the first op still runs
    run(b, clock, "load", 0.001)
    assert not b.allows("pump") and b.deferred == 1  # no period yet: nothing more
    clock[0] = 0.100
    b.open()  # period 100 ms -> 4 ms budget
    assert b.period == pytest.approx(0.100)
    assert b.allows("load")
    run(b, clock, "load", 0.0015)
    assert b.allows("load")  # 1.5 + ~1.2 (mean) <= 4
    run(b, clock, "load", 0.0015)
    assert not b.allows("load")  # 3.0 + 1.3 > 4
    assert b.deferred == 2


def test_share_zero_is_one_operation_per_boundary(clock):
    b = BoundaryBudget(share=0.0)
    for step in range(3):
        clock[0] = 0.030 * step
        b.open()
        assert b.allows("install")
        run(b, clock, "install", 0.0001)
        assert not b.allows("load") and not b.allows("pump")
    assert b.deferred == 6


def test_cost_is_predicted_per_page(clock):
    b = BoundaryBudget(share=0.1)
    b.open()
    clock[0] = 0.100
    b.open()  # 10 ms budget
    run(b, clock, "pump", 0.004, pages=2)  # 2 ms a page
    assert b.cost["pump"] == pytest.approx(0.002)
    assert b.allows("pump", pages=2)  # 4 + 4 <= 10
    assert not b.allows("pump", pages=4)  # 4 + 8 > 10
    st = b.stats()
    assert st["page_cost_ms"]["pump"] == pytest.approx(2.0) and st["deferred_ops"] == 1
    assert st["step_period_ms"] == pytest.approx(100.0)


def test_a_lifted_boundary_runs_everything_and_is_counted(clock):
    b = BoundaryBudget(share=0.0)
    b.open()
    b.lift()
    run(b, clock, "install", 0.001)
    assert b.allows("load") and b.allows("pump", pages=8)
    b.open()  # the next boundary is budgeted again unless lifted again
    run(b, clock, "install", 0.001)
    assert not b.allows("load")
    assert b.stats()["unbounded_boundaries"] == 1


def test_an_operation_whose_time_varies_is_predicted_above_its_mean(clock):
    """The prediction is the running mean plus twice the running mean deviation: an operation
    that alternates 0.2 / 1.8 ms (mean ~1 ms) is not let into the ~1.5 ms left of a 3 ms budget,
    one that always takes 1 ms is."""
    def after(times):
        b = BoundaryBudget(share=0.03)
        b.open()
        for t in times:
            clock[0] += 0.1  # 100 ms between boundaries: a 3 ms budget
            b.open()
            run(b, clock, "load", t)
        clock[0] += 0.1
        b.open()
        run(b, clock, "install", 0.0015)
        return b, b.allows("load")

    steady, steady_allowed = after([0.001] * 10)
    jumpy, jumpy_allowed = after([0.0002, 0.0018] * 5)
    assert steady.cost["load"] == pytest.approx(0.001) and steady.dev["load"] < 1e-9
    assert jumpy.cost["load"] == pytest.approx(0.001, rel=0.3) and jumpy.dev["load"] > 0.0005
    assert steady_allowed and not jumpy_allowed
    assert jumpy.stats()["page_cost_dev_ms"]["load"] > 0.5


def test_the_slowest_boundaries_are_kept_with_their_parts(clock):
    """Each closed boundary is ranked by its own time; the slowest KEEP_SLOWEST stay, slowest
    first, each with the time of every part (budgeted operations and noted ones) and its pages;
    the longest per-page time of each operation is kept beside the running means."""
    b = BoundaryBudget(share=0.04)
    for i in range(budget_mod.KEEP_SLOWEST + 4):
        clock[0] += 0.030  # the step
        b.open()
        run(b, clock, "install", 0.001 * (i + 1))
        clock[0] += 0.0005
        b.note("check", 0.0005)
        b.close()
    st = b.stats()
    ms = [r["ms"] for r in st["slowest"]]
    n = budget_mod.KEEP_SLOWEST + 4
    assert ms == sorted(ms, reverse=True) and len(ms) == budget_mod.KEEP_SLOWEST
    assert ms[0] == pytest.approx(n + 0.5) and ms[-1] == pytest.approx(5 + 0.5)
    top = st["slowest"][0]
    assert top["parts_ms"] == pytest.approx({"install": n, "check": 0.5})
    assert top["pages"] == {"install": 1}
    assert st["page_cost_max_ms"]["install"] == pytest.approx(n)
