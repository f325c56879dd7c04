"""scripts/decode_seal_probe.py at tiny shapes: both settings seal the same pages, and a step's
seals of several requests in one batch launch fewer torch ops than request by request (the
probe's `--count-ops`, what docs/serving.md quotes)."""
import importlib.util
from argparse import Namespace
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "decode_seal_probe.py"
spec = importlib.util.spec_from_file_location("decode_seal_probe", SCRIPT)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_batched_seals_launch_fewer_ops_for_the_same_pages():
    args = Namespace(device="cpu", layers=2, heads=1, head_dim=64, pages=1, requests=3,
                     count_ops=True)
    batched, alone = probe.run(0, args, batched=True), probe.run(0, args, batched=False)
    assert batched["sealed_pages"] == alone["sealed_pages"] == 3
    assert 0 < batched["torch_ops"] < alone["torch_ops"], (batched, alone)


def test_top_ops_profiles_the_seal_steps():
    """`--top-ops`: the steps run under torch.profiler and the table names the ops by self time
    (what a GPU call reads to attribute a seal step)."""
    args = Namespace(device="cpu", layers=2, heads=1, head_dim=64, pages=1, requests=2,
                     count_ops=False, top_ops=5)
    r = probe.run(0, args, batched=True)
    assert r["sealed_pages"] == 2 and r["profile"] is not None
    assert "Self CPU" in r["profile"] and r["profile"].count("aten::") >= 5, r["profile"]
    plain = probe.run(0, Namespace(**{**vars(args), "top_ops": 0}), batched=True)
    assert plain["profile"] is None and plain["sealed_pages"] == 2


def test_profile_usual_leaves_the_block_opening_step_out():
    """`--profile-usual`: only the seal steps after the first (bases existing) are profiled, so
    the first step's basis fit (eigh) is in the full table and not in this one."""
    args = Namespace(device="cpu", layers=2, heads=1, head_dim=64, pages=2, requests=2,
                     count_ops=False, top_ops=200, profile_usual=False)
    full = probe.run(0, args, batched=True)
    usual = probe.run(0, Namespace(**{**vars(args), "profile_usual": True}), batched=True)
    assert full["sealed_pages"] == usual["sealed_pages"] == 4
    assert "linalg_eigh" in full["profile"], full["profile"]
    assert "linalg_eigh" not in usual["profile"] and "aten::" in usual["profile"], usual["profile"]


def test_config_reaches_the_pool():
    """`--config`: MosaicConfig fields for the probe's pool (e.g. the write-transform cache off,
    which then inverts a block at every seal step: no hits)."""
    args = Namespace(device="cpu", layers=2, heads=1, head_dim=64, pages=2, requests=2,
                     count_ops=False, config='{"write_transform_cache_mb": 0}')
    r = probe.run(0, args, batched=True)
    assert r["sealed_pages"] == 4 and r["write_transforms"]["hits"] == 0
    on = probe.run(0, Namespace(**{**vars(args), "config": None}), batched=True)
    assert on["write_transforms"]["hits"] == 2, on["write_transforms"]


def test_phases_split_each_seal_step_by_function():
    """`--phases`: per step that sealed, the inclusive time of the seal path's functions: the
    block-opening step fits bases, the usual one does not, both choose and install; the patched
    functions are restored afterwards (a later run is untimed)."""
    args = Namespace(device="cpu", layers=2, heads=1, head_dim=64, pages=2, requests=2,
                     count_ops=False, phases=True)
    originals = {(id(o), a): o.__dict__[a] for _, o, a in probe.PHASES}
    r = probe.run(0, args, batched=True)
    assert r["sealed_pages"] == 4 and len(r["phases"]) == 2, r["phases"]
    opening, usual = r["phases"]
    assert "fit_groups" in opening and "fit_groups" not in usual, r["phases"]
    for p in (opening, usual):
        assert {"choose", "seal_pages", "install"} <= p.keys(), p
        assert p["seal_pages"] <= p["step_ms"] + 1.0, p  # inclusive, within the step
    assert all(o.__dict__[a] is originals[(id(o), a)] for _, o, a in probe.PHASES)
    assert probe.run(0, Namespace(**{**vars(args), "phases": False}), batched=True)["phases"] == []
