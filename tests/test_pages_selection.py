"""Page metadata, the per-page score upper bound, and page selection (codec/pages.py), plus the
bound checked end to end against the scores decode attention actually computes."""
from __future__ import annotations

import pytest
import torch

from mosaickv_sglang.codec.basis import rotate, rotate_query
from mosaickv_sglang.codec.layer import compress_layer
from mosaickv_sglang.codec.pages import META_DTYPE, build_page_meta, page_upper_bound, select_pages
from mosaickv_sglang.config import MosaicConfig, SelectionConfig

from conftest import assert_finite, repro

# float32 accumulation slack of the bound, relative to sum_c |q_c k_c| (the bound is computed in
# float32 like the attention scores; fp16 rounding of the metadata is far larger, ~2^-11)
F32_SLACK = 1e-6


def _keys(h: int, s: int, d: int, fp16_exact: bool) -> torch.Tensor:
    k = torch.randn(h, s, d) * torch.exp(-torch.linspace(0, 3, d)) * 4
    k += torch.randn(h, 1, d) * 0.5  # per-channel offsets
    k = torch.where(torch.rand(h, s, d) < 0.02, k * 10, k)
    return k.half().float() if fp16_exact else k


def _check_bound(bound, q, k, page_tokens, seed, what):
    """bound [H, G, P] >= exact float64 q.k for every key of the page (minus float32 slack)."""
    h, g, _ = q.shape
    exact = torch.einsum("hgd,hsd->hgs", q.double(), k.double())
    slack = torch.einsum("hgd,hsd->hgs", q.abs().double(), k.abs().double()) * F32_SLACK
    excess = (exact - slack).reshape(h, g, -1, page_tokens) - bound.double()[..., None]
    worst = float(excess.max())
    assert worst <= 0, f"{what}: bound below an exact score by {worst:.3e} {repro(seed)}"
    return exact


@pytest.mark.parametrize("fp16_exact", (False, True))
@pytest.mark.parametrize("page_tokens", (1, 8, 32))
@pytest.mark.parametrize("meta_channels", (0, 1, 8, "D", 1000))
def test_page_upper_bound_is_a_true_bound(meta_channels, page_tokens, fp16_exact, seed):
    h, g = int(torch.randint(2, 4, ())), int(torch.randint(1, 5, ()))
    d = 64 if torch.rand(()) < 0.5 else 32
    m = d if meta_channels == "D" else meta_channels
    s = 128
    k = _keys(h, s, d, fp16_exact)
    meta = build_page_meta(k, page_tokens, m)
    mm = min(m, d)
    assert meta.num_pages == s // page_tokens and meta.channels.shape == (h, mm), repro(seed)
    assert meta.lo.dtype == META_DTYPE and meta.hi.dtype == META_DTYPE, repro(seed)
    assert meta.nbytes() == h * mm + 2 * h * meta.num_pages * mm * 2 + h * meta.num_pages * 2
    for trial in range(3):
        q = torch.randn(h, g, d) * (10.0 ** trial)
        bound = page_upper_bound(meta, q)
        assert bound.shape == (h, g, s // page_tokens), repro(seed)
        assert_finite(bound, "page bound", seed)
        exact = _check_bound(bound, q, k, page_tokens, seed, f"m={m} page={page_tokens} q*10^{trial}")
        # and it is not vacuous: never above the Cauchy-Schwarz bound (+ fp16 rounding)...
        cs = q.double().norm(dim=-1)[..., None] * \
            k.double().norm(dim=-1).reshape(h, 1, -1, page_tokens).amax(-1)
        # (the per-channel head part may exceed ||q|| ||k|| only through per-channel extremes)
        if m == 0:
            assert float((bound.double() - cs * (1 + 2 ** -10)).max()) <= 0, repro(seed)
            assert float((cs * (1 - 2 ** -10) - bound.double()).max()) <= 0, repro(seed)
        # ...and with every channel covered and one token per page it is tight up to fp16 rounding
        if mm == d and page_tokens == 1:
            loose = bound.double() - exact
            scale = torch.einsum("hgd,hsd->hgs", q.abs().double(), k.abs().double())
            tiny = q.abs().double().sum(-1)[..., None] * 2 ** -24  # fp16 subnormal spacing
            assert float((loose - scale * 2 ** -10 - tiny).max()) <= 0, f"bound not tight {repro(seed)}"


@pytest.mark.parametrize("meta_channels", (0, 4, 16, 64))
def test_page_meta_brackets_the_keys(meta_channels, seed):
    h, s, d, pt = 3, 128, 64, 16
    k = _keys(h, s, d, fp16_exact=False)
    meta = build_page_meta(k, pt, meta_channels)
    chans = meta.channels.long()
    # covered channels are the ones with the most energy in the segment
    energy = k.pow(2).sum(1)
    top_energy = energy.topk(meta_channels, dim=-1).values.sort(-1).values
    assert torch.equal(torch.gather(energy, 1, chans).sort(-1).values, top_energy), repro(seed)
    pages = k.double().reshape(h, s // pt, pt, d)
    sel = torch.gather(pages, 3, chans[:, None, None, :].expand(-1, s // pt, pt, -1))
    assert bool((meta.lo.double() <= sel.amin(2)).all()), f"lo above a key {repro(seed)}"
    assert bool((meta.hi.double() >= sel.amax(2)).all()), f"hi below a key {repro(seed)}"
    # outward rounding moves at most one fp16 step
    assert bool((sel.amin(2) - meta.lo.double() <= sel.amin(2).abs() * 2 ** -9 + 1e-7).all())
    rest = (pages.pow(2).sum(-1) - sel.pow(2).sum(-1)).clamp_min(0).sqrt().amax(2)
    assert bool((meta.rest_norm.double() >= rest * (1 - 1e-6)).all()), repro(seed)


def test_build_page_meta_rejects_partial_pages(seed):
    with pytest.raises(ValueError, match="page_tokens=32"):
        build_page_meta(torch.randn(2, 48, 32), 32, 8)


def _random_bounds(h, g, p):
    return torch.randn(h, g, p) * 5  # continuous: no ties


@pytest.mark.parametrize("trial", range(4))
def test_select_pages_budget_and_forced_pages(trial, seed):
    h, g = int(torch.randint(1, 4, ())), int(torch.randint(1, 4, ()))
    p = int(torch.randint(8, 40, ()))
    pt = (4, 16, 32)[trial % 3]
    sink = int(torch.randint(0, 3, ()))
    recent = int(torch.randint(0, 4, ()))
    allowed = int(torch.randint(sink + recent + 1, p, ()))  # smaller than everything
    budget = allowed * pt + int(torch.randint(0, pt, ()))  # partial pages round down
    bounds = _random_bounds(h, g, p)
    keep = select_pages(bounds, pt, budget, sink, recent)
    assert keep.dtype == torch.bool and keep.shape == (h, p), repro(seed)
    assert keep.sum(-1).tolist() == [allowed] * h, f"{keep.sum(-1).tolist()} != {allowed} {repro(seed)}"
    assert bool(keep[:, :sink].all()), f"sink pages dropped {repro(seed)}"
    if recent:
        assert bool(keep[:, p - recent:].all()), f"recent pages dropped {repro(seed)}"
    forced = torch.zeros(p, dtype=torch.bool)
    forced[:sink] = True
    if recent:
        forced[p - recent:] = True
    vote = bounds.amax(1)  # the G query heads of a KV head vote with their max
    for hh in range(h):
        free = ~forced
        picked = keep[hh] & free
        dropped = ~keep[hh] & free
        expect = vote[hh].masked_fill(forced, float("-inf")).topk(allowed - int(forced.sum())).indices
        assert sorted(torch.nonzero(picked).flatten().tolist()) == sorted(expect.tolist()), repro(seed)
        if bool(dropped.any()):
            assert float(vote[hh][picked].min()) > float(vote[hh][dropped].max()), repro(seed)


def test_select_pages_one_query_head_in_a_group_can_claim_a_page(seed):
    h, g, p = 2, 3, 20
    bounds = _random_bounds(h, g, p).clamp(-5, 5)
    target = [int(torch.randint(2, p - 2, ())) for _ in range(h)]
    for hh, t in enumerate(target):
        bounds[hh, int(torch.randint(0, g, ())), t] = 100.0
    keep = select_pages(bounds, 16, 16 * 3, 1, 1)
    for hh, t in enumerate(target):
        assert bool(keep[hh, t]) and int(keep[hh].sum()) == 3, repro(seed)


@pytest.mark.parametrize("extra_tokens", (0, 1, 1000))
def test_select_pages_budget_covering_everything_keeps_all(extra_tokens, seed):
    h, g, p, pt = 2, 2, 13, 16
    keep = select_pages(_random_bounds(h, g, p), pt, p * pt + extra_tokens, 1, 2)
    assert bool(keep.all()), repro(seed)


def test_select_pages_forced_pages_win_over_budget(seed):
    """Sink and recent pages are always read, even when they alone exceed the budget."""
    h, g, p, pt = 2, 2, 20, 16
    keep = select_pages(_random_bounds(h, g, p), pt, 2 * pt, 2, 3)
    expect = torch.zeros(h, p, dtype=torch.bool)
    expect[:, :2] = True
    expect[:, -3:] = True
    assert torch.equal(keep, expect), repro(seed)


# ---- end to end: the bound versus what decode attention actually scores ----------------------

def _e2e_violation(k_spec: str, page_tokens: int, seed: int) -> float:
    h, d, seg = 2, 64, 64
    t = 3 * seg + 16
    k = (torch.randn(h, t, d) * torch.exp(-torch.linspace(0, 2, d))[torch.randperm(d)] * 3)
    k = k.to(torch.bfloat16)
    v = torch.randn(h, t, d).to(torch.bfloat16)
    cfg = MosaicConfig(segment_tokens=seg, page_tokens=page_tokens, basis_block_tokens=seg * 4,
                       hot_tokens=16, sink_segments=0, sink_candidates=[], k_candidates=[k_spec],
                       v_candidates=["dense"], k_error_budget=float("inf"),
                       select=SelectionConfig(budget_tokens=seg, sink_tokens=0, recent_tokens=0,
                                              meta_channels=d))
    layer = compress_layer(k, v, cfg)
    assert len(layer.segments) == 3 and all(s.k.strategy.spec == parse(k_spec) for s in layer.segments)
    q = torch.randn(h, 8, d) * 0.125  # [H, Nq*G, D] as attention scales it
    worst = -float("inf")
    for s in layer.segments:
        kb = layer.k_bases[s.basis]
        q_in = rotate_query(q, kb)  # how decode attention puts q into the K basis
        bound = page_upper_bound(s.pages, q_in if s.pages_rotated else q)
        scores = s.k.strategy.qk(s.k.encoded, q_in if s.k.strategy.rot else q)
        assert_finite(scores, "scores", seed)
        # tolerance: 1e-5 of ||q|| * max ||k|| of the page, 100x float32 accumulation error
        kn = s.k.strategy.decode(s.k.encoded).norm(dim=-1).amax(-1)
        tol = 1e-5 * q.norm(dim=-1) * kn[:, None]
        excess = scores.reshape(h, 8, -1, page_tokens).amax(-1) - bound - tol[..., None]
        worst = max(worst, float(excess.max()))
    return worst


def parse(spec):
    from mosaickv_sglang.codec.strategies import parse_strategy
    return parse_strategy(spec).spec


@pytest.mark.parametrize("k_spec", [
    "band:b8=16,b4=48,b2=0,group=64",  # rot=1 K: pages in the K basis
    "lowbit:bits=4,group=32,rot=1",
    "dense",  # rot=0 K: pages in raw channels (Quest mode with meta_channels=D)
    "lowbit:bits=8,group=32",
])
@pytest.mark.parametrize("page_tokens", (1, 16))
def test_bound_covers_attention_scores(k_spec, page_tokens, seed):
    worst = _e2e_violation(k_spec, page_tokens, seed)
    assert worst <= 0, f"{k_spec}: score above page bound by {worst:.3e} {repro(seed)}"

