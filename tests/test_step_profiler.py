"""StepProfiler: phase averages over sampled steps and the slowest steps with their phases."""
import pytest

from mosaickv_sglang.codec.timing import StepProfiler


def _clocked(prof: StepProfiler, times: list[float]) -> StepProfiler:
    clock = iter(times)
    prof._now = lambda: next(clock)  # seconds, as time.perf_counter gives them
    return prof


def test_samples_every_nth_step_and_keeps_the_slowest_with_their_phases():
    # every=1, keep 2: three steps of 10, 50 and 30 ms (plan then kernels), the tail of each
    # charged to "between_steps" at the next step's start; the last one ended by end().
    prof = _clocked(StepProfiler(1, "cpu", keep_slowest=2),
                    [0.000, 0.004, 0.010,  # step 1: start, plan 4, kernels 6
                     0.010, 0.010, 0.020, 0.060,  # its tail 0; step 2: plan 10, kernels 40
                     0.062, 0.062, 0.070, 0.090])  # its tail 2; step 3: plan 8, kernels 20
    for plan_kernels in range(3):
        prof.step()
        prof.lap("plan")
        prof.lap("kernels")
    prof.end()
    rep = prof.report()
    assert rep["sampled_steps"] == 3 and rep["steps"] == 3
    assert [s["step"] for s in rep["slowest"]] == [2, 3]  # 50 and 30 ms; the 10 ms one dropped
    assert rep["slowest"][0] == {"step": 2, "ms": 52.0,  # its tail (2 ms) included
                                 "phases": {"plan": 10.0, "kernels": 40.0, "between_steps": 2.0}}
    assert rep["ms_per_step"] == {"plan": round(22 / 3, 4), "kernels": 22.0,
                                  "between_steps": round(2 / 3, 4)}


def test_off_and_unsampled_steps_cost_no_clock_reads():
    prof = _clocked(StepProfiler(0, "cpu"), [])  # any clock read would raise StopIteration
    for _ in range(3):
        prof.step()
        prof.lap("plan")
    prof.end()
    assert prof.report() == {"sampled_steps": 0, "every": 0, "steps": 3, "ms_per_step": {},
                             "slowest": []}
    every3 = _clocked(StepProfiler(3, "cpu"), [1.0, 1.5])
    for _ in range(3):
        every3.step()
        every3.lap("plan")
    assert every3.report()["ms_per_step"] == {"plan": 500.0}


CHUNK_RULE = {"read_rule": "chunk", "basis_fit": "group"}
POSITION_RULE = {"read_rule": "position", "basis_fit": "first_page"}  # the default


def _prefill(profile_every: int, rule: dict = POSITION_RULE):
    """One 300-token prompt through MosaicKV's backend (2 layers, reference decode path), as
    SGLang's extend forward calls it, under read rule `rule`; returns the pool."""
    from types import SimpleNamespace

    import torch

    from mosaickv_sglang.serving.backend import MosaicAttnBackend
    from mosaickv_sglang.config import MosaicConfig
    from mosaickv_sglang.serving.pool import MosaicKVPool

    ps, h, hq, d, layers, n = 128, 2, 4, 64, 2, 300
    cfg = MosaicConfig(hot_tokens=0, decode_kernel="reference",
                       decode_profile_every=profile_every, **rule)
    pool = MosaicKVPool(16 * ps, ps, torch.bfloat16, h, d, layers, "cpu", False,
                        mosaic_config=cfg)
    req_to_token = torch.zeros(2, 1024, dtype=torch.int32)
    req_to_token[1] = torch.arange(ps, ps + 1024, dtype=torch.int32)
    runner = SimpleNamespace(device="cpu", token_to_kv_pool=pool,
                             req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    backend = MosaicAttnBackend(runner)
    batch = SimpleNamespace(batch_size=1, req_pool_indices=torch.tensor([1]),
                            seq_lens=torch.tensor([n]), extend_seq_lens=torch.tensor([n]),
                            out_cache_loc=req_to_token[1, :n].long())
    gen = torch.Generator().manual_seed(0)
    for layer_id in range(layers):
        layer = SimpleNamespace(layer_id=layer_id, tp_q_head_num=hq, qk_head_dim=d,
                                v_head_dim=d, scaling=d ** -0.5)
        o = backend.forward_extend(torch.randn(n, hq * d, generator=gen).bfloat16(),
                                   torch.randn(n, h, d, generator=gen).bfloat16(),
                                   torch.randn(n, h, d, generator=gen).bfloat16(), layer, batch)
        assert o.shape == (n, hq * d) and not o.isnan().any()
    return pool


@pytest.mark.parametrize("rule", ["chunk", "position"])
def test_prefill_steps_are_profiled_by_phase_when_profiling_is_on(rule):
    """Under the chunk rule the two full pages are sealed after the forward ("seal"); under the
    position rule (the default since 2026-12-07) inside it, layer by layer ("chunk_seal",
    planned at the first layer, installed after the last), "seal" timing the rest."""
    cfg = CHUNK_RULE if rule == "chunk" else POSITION_RULE
    pool = _prefill(profile_every=4, rule=cfg)  # any N > 0 times every prefill step
    assert len(pool.sealed) == 2  # the two full pages sealed at the last layer
    prof = pool.stats()["prefill"]["profile"]
    assert prof["sampled_steps"] == 1 and prof["steps"] == 1
    phases = {"read_prefix", "gather", "attention", "between_layers", "seal"}
    sealing = "seal"
    if rule == "position":
        phases |= {"plan_chunk_seal", "chunk_seal", "chunk_install"}
        sealing = "chunk_seal"
    assert set(prof["ms_per_step"]) == phases
    assert prof["slowest"][0]["phases"][sealing] > 0  # sealing two pages takes time on a CPU
    off = _prefill(profile_every=0, rule=cfg).stats()["prefill"]["profile"]
    assert off["sampled_steps"] == 0 and off["ms_per_step"] == {}


def test_forced_steps_are_timed_apart_and_leave_the_averages_alone():
    # every=2: steps 2 and 4 sampled; steps 3 and 4 forced (4 is both). Each step: plan, then
    # its tail at the next step's start (the last ended by end()).
    prof = _clocked(StepProfiler(2, "cpu", keep_slowest=2),
                    [0.000, 0.010,  # step 2 (sampled): start, plan 10
                     0.011, 0.011, 0.111,  # its tail 1; step 3 (forced): start, plan 100
                     0.112, 0.112, 0.132])  # its tail 1; step 4 (both): start, plan 20
    # (end() charges no tail)
    for forced in (False, False, True, True):
        prof.step(forced=forced)
        prof.lap("plan")
    prof.end()
    rep = prof.report()
    assert rep["steps"] == 4 and rep["sampled_steps"] == 2  # steps 2 and 4 only
    assert rep["ms_per_step"] == {"plan": 15.0, "between_steps": 0.5}
    forced = rep["forced"]
    assert forced["sampled_steps"] == 2 and forced["steps"] == 4
    assert forced["ms_per_step"] == {"plan": 60.0, "between_steps": 0.5}
    assert [s["step"] for s in forced["slowest"]] == [3, 4]
    assert [s["step"] for s in rep["slowest"]] == [4, 2]
    # off: nothing timed, forced or not (no clock read)
    off = _clocked(StepProfiler(0, "cpu"), [])
    for _ in range(2):
        off.step(forced=True)
        off.lap("plan")
    off.end()
    assert "forced" not in off.report() and off.report()["sampled_steps"] == 0
