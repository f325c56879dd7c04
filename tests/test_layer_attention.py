"""compress_layer + decode_attention: losslessness, page selection, byte accounting, the chooser and
numerical stability, each against a float64 reference built here."""
from __future__ import annotations

import math

import pytest
import torch

from mosaickv_sglang.codec.attention import decode_attention
from mosaickv_sglang.codec.basis import BASIS_DTYPE, fit_basis, rotate
from mosaickv_sglang.codec.layer import HEADER_FIELDS, choose, compress_layer, relative_error
from mosaickv_sglang.codec.strategies import Encoded, parse_strategy, strategy_id
from mosaickv_sglang.config import MosaicConfig, SelectionConfig

from conftest import assert_finite, assert_rel_close, rel_err, repro, tensor_bytes


# ---- helpers ---------------------------------------------------------------------------------

def rand_shape():
    """(H, G, D, segment, page, hot, sealed segments, T)."""
    h = int(torch.randint(2, 4, ()))
    g = int(torch.randint(1, 4, ()))
    d = (32, 64)[int(torch.randint(0, 2, ()))]
    seg = (64, 128)[int(torch.randint(0, 2, ()))]
    pt = (16, 32)[int(torch.randint(0, 2, ()))]
    hot = (16, 32)[int(torch.randint(0, 2, ()))]
    nseg = int(torch.randint(1, 4, ()))
    t = nseg * seg + hot + int(torch.randint(0, seg, ()))
    return h, g, d, seg, pt, hot, nseg, t


def kv(h: int, t: int, d: int, low_rank: bool = False):
    """bf16 K/V (what the dense cache holds), K with decaying channel energy and an offset."""
    if low_rank:
        k = torch.randn(h, t, 6) @ torch.randn(h, 6, d) + 0.05 * torch.randn(h, t, d)
        v = torch.randn(h, t, 6) @ torch.randn(h, 6, d) + 0.05 * torch.randn(h, t, d)
    else:
        k = torch.randn(h, t, d) * torch.exp(-torch.linspace(0, 2, d))[torch.randperm(d)] * 2
        k = k + torch.randn(h, 1, d) * 0.5
        v = torch.randn(h, t, d)
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


def lossless_cfg(seg, pt, hot, select: SelectionConfig | None = None, sink_segments=1):
    return MosaicConfig(segment_tokens=seg, page_tokens=pt, basis_block_tokens=seg * 2,
                        hot_tokens=hot, sink_segments=sink_segments, sink_candidates=[],
                        k_candidates=["dense"], v_candidates=["dense"],
                        select=select or SelectionConfig(enabled=False, budget_tokens=pt))


def reference(q, k, v, positions, sm_scale, keep_tokens=None):
    """float64 causal softmax attention. q [Nq, Hq, D], k/v [H, T, D], positions [Nq];
    keep_tokens [Nq, H, T] (bool) further restricts which tokens a query reads."""
    nq, hq, _ = q.shape
    h, t, _ = k.shape
    g = hq // h
    kk = k.double().repeat_interleave(g, 0)
    vv = v.double().repeat_interleave(g, 0)
    scores = torch.einsum("nqd,qtd->nqt", q.double() * sm_scale, kk)
    mask = (torch.arange(t)[None, :] <= positions[:, None])[:, None, :].expand(nq, hq, t)
    if keep_tokens is not None:
        mask = mask & keep_tokens.repeat_interleave(g, 1)
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("nqt,qtd->nqd", p, vv), p


def hot_positions(nq: int, hot_start: int, t: int) -> torch.Tensor:
    return torch.randint(hot_start, t, (nq,))


def effective_kv(layer):
    """K/V as the attention effectively reads them, in the raw basis (float64): decoded segments
    (a rotated strategy's reconstruction times R, the stored bf16 read transform) + the hot buffer."""
    ks, vs = [], []
    for s in layer.segments:
        for kind, out, bases in (("k", ks, layer.k_bases), ("v", vs, layer.v_bases)):
            ch = s.k if kind == "k" else s.v
            x = ch.strategy.decode(ch.encoded).double()
            if ch.strategy.rot:
                x = x @ bases[s.basis].double()
            out.append(x)
    ks.append(layer.hot_k.double())
    vs.append(layer.hot_v.double())
    return torch.cat(ks, 1), torch.cat(vs, 1)


# ---- bases ---------------------------------------------------------------------------------

def test_fit_basis_principal_axes(seed):
    h, t, d = 2, 256, 64
    k, _ = kv(h, t, d)
    u = fit_basis(k.float())
    assert u.dtype == BASIS_DTYPE and u.shape == (h, d, d)
    uf = u.float()  # the read transform R: rows are the axes
    gram = uf @ uf.transpose(1, 2)
    # orthonormal to bf16 precision (2^-8 per entry)
    assert float(torch.linalg.matrix_norm(gram - torch.eye(d), ord=2).max()) < 2e-2, repro(seed)
    # rows sorted by energy: the rotated coordinates' energy is non-increasing (up to bf16)
    energy = rotate(k.float(), u).pow(2).sum(1)  # [H, D]
    assert bool((energy[:, 1:] <= energy[:, :-1] * 1.02 + 1e-3).all()), repro(seed)
    # uncentred: the first axis carries the largest raw second moment (offsets included)
    top = torch.linalg.eigvalsh(k.float().transpose(1, 2) @ k.float())[:, -1]
    assert_rel_close(energy[:, 0], top, 2e-2, "first-axis energy", seed)


def test_rotated_dense_segments_are_lossless(seed):
    """The bf16 basis is orthonormal only to ~5e-3, so writes use its exact inverse: a rotated
    dense fp32 cache must give the same attention as the unrotated one."""
    h, g, d, seg, pt, hot = 2, 2, 64, 64, 16, 16
    t = 3 * seg + hot + 3
    k, v = kv(h, t, d)
    q = torch.randn(2, h * g, d)
    pos = hot_positions(2, 3 * seg, t)
    outs = []
    for spec in ("dense:val=fp32,rot=1", "dense:val=fp32"):
        cfg = MosaicConfig(segment_tokens=seg, page_tokens=pt, basis_block_tokens=4 * seg,
                           hot_tokens=hot, sink_segments=0, sink_candidates=[],
                           k_candidates=[spec], v_candidates=[spec],
                           select=SelectionConfig(enabled=False))
        outs.append(decode_attention(q, compress_layer(k, v, cfg), pos, cfg.select, pt)[0])
    assert_rel_close(outs[0], outs[1], 1e-5, "rotated vs raw dense fp32", seed)


# ---- (a) lossless ----------------------------------------------------------------------------

@pytest.mark.parametrize("trial", range(4))
def test_dense_config_is_exact_attention(trial, seed):
    h, g, d, seg, pt, hot, nseg, t = rand_shape()
    k, v = kv(h, t, d)
    cfg = lossless_cfg(seg, pt, hot, sink_segments=int(torch.randint(0, 2, ())))
    layer = compress_layer(k, v, cfg)
    assert len(layer.segments) == nseg and layer.hot_start == nseg * seg, repro(seed)
    nq = int(torch.randint(1, 4, ()))
    q = torch.randn(nq, h * g, d) * 2
    pos = hot_positions(nq, layer.hot_start, t)
    sm = d ** -0.5
    expect, p_ref = reference(q, k, v, pos, sm)
    what = f"H={h} G={g} D={d} seg={seg} T={t} pos={pos.tolist()}"
    out, info, probs = decode_attention(q, layer, pos, cfg.select, pt, return_probs=True)
    assert_rel_close(out, expect, 1e-5, "dense attention " + what, seed)
    assert_rel_close(probs, p_ref, 1e-5, "dense attention probs " + what, seed)
    assert info.page_keep is None and info.pages_read == info.pages_total == nseg * seg // pt * nq * h
    # selection on, but a budget covering every compressed token: identical result
    sel = SelectionConfig(enabled=True, budget_tokens=nseg * seg + int(torch.randint(0, 64, ())),
                          sink_tokens=pt, recent_tokens=pt, meta_channels=8)
    layer2 = compress_layer(k, v, lossless_cfg(seg, pt, hot, sel))
    out2, info2 = decode_attention(q, layer2, pos, sel, pt)
    assert_rel_close(out2, expect, 1e-5, "dense attention, budget covers all " + what, seed)
    assert info2.page_keep is None and info2.pages_read == info2.pages_total, repro(seed)
    # and an explicit sm_scale is honoured
    out3, _ = decode_attention(q, layer, pos, None, pt, sm_scale=0.3)
    assert_rel_close(out3, reference(q, k, v, pos, 0.3)[0], 1e-5, "sm_scale=0.3 " + what, seed)


def test_only_hot_tokens(seed):
    """Fewer tokens than one segment past the hot window: nothing sealed, plain attention."""
    h, g, d = 2, 2, 32
    k, v = kv(h, 40, d)
    cfg = lossless_cfg(64, 16, 32)
    layer = compress_layer(k, v, cfg)
    assert not layer.segments and layer.hot_k.shape[1] == 40 and layer.hot_start == 0
    q = torch.randn(3, h * g, d)
    pos = torch.randint(0, 40, (3,))
    out, info = decode_attention(q, layer, pos, SelectionConfig(budget_tokens=16), 16)
    assert_rel_close(out, reference(q, k, v, pos, d ** -0.5)[0], 1e-5, "hot only", seed)
    assert info.pages_total == 0


@pytest.mark.parametrize("k_spec,v_spec", [
    ("band:b8=8,b4=16,b2=8,group=32", "band:b8=0,b4=16,b2=16,group=64"),
    ("lowbit:bits=4,group=32", "lowbit:bits=2,group=32,rot=1"),
    ("topr:r=8,val=int8", "topr:r=6,val=fp8,rot=0"),
    ("mask:r=16,val=bf16,rot=1", "dense:val=fp8"),
])
def test_compressed_attention_is_attention_over_the_reconstruction(k_spec, v_spec, seed):
    """Scores on the packed form in each segment's basis + p.v rotated back == float64 attention
    over the decoded K/V mapped back to the raw basis (checks all the basis plumbing)."""
    h, g, d, seg, pt, hot, nseg, t = rand_shape()
    if "band" in k_spec + v_spec:
        d = 64  # band widths are per 64 channels
    k, v = kv(h, t, d)
    cfg = MosaicConfig(segment_tokens=seg, page_tokens=pt, basis_block_tokens=seg,  # 1 basis/seg
                       hot_tokens=hot, sink_segments=0, k_candidates=[k_spec],
                       v_candidates=[v_spec], k_error_budget=math.inf, v_error_budget=math.inf,
                       select=SelectionConfig(enabled=False, budget_tokens=pt))
    layer = compress_layer(k, v, cfg)
    assert len(layer.k_bases) == nseg and [s.basis for s in layer.segments] == list(range(nseg))
    assert all(s.k.strategy.spec == parse_strategy(k_spec).spec for s in layer.segments)
    q = torch.randn(2, h * g, d)
    pos = hot_positions(2, layer.hot_start, t)
    k_eff, v_eff = effective_kv(layer)
    out, _ = decode_attention(q, layer, pos, None, pt)
    expect = reference(q, k_eff, v_eff, pos, d ** -0.5)[0]
    assert_rel_close(out, expect, 1e-4, f"{k_spec} / {v_spec}", seed)


# ---- (b) selection with a planted key --------------------------------------------------------

@pytest.mark.parametrize("meta_channels", (8, 0, 64))
def test_selection_reads_the_page_with_the_planted_key(meta_channels, seed):
    h, g, d, seg, pt, hot = 2, 2, 64, 64, 16, 16
    nseg = 4
    t = nseg * seg + hot + 5
    pages = nseg * seg // pt  # 16
    k, v = kv(h, t, d)
    k = k.float()
    u = torch.nn.functional.normalize(torch.randn(h, d), dim=-1)
    planted = [int(torch.randint(1, pages - 1, ())) for _ in range(h)]  # not the sink/recent page
    for hh, pg in enumerate(planted):
        k[hh, pg * pt + int(torch.randint(0, pt, ()))] = 60 * u[hh]
    k = k.to(torch.bfloat16)
    nq = 2
    q = (3 * u.repeat_interleave(g, 0)[None] + 0.3 * torch.randn(nq, h * g, d))
    sel = SelectionConfig(enabled=True, budget_tokens=3 * pt, sink_tokens=pt, recent_tokens=pt,
                          meta_channels=meta_channels, rescore_factor=0,
                          rescore_channels=0)  # the bound alone (the default rescores)
    cfg = lossless_cfg(seg, pt, hot, sel)
    layer = compress_layer(k, v, cfg)
    pos = hot_positions(nq, layer.hot_start, t)
    sm = 0.02  # soft enough that the pages left out matter
    out, info = decode_attention(q, layer, pos, sel, pt, sm_scale=sm)
    expect_keep = torch.zeros(nq, h, pages, dtype=torch.bool)
    expect_keep[:, :, 0] = True
    expect_keep[:, :, -1] = True
    for hh, pg in enumerate(planted):
        expect_keep[:, hh, pg] = True
    assert info.page_keep is not None and torch.equal(info.page_keep, expect_keep), \
        f"planted pages {planted}, kept {torch.nonzero(info.page_keep[0]).tolist()} {repro(seed)}"
    assert info.pages_read == 3 * nq * h and info.pages_total == pages * nq * h
    tokens = torch.ones(nq, h, t, dtype=torch.bool)
    tokens[:, :, :pages * pt] = expect_keep.repeat_interleave(pt, -1)
    expect, _ = reference(q, k, v, pos, sm, tokens)
    assert_rel_close(out, expect, 1e-5, "attention over the selected pages", seed)
    full, _ = reference(q, k, v, pos, sm)
    assert rel_err(expect, full) > 1e-3, f"test not discriminative {repro(seed)}"


def test_rescoring_keeps_the_best_scored_candidates(seed):
    """select.rescore_factor: the bound keeps factor x the budget's pages as candidates, and the
    budget's pages among them are those whose best score on the (here lossless) compressed K is
    highest (max over the page's tokens and the group's query heads); sink and recent pages
    stay. With a factor covering every page the keep set is the exact top pages."""
    h, g, d, seg, pt, hot = 2, 2, 64, 64, 16, 16
    nseg = 4
    t = nseg * seg + hot + 5
    pages = nseg * seg // pt  # 16
    k, v = kv(h, t, d)
    nq, sm = 2, 0.05
    q = torch.randn(nq, h * g, d)
    sel = SelectionConfig(enabled=True, budget_tokens=5 * pt, sink_tokens=pt, recent_tokens=pt,
                          meta_channels=0, rescore_factor=100,
                          rescore_channels=0)  # every channel (the default reads 32)
    layer = compress_layer(k, v, lossless_cfg(seg, pt, hot, sel))
    pos = hot_positions(nq, layer.hot_start, t)
    out, info = decode_attention(q, layer, pos, sel, pt, sm_scale=sm)
    assert info.pages_rescored == nq * h * pages and info.pages_read == 5 * nq * h
    # the oracle: best score per page over its tokens and the group's heads, float64
    qh = (q.double() * sm).reshape(nq, h, g, d)
    best = torch.einsum("nhgd,htd->nhgt", qh, k.double()[:, :pages * pt])
    best = best.reshape(nq, h, g, pages, pt).amax(-1).amax(2)  # [Nq, H, P]
    top = best[:, :, 1:-1].topk(3, dim=-1).indices + 1
    expect = torch.zeros(nq, h, pages, dtype=torch.bool)
    expect[:, :, 0] = expect[:, :, -1] = True
    expect.scatter_(2, top, True)
    assert torch.equal(info.page_keep, expect), repro(seed)
    tokens = torch.ones(nq, h, t, dtype=torch.bool)
    tokens[:, :, :pages * pt] = expect.repeat_interleave(pt, -1)
    expect_out, _ = reference(q, k, v, pos, sm, tokens)
    assert_rel_close(out, expect_out, 1e-5, "attention over the rescored pages", seed)


def test_rescoring_on_the_metadata_channels_bounds_the_scores(seed):
    """select.rescore_meta_only: a page's tokens scored on its metadata channels' codes exactly
    plus the page's rest-norm bound: never below the full compressed-K score (a true bound), and
    with every channel in the metadata it is the full score, so the pages kept are the same."""
    from mosaickv_sglang.codec.attention import _meta_channel_scores
    from mosaickv_sglang.codec.basis import rotate_query

    h, g, d, seg, pt, hot = 2, 2, 64, 64, 16, 16
    t = 4 * seg + hot + 5
    k, v = kv(h, t, d)
    nq, sm = 2, 0.05
    q = torch.randn(nq, h * g, d)
    pos = None
    keeps = []
    for m in (8, d):
        sel = SelectionConfig(enabled=True, budget_tokens=5 * pt, sink_tokens=pt,
                              recent_tokens=pt, meta_channels=m, rescore_factor=100,
                              rescore_meta_only=True, rescore_channels=0)
        cfg = MosaicConfig(segment_tokens=seg, page_tokens=pt, hot_tokens=hot,
                           k_candidates=["band:b8=16,b4=32,b2=16,group=16"],
                           v_candidates=["band:b8=16,b4=32,b2=16,group=16"],
                           sink_segments=0, k_error_budget=1.0, v_error_budget=1.0, select=sel)
        layer = compress_layer(k, v, cfg)
        pos = hot_positions(nq, layer.hot_start, t)
        qh = (q.float() * sm).reshape(nq, h, g, d).permute(1, 0, 2, 3).reshape(h, -1, d)
        for s_ in layer.segments:
            qs = rotate_query(qh, layer.k_bases[s_.basis]) if s_.k.strategy.rot else qh
            full = s_.k.strategy.qk(s_.k.encoded, qs)
            part = _meta_channel_scores(s_, qs, full)
            assert (part >= full - 1e-4 * full.abs().max()).all(), (m, repro(seed))
            if m == d:
                assert torch.allclose(part, full, atol=1e-4, rtol=1e-4), repro(seed)
            else:  # a looser score than the full one (the metadata path, not `full` returned)
                assert (part > full + 1e-3 * full.abs().max()).any(), repro(seed)
        _, info = decode_attention(q, layer, pos, sel, pt, sm_scale=sm)
        _, full_info = decode_attention(q, layer, pos, SelectionConfig(
            **{**sel.__dict__, "rescore_meta_only": False}), pt, sm_scale=sm)
        keeps.append((info.page_keep, full_info.page_keep))
    assert torch.equal(*keeps[1]), repro(seed)  # every channel: the same pages as the full K


def test_rescoring_on_the_leading_channels_is_their_exact_partial_score(seed):
    """select.rescore_channels = r: a candidate's tokens scored on the first r channels of its
    compressed K in the SVD basis, exactly (the partial sum of the full score), and with r the
    whole head the pages kept are those of the full-K second stage."""
    from mosaickv_sglang.codec.attention import _leading_channel_scores
    from mosaickv_sglang.codec.basis import rotate_query

    h, g, d, seg, pt, hot = 2, 2, 64, 64, 16, 16
    t = 4 * seg + hot + 5
    k, v = kv(h, t, d)
    nq, sm = 2, 0.05
    q = torch.randn(nq, h * g, d)
    cfg_of = lambda sel: MosaicConfig(  # noqa: E731
        segment_tokens=seg, page_tokens=pt, hot_tokens=hot,
        k_candidates=["band:b8=16,b4=32,b2=16,group=16"],
        v_candidates=["band:b8=16,b4=32,b2=16,group=16"], sink_segments=0,
        k_error_budget=1.0, v_error_budget=1.0, select=sel)
    base = dict(enabled=True, budget_tokens=5 * pt, sink_tokens=pt, recent_tokens=pt,
                meta_channels=8, rescore_factor=100)
    every = SelectionConfig(**base, rescore_channels=0)  # the full-K second stage (default: 32)
    layer = compress_layer(k, v, cfg_of(every))
    pos = hot_positions(nq, layer.hot_start, t)
    qh = (q.float() * sm).reshape(nq, h, g, d).permute(1, 0, 2, 3).reshape(h, -1, d)
    for s_ in layer.segments:
        qs = rotate_query(qh, layer.k_bases[s_.basis])
        full = s_.k.strategy.qk(s_.k.encoded, qs)
        kd = s_.k.strategy.decode(s_.k.encoded).float()
        part = _leading_channel_scores(s_, qs, full, 8)
        expect = torch.einsum("hqr,hsr->hqs", qs[..., :8].double(), kd[..., :8].double())
        assert torch.allclose(part.double(), expect, atol=1e-4), repro(seed)
        assert not torch.allclose(part, full, atol=1e-3), repro(seed)  # a partial score
    _, whole = decode_attention(q, layer, pos, SelectionConfig(**base, rescore_channels=d), pt,
                                sm_scale=sm)
    _, full_info = decode_attention(q, layer, pos, every, pt, sm_scale=sm)
    assert torch.equal(whole.page_keep, full_info.page_keep), repro(seed)
    with pytest.raises(ValueError, match="rescore_channels"):
        SelectionConfig(**base, rescore_channels=8, rescore_meta_only=True).validate(pt)


def test_rescoring_chooses_among_the_candidates_only(seed):
    """`_rescore` keeps no page outside the candidates, whatever its score, and ranks the
    candidates by their best score."""
    from mosaickv_sglang.codec.attention import _rescore

    h, nq, g, pt, pages = 2, 1, 2, 4, 10
    scores = [torch.randn(h, nq * g, pages * pt)]
    cand = torch.zeros(nq, h, pages, dtype=torch.bool)
    cand[:, :, [0, 2, 3, 5, 9]] = True  # the sink, the recent page and three more
    sel = SelectionConfig(enabled=True, budget_tokens=4 * pt, sink_tokens=pt, recent_tokens=pt,
                          rescore_factor=2)
    keep, scored = _rescore(cand, scores, sel, pt, nq, g)
    assert scored == int(cand.sum())
    best = scores[0].reshape(h, g, pages, pt).amax(-1).amax(1)  # [H, P]
    for hh in range(h):
        inner = [2, 3, 5]
        want = sorted(inner, key=lambda p: -float(best[hh, p]))[:2]
        assert sorted(torch.nonzero(keep[0, hh]).flatten().tolist()) == sorted([0, 9] + want)


def test_selection_without_page_meta_is_an_error(seed):
    k, v = kv(2, 200, 32)
    cfg = lossless_cfg(64, 16, 16, SelectionConfig(budget_tokens=16))
    layer = compress_layer(k, v, cfg, select_meta=False)
    with pytest.raises(ValueError, match="page metadata"):
        decode_attention(torch.randn(1, 2, 32), layer, torch.tensor([199]), cfg.select, 16)


# ---- (c) byte accounting and the hot buffer --------------------------------------------------

VALUE_NAMES = {"values", "codes", "codes8", "codes4", "codes2"}
INDEX_NAMES = {"index", "bitmap", "channels"}
SCALE_NAMES = {"scale", "zero", "value_scale", "scale8", "zero8", "scale4", "zero4", "scale2",
               "zero2"}


def walk_bytes(layer) -> dict[str, int]:
    out = dict.fromkeys(("values", "indices", "scales", "headers", "page_meta", "bases", "hot"), 0)
    used_k, used_v = set(), set()
    for s in layer.segments:
        out["headers"] += tensor_bytes(s.header)
        if s.pages is not None:
            out["page_meta"] += sum(tensor_bytes(t) for t in
                                    (s.pages.channels, s.pages.lo, s.pages.hi, s.pages.rest_norm))
        if s.k.strategy.rot or s.pages_rotated:
            used_k.add(s.basis)
        if s.v.strategy.rot:
            used_v.add(s.basis)
        for ch in (s.k, s.v):
            for name, t in ch.encoded.tensors.items():
                kind = ("values" if name in VALUE_NAMES else "indices" if name in INDEX_NAMES
                        else "scales" if name in SCALE_NAMES else None)
                assert kind, f"unclassified tensor '{name}' of {ch.strategy.spec}"
                out[kind] += tensor_bytes(t)
    out["bases"] = sum(tensor_bytes(layer.k_bases[i]) for i in used_k) + \
        sum(tensor_bytes(layer.v_bases[i]) for i in used_v)
    out["hot"] = tensor_bytes(layer.hot_k) + tensor_bytes(layer.hot_v)
    return out


MIXED = dict(k_candidates=["band:b8=8,b4=16,b2=8,group=32", "topr:r=8,val=int4,index=u8",
                           "lowbit:bits=4,group=32", "mask:r=16,val=fp8"],
             v_candidates=["band:b8=0,b4=24,b2=8,group=64", "topr:r=12,val=int8,rot=0",
                           "lowbit:bits=2,group=32,v_axis=channel", "dense:val=fp8"],
             sink_candidates=["lowbit:bits=8,group=32"], sink_error_budget=0.05)


@pytest.mark.parametrize("trial", range(3))
def test_byte_breakdown_and_hot_buffer(trial, seed):
    h, g, d, seg, pt, hot, nseg, t = rand_shape()
    if trial == 2:  # the shipped defaults: band groups of 128 tokens need 128-token segments
        t += (128 - seg) * nseg
        seg, d = 128, 64  # (and the default bands cover 64 channels)
    nseg, t, d = nseg + 2, t + 2 * seg, 64  # (band candidates need head_dim 64)
    k, v = kv(h, t, d)
    budgets = [float(x) for x in torch.rand(2) * 0.4]
    cfg = MosaicConfig(segment_tokens=seg, page_tokens=pt, basis_block_tokens=2 * seg,
                       hot_tokens=hot, k_error_budget=budgets[0], v_error_budget=budgets[1],
                       select=SelectionConfig(budget_tokens=2 * pt, meta_channels=8) if trial % 2 else
                       SelectionConfig(enabled=False, budget_tokens=pt), **MIXED) \
        if trial < 2 else MosaicConfig(segment_tokens=seg, page_tokens=pt,
                                       basis_block_tokens=2 * seg, hot_tokens=hot)
    layer = compress_layer(k, v, cfg)
    mine = walk_bytes(layer)
    theirs = layer.byte_breakdown()
    assert theirs == mine, f"{theirs} != {mine} {repro(seed)}"
    assert mine["headers"] == nseg * len(HEADER_FIELDS) * 4
    assert mine["hot"] == 2 * h * layer.hot_k.shape[1] * d * 2
    # the hot buffer is exactly the tokens after the last sealed segment
    sealed = (t - hot) // seg * seg
    assert layer.hot_start == sealed == nseg * seg, repro(seed)
    assert [s.start for s in layer.segments] == list(range(0, sealed, seg)), repro(seed)
    assert all(s.tokens == seg for s in layer.segments)
    assert hot <= layer.hot_k.shape[1] < hot + seg
    assert layer.hot_k.dtype == torch.bfloat16 and torch.equal(layer.hot_k, k[:, sealed:])
    assert torch.equal(layer.hot_v, v[:, sealed:]) and layer.tokens() == t
    # one basis per block, but a short tail block reuses the previous one (basis_inherit_...)
    blocks = math.ceil(sealed / (2 * seg))
    tail = sealed - (blocks - 1) * 2 * seg
    n_bases = blocks - (blocks > 1 and tail < min(cfg.basis_inherit_below_tokens, 2 * seg))
    assert len(layer.k_bases) == n_bases, repro(seed)
    assert all(b.dtype == BASIS_DTYPE and b.shape == (h, d, d) for b in layer.k_bases + layer.v_bases)
    # headers say what a kernel needs to find each segment
    for s in layer.segments:
        expect = [strategy_id(s.k.strategy.name), strategy_id(s.v.strategy.name),
                  s.basis if s.k.strategy.rot else -1, s.basis if s.v.strategy.rot else -1,
                  s.start, s.tokens]
        assert s.header.dtype == torch.int32 and s.header.tolist() == expect, repro(seed)
        assert s.basis == min(s.start // (2 * seg), n_bases - 1)


@pytest.mark.parametrize("low_rank", (False, True))
def test_compressed_config_has_ratio_above_one(low_rank, seed):
    h, d, seg = 2, 64, 128
    t = 4 * seg + 64
    k, v = kv(h, t, d, low_rank=low_rank)
    if low_rank:  # the shipped defaults, on data with structure
        cfg = MosaicConfig()
    else:
        cfg = MosaicConfig(k_candidates=["lowbit:bits=4,group=32,rot=1"],
                           v_candidates=["lowbit:bits=4,group=32"], k_error_budget=math.inf,
                           v_error_budget=math.inf)
    layer = compress_layer(k, v, cfg)
    dense = 2 * h * t * d * 2
    total = sum(layer.byte_breakdown().values())
    ratio = dense / total
    assert ratio > 1.5, f"ratio {ratio:.3f} {layer.byte_breakdown()} {repro(seed)}"
    reasons = [c.reason for s in layer.segments for c in (s.k, s.v)]
    assert "over-budget" not in reasons[2:], f"{reasons} {repro(seed)}"
    # the dense config costs more than dense bf16 (headers/page metadata), never less
    dense_layer = compress_layer(k, v, lossless_cfg(seg, 32, 64, SelectionConfig(budget_tokens=32)))
    assert sum(dense_layer.byte_breakdown().values()) >= dense


# ---- (d) the chooser -------------------------------------------------------------------------

CANDS = ["lowbit:bits=8,group=32", "lowbit:bits=2,group=32", "topr:r=8,val=int4",
         "band:b8=8,b4=8,b2=0,group=64", "mask:r=16,val=bf16", "dense:val=fp8"]


def _measure(x: torch.Tensor, x_rot: torch.Tensor, kind: str, specs):
    out = {}
    for spec in specs:
        st = parse_strategy(spec)
        src = x_rot if st.rot else x
        enc = Encoded(kind, tuple(x.shape), st.encode(src, kind))
        out[st.spec] = (enc.nbytes(), relative_error(st.decode(enc), src))
    return out


@pytest.mark.parametrize("kind", ("k", "v"))
def test_choose_respects_budget_and_bytes(kind, seed):
    h, d, s = 2, 64, 64
    x = torch.randn(h, s, d).to(torch.bfloat16).float()
    basis = torch.linalg.qr(torch.randn(h, d, d))[0]
    x_rot = x @ basis
    cands = [parse_strategy(c) for c in CANDS]
    measured = _measure(x, x_rot, kind, CANDS)
    # huge budget: the cheapest
    c = choose(x, x_rot, kind, cands, math.inf)
    cheapest = min(measured, key=lambda spec: measured[spec][0])
    assert c.strategy.spec == cheapest and c.reason == "within-budget", repro(seed)
    assert c.encoded.nbytes() == measured[cheapest][0]
    # a budget in between: the cheapest of those within it
    errs = sorted(e for _, e in measured.values())
    budget = errs[len(errs) // 2]
    c = choose(x, x_rot, kind, cands, budget)
    ok = {spec: b for spec, (b, e) in measured.items() if e <= budget}
    assert c.strategy.spec == min(ok, key=ok.get) and c.error <= budget, repro(seed)
    assert abs(c.error - measured[c.strategy.spec][1]) < 1e-9
    # budget 0: no lossy candidate qualifies -> dense bf16, exact on bf16 input
    c = choose(x, x_rot, kind, cands, 0.0)
    assert c.strategy.name == "dense" and c.strategy.val == "bf16" and c.reason == "over-budget"
    assert c.error == 0.0 and torch.equal(c.strategy.decode(c.encoded), x), repro(seed)
    # a custom reason is reported when a candidate qualifies; a missed budget is 'over-budget';
    # with no candidates at all the dense fallback is the configured choice (keeps the reason)
    assert choose(x, x_rot, kind, cands, math.inf, "sink").reason == "sink"
    assert choose(x, x_rot, kind, cands, 0.0, "sink").reason == "over-budget"
    c = choose(x, x_rot, kind, [], math.inf, "sink")
    assert c.reason == "sink" and c.strategy.spec == "dense:val=bf16" and c.error == 0.0
    # the fallback strategy is configurable (e.g. fp32 dense for an fp32 cache: exact)
    xf = torch.randn(h, s, d)
    c = choose(xf, xf @ basis, kind, cands, 0.0, fallback=parse_strategy("dense:val=fp32"))
    assert c.strategy.spec == "dense:val=fp32" and c.reason == "over-budget" and c.error == 0.0
    assert torch.equal(c.strategy.decode(c.encoded), xf), repro(seed)


def test_compress_layer_chooser_huge_and_zero_budget(seed):
    h, d, seg, pt, hot = 2, 64, 64, 16, 16
    t = 3 * seg + hot + 7
    k, v = kv(h, t, d)
    base = dict(segment_tokens=seg, page_tokens=pt, basis_block_tokens=4 * seg, hot_tokens=hot,
                sink_segments=0, k_candidates=CANDS, v_candidates=CANDS)
    layer = compress_layer(k, v, MosaicConfig(**base, k_error_budget=1e9, v_error_budget=1e9))
    kb, vb = layer.k_bases[0], layer.v_bases[0]
    for s in layer.segments:
        for kind, ch, x, basis in (("k", s.k, k, kb), ("v", s.v, v, vb)):
            xs = x[:, s.start:s.start + seg].float()
            measured = _measure(xs, rotate(xs, basis), kind, CANDS)
            cheapest = min(measured, key=lambda spec: measured[spec][0])
            assert ch.strategy.spec == cheapest and ch.reason == "within-budget", repro(seed)
    layer = compress_layer(k, v, MosaicConfig(**base, k_error_budget=0.0, v_error_budget=0.0))
    for s in layer.segments:
        for ch, x in ((s.k, k), (s.v, v)):
            assert ch.strategy.spec == "dense:val=bf16" and ch.reason == "over-budget"
            assert torch.equal(ch.encoded.tensors["values"], x[:, s.start:s.start + seg])


@pytest.mark.parametrize("sink_segments", (1, 2))
def test_sink_segments_use_sink_candidates(sink_segments, seed):
    h, d, seg, pt, hot = 2, 32, 64, 16, 16
    t = 4 * seg + hot
    k, v = kv(h, t, d)
    base = dict(segment_tokens=seg, page_tokens=pt, basis_block_tokens=2 * seg, hot_tokens=hot,
                sink_segments=sink_segments, k_candidates=["lowbit:bits=2,group=32"],
                rescue_candidates=[],  # head_dim 32: the default 8-bit band rescue does not fit
                v_candidates=["topr:r=4,val=int4"], k_error_budget=math.inf,
                v_error_budget=math.inf)
    layer = compress_layer(k, v, MosaicConfig(**base, sink_candidates=["lowbit:bits=8,group=32"],
                                              sink_error_budget=math.inf))
    for i, s in enumerate(layer.segments):
        if i < sink_segments:  # sink: its own (costlier) candidate, not the cheaper k/v ones
            assert s.k.strategy.spec == s.v.strategy.spec == "lowbit:bits=8,group=32,k_axis=channel,v_axis=token"
            assert s.k.reason == s.v.reason == "sink", repro(seed)
        else:
            assert s.k.strategy.name == "lowbit" and s.k.strategy.bits == 2
            assert s.v.strategy.name == "topr" and s.k.reason == s.v.reason == "within-budget"
    # no sink candidates (dense by configuration: reason 'sink'), or none within the sink budget
    # ('over-budget'): the sink stays dense bf16, bit-exact
    for extra, reason in ((dict(sink_candidates=[]), "sink"),
                          (dict(sink_candidates=["lowbit:bits=8,group=32"], sink_error_budget=0.0),
                           "over-budget")):
        layer = compress_layer(k, v, MosaicConfig(**base, **extra))
        for i, s in enumerate(layer.segments):
            dense = s.k.strategy.name == "dense" and s.v.strategy.name == "dense"
            assert dense == (i < sink_segments), f"{extra} segment {i} {repro(seed)}"
            if dense:
                assert s.k.reason == s.v.reason == reason and s.k.error == s.v.error == 0.0
                assert s.k.strategy.spec == "dense:val=bf16"
                assert torch.equal(s.k.encoded.tensors["values"], k[:, s.start:s.start + seg])


# ---- (e) numerical stability -----------------------------------------------------------------

@pytest.mark.parametrize("scale", (2 ** 10, 2 ** 14))
@pytest.mark.parametrize("select", (False, True))
def test_large_scores_are_stable(scale, select, seed):
    """Logits of magnitude ~1e4..1e5. K and q are dyadic (k in 1/4 steps, q integer * scale,
    sm_scale 1/8) so every float32 logit is exact: any difference from the float64 reference
    comes from the softmax / log-sum-exp merging, which must be exact to float32 rounding."""
    h, g, d, seg, pt, hot, nseg, t = rand_shape()
    nseg, t = nseg + 1, t + seg
    k = (torch.randint(-8, 9, (h, t, d)) / 4).to(torch.bfloat16)
    v = torch.randn(h, t, d).to(torch.bfloat16)
    sel = SelectionConfig(enabled=select, budget_tokens=2 * pt, sink_tokens=pt, recent_tokens=0,
                          meta_channels=8)
    layer = compress_layer(k, v, lossless_cfg(seg, pt, hot, sel))
    nq = 3
    q = torch.randint(-8, 9, (nq, h * g, d)).float() * scale
    pos = hot_positions(nq, layer.hot_start, t)
    out, info = decode_attention(q, layer, pos, sel, pt, sm_scale=0.125)
    assert_finite(out, f"q*{scale:g}", seed)
    keep = None
    if select:
        assert info.page_keep is not None and int(info.page_keep.sum()) == 2 * nq * h
        keep = torch.ones(nq, h, t, dtype=torch.bool)
        keep[:, :, :layer.hot_start] = info.page_keep.repeat_interleave(pt, -1)
    expect, _ = reference(q, k, v, pos, 0.125, keep)
    max_logit = float((torch.einsum("nqd,qtd->nqt", q.double(), k.double().repeat_interleave(
        g, 0)) * 0.125).abs().max())
    assert max_logit > 1e3, repro(seed)
    assert_rel_close(out, expect, 1e-5, f"q*{scale:g} select={select} max logit {max_logit:.3g}",
                     seed)


def test_identity_bases_are_bands_on_raw_channels(seed):
    """fit_solver=identity (the no-rotation ablation the packed kernel can read) stores exactly
    what rot=0 bands store and attends the same, page selection included."""
    h, g, d, seg, pt, hot, nseg, t = rand_shape()
    d = 64
    k, v = kv(h, t, d)
    spec = "band:b8=4,b4=44,b2=16,group=32"
    common = dict(segment_tokens=seg, page_tokens=pt, basis_block_tokens=seg, hot_tokens=hot,
                  sink_segments=0, k_error_budget=math.inf, v_error_budget=math.inf,
                  # the bound alone: the default's second stage scores the leading 32
                  # channels of rotated K (identity bases: raw channels) but every channel of a
                  # rot=0 band, by design, so the two would read different pages
                  select=SelectionConfig(enabled=True, budget_tokens=max(pt, seg // 2),
                                         sink_tokens=0, recent_tokens=pt, rescore_factor=0,
                                         rescore_channels=0))
    ident = compress_layer(k, v, MosaicConfig(k_candidates=[spec], v_candidates=[spec],
                                              fit_solver="identity", **common))
    raw = compress_layer(k, v, MosaicConfig(k_candidates=[spec + ",rot=0"],
                                            v_candidates=[spec + ",rot=0"], **common))
    eye = torch.eye(d, dtype=BASIS_DTYPE)
    assert all(torch.equal(b, eye.expand(h, d, d)) for b in ident.k_bases + ident.v_bases)
    for a, b in zip(ident.segments, raw.segments):
        for kind in ("k", "v"):
            ta, tb = getattr(a, kind).encoded.tensors, getattr(b, kind).encoded.tensors
            assert ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta), kind
    q = torch.randn(2, h * g, d)
    pos = hot_positions(2, ident.hot_start, t)
    out_i, _ = decode_attention(q, ident, pos, common["select"], pt)
    out_r, _ = decode_attention(q, raw, pos, common["select"], pt)
    assert_rel_close(out_i, out_r, 1e-5, "identity bases vs rot=0", seed)
