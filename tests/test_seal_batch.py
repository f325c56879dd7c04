"""Batched sealing (`seal_segments`, N segments per chooser call) gives exactly what sealing each
segment alone gives: same strategies, same bytes, same page metadata, same dense fallbacks."""
import pytest
import torch

from mosaickv_sglang.codec.basis import fit_basis
from mosaickv_sglang.codec.layer import DENSE, Candidates, _choose_batch, seal_segments
from mosaickv_sglang.config import MosaicConfig

H, S, D = 2, 128, 64


def _segments(n, gen):
    # mixed difficulty: some segments heavy-tailed so that cheap candidates miss the budget
    scale = torch.rand(n, 1, 1, 1, generator=gen) * 3 + 0.5
    k = torch.randn(n, H, S, D, generator=gen) * scale * (1 + torch.arange(D) % 5)
    k[::3] = k[::3] * torch.randn(S, D, generator=gen).exp()  # outliers
    v = torch.randn(n, H, S, D, generator=gen) * scale
    return k, v


@pytest.mark.parametrize("sink", [False, True])
def test_batched_sealing_equals_one_by_one(sink):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    cfg = MosaicConfig(k_candidates=["band:b8=4,b4=44,b2=16,group=128", "lowbit:bits=4,group=32",
                                     "topr:r=16,val=fp8"], k_error_budget=0.1)
    cands = Candidates.from_config(cfg)
    n = 7
    k, v = _segments(n, gen)
    kb = torch.stack([fit_basis(k[i]) for i in range(n)])
    vb = torch.stack([fit_basis(v[i]) for i in range(n)])
    starts = [128 * i for i in range(n)]
    batched = seal_segments(k, v, kb, vb, 0, starts, cfg, cands, sink, True)
    single = [seal_segments(k[i:i + 1], v[i:i + 1], kb[i:i + 1], vb[i:i + 1], 0, [starts[i]], cfg,
                            cands, sink, True)[0] for i in range(n)]
    reasons = set()
    for a, b in zip(batched, single):
        for ca, cb in ((a.k, b.k), (a.v, b.v)):
            assert ca.strategy.spec == cb.strategy.spec and ca.reason == cb.reason
            reasons.add(ca.reason)
            assert ca.error == pytest.approx(cb.error, rel=1e-4)
            assert ca.encoded.tensors.keys() == cb.encoded.tensors.keys()
            for name in ca.encoded.tensors:
                assert torch.equal(ca.encoded.tensors[name], cb.encoded.tensors[name]), name
        assert torch.equal(a.header, b.header) and a.pages_rotated == b.pages_rotated
        for ta, tb in zip(a.pages.tensors().values(), b.pages.tensors().values()):
            assert torch.equal(ta, tb)
    assert reasons  # the data exercised at least one path; which ones depends on the seed


def test_fallback_applies_only_to_segments_over_budget():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x = torch.randn(4, H, S, D, generator=gen)
    x[1] *= torch.randn(S, D, generator=gen).exp()  # one heavy-tailed segment
    cands = Candidates.from_config(MosaicConfig(k_candidates=["lowbit:bits=2,group=32"]))
    errs = [c.error for c in _choose_batch(x, x, "k", cands.k, float("inf"), "within-budget",
                                           DENSE)[0]]
    worst = max(range(4), key=errs.__getitem__)
    budget = (max(errs) + sorted(errs)[-2]) / 2  # only the worst segment misses it
    choices, _ = _choose_batch(x, x, "k", cands.k, budget, "within-budget", DENSE)
    assert [c.reason == "over-budget" for c in choices] == [i == worst for i in range(4)], errs
    assert [c.strategy.name for c in choices] == ["dense" if i == worst else "lowbit"
                                                  for i in range(4)]
    assert choices[worst].error < 0.01  # the dense (bf16) fallback: rounding error only
