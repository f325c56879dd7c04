"""Batched sealing gives exactly what sealing each segment alone gives: same strategies, same
bytes, same page metadata, same dense fallbacks, for `seal_segments` (N segments per chooser
call) and for the pool's whole path (one gather per group, bases fitted over all layers at once,
a layer's segments installed into the arena in one batch)."""
import pytest
import torch

from conftest import repro
from pool_utils import Inversions
from mosaickv_sglang.codec.basis import fit_basis
from mosaickv_sglang.codec.layer import DENSE, Candidates, _choose_batch, seal_segments
from mosaickv_sglang.codec.seal import fit_bases, gather_pages, page_kv, seal_group, solve_split
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.segment_store import SegmentStore

H, S, D = 2, 128, 64


def _segments(n, gen):
    # mixed difficulty: some segments heavy-tailed so that cheap candidates miss the budget
    scale = torch.rand(n, 1, 1, 1, generator=gen) * 3 + 0.5
    k = torch.randn(n, H, S, D, generator=gen) * scale * (1 + torch.arange(D) % 5)
    k[::3] = k[::3] * torch.randn(S, D, generator=gen).exp()  # outliers
    v = torch.randn(n, H, S, D, generator=gen) * scale
    return k, v


@pytest.mark.parametrize("sink", [False, True])
def test_batched_sealing_equals_one_by_one(sink, seed):
    gen = torch.Generator().manual_seed(seed)
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
    for a, b in zip(batched, single):
        for ca, cb in ((a.k, b.k), (a.v, b.v)):
            assert ca.strategy.spec == cb.strategy.spec and ca.reason == cb.reason, repro(seed)
            assert ca.error == pytest.approx(cb.error, rel=1e-4), repro(seed)
            assert ca.encoded.tensors.keys() == cb.encoded.tensors.keys()
            for name in ca.encoded.tensors:
                assert torch.equal(ca.encoded.tensors[name], cb.encoded.tensors[name]), \
                    (name, repro(seed))
        assert torch.equal(a.header, b.header) and a.pages_rotated == b.pages_rotated
        for ta, tb in zip(a.pages.tensors().values(), b.pages.tensors().values()):
            assert torch.equal(ta, tb), repro(seed)
    # The equality above holds whichever paths ran; these are the paths the data was built to
    # take (measured over 150 seeds): a sink segment takes the sink candidate; otherwise V and
    # K's plain segments fit a candidate, and K's heavy-tailed segments (0, 3, 6) miss all three
    # and take the rescue candidate (all three in 149 seeds, two in the other).
    k_reasons, v_reasons = [s.k.reason for s in batched], [s.v.reason for s in batched]
    if sink:
        assert k_reasons == v_reasons == ["sink"] * n, (k_reasons, v_reasons, repro(seed))
    else:
        assert v_reasons == ["within-budget"] * n, (v_reasons, repro(seed))
        assert [r for i, r in enumerate(k_reasons) if i % 3] == ["within-budget"] * 4, \
            (k_reasons, repro(seed))
        outliers = k_reasons[::3]
        assert "rescued" in outliers and set(outliers) <= {"rescued", "within-budget"}, \
            (k_reasons, repro(seed))


def test_fallback_applies_only_to_segments_over_budget(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, H, S, D, generator=gen)
    x[1] *= torch.randn(S, D, generator=gen).exp()  # one heavy-tailed segment
    cands = Candidates.from_config(MosaicConfig(k_candidates=["lowbit:bits=2,group=32"]))
    errs = [c.error for c in _choose_batch(x, x, "k", cands.k, float("inf"), "within-budget",
                                           DENSE)[0]]
    worst = max(range(4), key=errs.__getitem__)
    budget = (max(errs) + sorted(errs)[-2]) / 2  # only the worst segment misses it
    choices, _ = _choose_batch(x, x, "k", cands.k, budget, "within-budget", DENSE)
    assert [c.reason == "over-budget" for c in choices] == [i == worst for i in range(4)], \
        (errs, repro(seed))
    assert [c.strategy.name for c in choices] == ["dense" if i == worst else "lowbit"
                                                  for i in range(4)]
    assert choices[worst].error < 0.01  # the dense (bf16) fallback: rounding error only



def test_rescue_candidate_comes_before_the_dense_fallback(seed):
    """A segment no candidate fits takes the first rescue candidate that meets the budget
    (reason 'rescued'); only one no rescue fits either goes dense ('over-budget')."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, H, S, D, generator=gen)
    x[1] *= torch.randn(S, D, generator=gen).exp()  # heavy-tailed: 2-bit misses, 8-bit fits
    cands = Candidates.from_config(MosaicConfig(k_candidates=["lowbit:bits=2,group=32"],
                                                rescue_candidates=["lowbit:bits=8,group=32"]))
    two = [c.error for c in _choose_batch(x, x, "k", cands.k, float("inf"), "r", DENSE)[0]]
    eight = [c.error for c in _choose_batch(x, x, "k", cands.rescue, float("inf"), "r", DENSE)[0]]
    worst = max(range(4), key=two.__getitem__)
    budget = (two[worst] + sorted(two)[-2]) / 2  # only the worst segment misses the 2-bit
    assert eight[worst] < budget, (eight, budget, repro(seed))  # ... and 8 bits fit it
    choices, _ = _choose_batch(x, x, "k", cands.k, budget, "within-budget", DENSE,
                               rescue=cands.rescue)
    assert [c.reason for c in choices] == ["rescued" if i == worst else "within-budget"
                                           for i in range(4)]
    assert choices[worst].strategy.spec == cands.rescue[0].spec
    assert abs(choices[worst].error - eight[worst]) < 1e-6
    # a budget the rescue misses too: dense
    choices, _ = _choose_batch(x, x, "k", cands.k, 0.0, "within-budget", DENSE,
                               rescue=cands.rescue)
    assert all(c.reason == "over-budget" and c.strategy.name == "dense" for c in choices)

# ---- the serving path: one gather per group, bases over all layers, a layer's batch installed --

L, P = 3, 5


def _hot_buffer(gen, dtype=torch.bfloat16):
    """SGLang-like dense cache: one [rows, H, D] tensor per layer, page p at rows (p+1)*S, some
    pages heavy-tailed (dense fallbacks: segments the store leaves unpacked)."""
    rows = (P + 1) * S
    scale = torch.logspace(0.5, -1, D)
    k = [torch.randn(rows, H, D, generator=gen) * scale for _ in range(L)]
    v = [torch.randn(rows, H, D, generator=gen) * scale.flip(0) for _ in range(L)]
    k[1][2 * S:3 * S] *= (3 * torch.randn(S, H, D, generator=gen)).exp()
    return [t.to(dtype) for t in k], [t.to(dtype) for t in v]


def _read_one(kbuf, vbuf, page, layer):
    """The previous reader: one (page, layer) at a time, [H, S, D] float."""
    rows = (page + 1) * S + torch.arange(S)
    return kbuf[layer][rows].transpose(0, 1).float(), vbuf[layer][rows].transpose(0, 1).float()


def test_a_daemon_slot_copy_holds_every_layers_page(seed):
    """`page_kv` (the pool's one-copy read of a hot page into a daemon slot [L, 2, H, S, D])
    holds exactly what the per-(page, layer) reader reads, for every page of the buffer."""
    gen = torch.Generator().manual_seed(seed)
    kbuf, vbuf = _hot_buffer(gen)
    for page in range(P):
        got = page_kv(kbuf, vbuf, page + 1, S)
        assert got.shape == (L, 2, H, S, D) and got.is_contiguous(), repro(seed)
        for layer in range(L):
            k, v = _read_one(kbuf, vbuf, page, layer)
            assert torch.equal(got[layer, 0].float(), k), repro(seed)
            assert torch.equal(got[layer, 1].float(), v), repro(seed)


@pytest.mark.parametrize("solver", ["host", "device", "jacobi"])  # host, jacobi: all layers at once
def test_fit_bases_equals_layer_by_layer(seed, solver):
    gen = torch.Generator().manual_seed(seed)
    kbuf, vbuf = _hot_buffer(gen)
    k, v = gather_pages(kbuf, vbuf, torch.arange(P) + 1, S)
    bases = fit_bases(k, v, solver)
    for layer in range(L):
        kv = [_read_one(kbuf, vbuf, p, layer) for p in range(P)]
        for got, x in ((bases.k[layer], [a for a, _ in kv]), (bases.v[layer], [b for _, b in kv])):
            want = fit_basis(torch.cat(x, 1), jacobi=solver == "jacobi")
            assert torch.equal(got, want), repro(seed)


def test_host_solvers_split_over_threads_is_bitwise(seed):
    x = torch.randn(7, D, 2 * D)
    cov = x @ x.transpose(1, 2)
    for func in (torch.linalg.eigh, torch.linalg.qr):
        whole = func(cov)
        split = solve_split(func, cov, 3)
        assert type(split) is type(whole)
        assert all(torch.equal(a, b) for a, b in zip(split, whole)), repro(seed)
    # the parts run single-threaded (thread-local): the caller's thread count is untouched
    torch.set_num_threads(2)
    solve_split(torch.linalg.eigh, cov, 3)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("select", [True, False])
def test_sealing_a_group_equals_one_segment_at_a_time(seed, select):
    """seal_group + install_pages (the pool's path) against the previous one-by-one path: per
    (page, layer) reads, per-layer fit_basis, one chooser call and one install per segment."""
    gen = torch.Generator().manual_seed(seed)
    kbuf, vbuf = _hot_buffer(gen)
    # no rescue candidate: the heavy-tailed pages must fall back to dense (the unpacked store path)
    # basis_fit "group" (the chunk rule's: a block's bases fitted on all the pages sealed
    # together), the one-by-one reference below fitting each layer on every page
    cfg = MosaicConfig(k_error_budget=0.05, select={"enabled": select}, rescue_candidates=[],
                       read_rule="chunk", basis_fit="group")
    cands, dense = Candidates.from_config(cfg), DENSE
    positions = [S * p for p in range(P)]  # page 0 is the sink page
    pages = [p + 1 for p in range(P)]  # logical page ids (0: SGLang's padding page)

    def store():
        return SegmentStore(L, P + 2, H, D, S, cfg.page_tokens, "cpu",
                            cfg.select.meta_channels if select else None, 1 << 22)

    batched = seal_group(lambda idx: gather_pages(kbuf, vbuf, torch.tensor(idx) + 1, S),
                         positions, None, cfg, cands, dense)
    sa = store()
    kept = sa.install_pages(pages, [sp.segments for sp in batched])  # the segments it keeps

    sb = store()
    for layer in range(L):
        kv = [_read_one(kbuf, vbuf, p, layer) for p in range(P)]
        kb = fit_basis(torch.cat([a for a, _ in kv], 1))  # basis_fit "group"
        vb = fit_basis(torch.cat([b for _, b in kv], 1))
        assert torch.equal(batched[0].bases.k[layer], kb), repro(seed)
        assert torch.equal(batched[0].bases.v[layer], vb), repro(seed)
        for p, (k, v) in enumerate(kv):
            sink = positions[p] // S < cfg.sink_segments
            seg = seal_segments(k[None], v[None], kb[None], vb[None], 0, [positions[p]], cfg,
                                cands, sink, select, dense)[0]
            got = batched[p].segments[layer]
            assert (got.k.strategy.spec, got.v.strategy.spec, got.k.reason, got.v.reason) == \
                (seg.k.strategy.spec, seg.v.strategy.spec, seg.k.reason, seg.v.reason), repro(seed)
            assert (got.k.error, got.v.error) == (seg.k.error, seg.v.error), repro(seed)
            for a, b in ((got.k, seg.k), (got.v, seg.v)):
                assert a.encoded.tensors.keys() == b.encoded.tensors.keys()
                for name in a.encoded.tensors:
                    assert torch.equal(a.encoded.tensors[name], b.encoded.tensors[name]), \
                        f"{name} {repro(seed)}"
            assert torch.equal(got.header, seg.header) and got.pages_rotated == seg.pages_rotated
            if select:
                for ta, tb in zip(got.pages.tensors().values(), seg.pages.tensors().values()):
                    assert torch.equal(ta, tb), repro(seed)
            sb.install(layer, [pages[p]], [seg])
    kinds = {s.k.strategy.name for sp in batched for s in sp.segments}
    assert "dense" in kinds and "band" in kinds, kinds  # both store paths ran
    assert sa.blocks == sb.blocks and sa.arena_full == sb.arena_full
    assert torch.equal(sa.packed, sb.packed) and sa.live_bytes == sb.live_bytes
    for layer in range(L):
        assert torch.equal(sa.headers[layer], sb.headers[layer])
        if select:
            for name in ("channels", "lo", "hi", "rest_norm"):
                assert torch.equal(getattr(sa.meta[layer], name), getattr(sb.meta[layer], name))
    # the store keeps packed segments as views of its arena and unpacked ones in their own
    # memory (not views keeping the chooser's batch alive)
    for page, segs in zip(pages, kept):
        for layer, seg in enumerate(segs):
            stored = bool(sa.packed[layer, page])
            for t in seg.k.encoded.tensors.values():
                owner = sa.data[layer].untyped_storage().data_ptr()
                assert (t.untyped_storage().data_ptr() == owner) == stored
                if not stored:
                    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_lazy_chooser_picks_what_trying_every_candidate_picks(seed):
    """`_choose_batch` encodes a candidate only for segments no cheaper one fitted; its picks,
    errors and bytes are the eager reference's (`choose`: every candidate encoded), and it does
    fewer encodes when cheap candidates fit some segments."""
    from mosaickv_sglang.codec.layer import choose
    gen = torch.Generator().manual_seed(seed)
    cfg = MosaicConfig(k_candidates=["band:b8=4,b4=44,b2=16,group=128",
                                     "band:b8=4,b4=60,b2=0,group=128",
                                     "band:b8=16,b4=48,b2=0,group=64"], k_error_budget=0.06)
    cands = Candidates.from_config(cfg)
    k, _ = _segments(9, gen)
    kb = torch.stack([fit_basis(k[i]) for i in range(9)])
    k_rot = k @ torch.linalg.inv(kb.float())
    from mosaickv_sglang.codec.layer import _segment_bytes
    order = sorted(cands.k, key=lambda st: _segment_bytes(st, "k", H, S, D))  # cached from here
    calls = []
    for strat in cands.k:  # the chooser's one encode per try
        enc = strat.encode_decoded
        strat.encode_decoded = lambda x, kind, enc=enc: calls.append(x.shape[0]) or enc(x, kind)
    try:
        got, _ = _choose_batch(k, k_rot, "k", cands.k, 0.06, "within-budget", DENSE)
    finally:
        for strat in cands.k:
            del strat.encode_decoded
    for i, c in enumerate(got):
        want = choose(k[i], k_rot[i], "k", cands.k, 0.06)
        assert (c.strategy.spec, c.reason) == (want.strategy.spec, want.reason), repro(seed)
        assert c.error == pytest.approx(want.error, rel=1e-5)
        assert c.encoded.nbytes() == want.encoded.nbytes()
    # candidate j is encoded for exactly the segments that no cheaper candidate fitted
    rank = [next((j for j, st in enumerate(order) if st.spec == c.strategy.spec), len(order))
            for c in got]
    assert calls == [H * sum(r >= j for r in rank) for j in range(len(order))
                     if any(r >= j for r in rank)], (calls, rank, repro(seed))


@pytest.mark.parametrize("spec", ["band:b8=4,b4=44,b2=16,group=128", "lowbit:bits=4,group=32",
                                  "topr:r=16,val=fp8", "mask:r=20", "dense"])
def test_segment_bytes_do_not_depend_on_the_values(spec, seed):
    """The chooser orders candidates by bytes measured once per shape: true only if no
    strategy's size depends on the values."""
    from mosaickv_sglang.codec.strategies import Encoded, parse_strategy
    strat = parse_strategy(spec)
    sizes = {Encoded("k", (H, S, D), strat.encode(x, "k")).nbytes()
             for x in (torch.randn(H, S, D), torch.randn(H, S, D).exp() * 100,
                       torch.zeros(H, S, D))}
    assert len(sizes) == 1, sizes


def test_sealing_pages_of_a_block_inverts_each_basis_once(seed):
    """The write transforms (R^-1) are computed once per `seal_pages` call (or passed in, as a
    daemon job does for its pages), not once per (page, layer) segment: the inverses were half
    of sealing a Llama-8B page on a CPU core. Counted as matrices inverted for 1 and 3 pages,
    and the pages sealed with the transforms passed in are the same bytes."""
    from mosaickv_sglang.codec.seal import seal_pages, write_transforms
    from mosaickv_sglang.codec.strategies import parse_strategy

    cfg, layers = MosaicConfig(), 3
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(3, layers, H, S, D, generator=gen) * (1 + torch.arange(D) % 5)
    v = torch.randn(3, layers, H, S, D, generator=gen)
    bases = fit_bases(k, v, cfg.fit_solver)
    cands, dense = Candidates.from_config(cfg), parse_strategy("dense")
    positions = [S * (cfg.sink_segments + i) for i in range(3)]
    counted = {}
    for pages in (1, 3):
        with Inversions() as inv:
            sealed = seal_pages(k[:pages], v[:pages], positions[:pages], bases, cfg, cands, dense)
        counted[pages] = inv.matrices
    assert counted == {1: 2 * layers * H, 3: 2 * layers * H}, (counted, repro(seed))
    write = write_transforms(bases)
    for j in range(3):  # a daemon job: one page per call, the transforms computed once
        one = seal_pages(k[j:j + 1], v[j:j + 1], positions[j:j + 1], bases, cfg, cands, dense,
                         write=write)[0]
        for a, b in zip(one.segments, sealed[j].segments):
            for x, y in ((a.k, b.k), (a.v, b.v)):
                assert x.strategy.spec == y.strategy.spec, repro(seed)
                for name, t in x.encoded.tensors.items():
                    assert torch.equal(t, y.encoded.tensors[name]), (name, repro(seed))


def test_several_blocks_invert_in_one_call_to_each_blocks_own_transforms(seed):
    """One decode step seals a page of each of N requests (N basis blocks): their write
    transforms come from one batched inversion (one launch, one host sync on a GPU, where N
    calls cost 2N), and each block's equal bit for bit what inverting it alone gives; pairs
    with and without `whole` mixed. `seal_pages` with per-page bases calls the inversion once."""
    from mosaickv_sglang.codec.seal import (BasisPair, seal_pages, write_transforms,
                                            write_transforms_of)
    from mosaickv_sglang.codec.strategies import parse_strategy

    cfg, layers = MosaicConfig(), 3
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(4, layers, H, S, D, generator=gen) * (1 + torch.arange(D) % 5)
    v = torch.randn(4, layers, H, S, D, generator=gen)
    blocks = [fit_bases(k[j:j + 1], v[j:j + 1], cfg.fit_solver) for j in range(4)]
    blocks[1] = BasisPair(list(blocks[1].k), list(blocks[1].v))  # no `whole`
    got = write_transforms_of(blocks)
    for b, (kt, vt) in zip(blocks, got):
        ka, va = write_transforms(b)
        assert torch.equal(kt, ka) and torch.equal(vt, va), repro(seed)
    positions = [S * (cfg.sink_segments + 4 * j) for j in range(4)]
    with Inversions() as calls:
        seal_pages(k, v, positions, blocks, cfg, Candidates.from_config(cfg),
                   parse_strategy("dense"))
    assert calls.calls == 1, (calls.calls, repro(seed))


@pytest.mark.parametrize("seal_batch", [256, 5])
def test_pages_of_several_blocks_in_one_call_equal_each_block_alone(seed, seal_batch,
                                                                   monkeypatch):
    """`seal_pages` with per-page bases (one decode step's pages of several requests, or a
    batch's basis blocks) gives every page what sealing its own block's pages alone gives:
    strategies, errors, bytes, page metadata and headers. Pages of two blocks interleaved (and
    a sink page); SEAL_BATCH 5 cuts the batch inside pages (the per-segment gather path)."""
    from mosaickv_sglang.codec import seal as seal_mod
    from mosaickv_sglang.codec.seal import seal_pages
    from mosaickv_sglang.codec.strategies import parse_strategy

    monkeypatch.setattr(seal_mod, "SEAL_BATCH", seal_batch)
    cfg, layers = MosaicConfig(k_error_budget=0.12), 3
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(5, layers, H, S, D, generator=gen) * (1 + torch.arange(D) % 5)
    k[1] = k[1] * torch.randn(S, D, generator=gen).exp()  # outliers: another candidate
    v = torch.randn(5, layers, H, S, D, generator=gen)
    blocks = [0, 1, 0, 1, 1]  # the block of each page
    bases = [fit_bases(k[[0]], v[[0]], cfg.fit_solver), fit_bases(k[[1]], v[[1]], cfg.fit_solver)]
    positions = [0, 4096, S, 4096 + S, 4096 + 2 * S]  # page 0 is a sink page
    cands, dense = Candidates.from_config(cfg), parse_strategy("dense")
    together = seal_pages(k, v, positions, [bases[b] for b in blocks], cfg, cands, dense)
    for b in (0, 1):
        idx = [j for j in range(5) if blocks[j] == b]
        alone = seal_pages(k[idx], v[idx], [positions[j] for j in idx], bases[b], cfg, cands,
                           dense)
        for j, one in zip(idx, alone):
            assert together[j].bases is bases[b] and together[j].nbytes == one.nbytes
            for got, want in zip(together[j].segments, one.segments):
                assert (got.k.strategy.spec, got.v.strategy.spec, got.k.reason) == \
                    (want.k.strategy.spec, want.v.strategy.spec, want.k.reason), repro(seed)
                assert (got.k.error, got.v.error) == (want.k.error, want.v.error), repro(seed)
                assert torch.equal(got.header, want.header), repro(seed)
                for x, y in ((got.k, want.k), (got.v, want.v)):
                    for name, t in x.encoded.tensors.items():
                        assert torch.equal(t, y.encoded.tensors[name]), (name, repro(seed))
                for ta, tb in zip(got.pages.tensors().values(), want.pages.tensors().values()):
                    assert torch.equal(ta, tb), repro(seed)
    kinds = {s.k.strategy.spec for sp in together for s in sp.segments}
    assert len(kinds) > 1, kinds  # more than one candidate was picked
    with pytest.raises(ValueError, match="BasisPairs for"):
        seal_pages(k, v, positions, bases, cfg, cands, dense)


@pytest.mark.parametrize("basis_fit", ["group", "first_page"])
@pytest.mark.parametrize("solver", ["host", "jacobi"])
def test_fit_groups_equals_each_group_fitted_alone(seed, basis_fit, solver):
    """`fit_groups` (the blocks a batch of seals opens, fitted in one call per page count)
    gives each group the bases `seal_group` fits for it alone, bit for bit: groups of 1, 1, 2
    and 1 pages."""
    from mosaickv_sglang.codec.seal import fit_block_bases, fit_groups

    # "group" fits go with the chunk rule (the position rule, the default, needs "first_page")
    rule = "chunk" if basis_fit == "group" else "position"
    cfg, layers = MosaicConfig(read_rule=rule, basis_fit=basis_fit, fit_solver=solver), 3
    gen = torch.Generator().manual_seed(seed)
    groups = [(torch.randn(p, layers, H, S, D, generator=gen) * (1 + torch.arange(D) % 5),
               torch.randn(p, layers, H, S, D, generator=gen)) for p in (1, 1, 2, 1)]
    got = fit_groups(groups, cfg)
    fit = fit_block_bases if basis_fit == "first_page" else fit_bases
    for (k, v), pair in zip(groups, got):
        want = fit(k, v, solver)
        assert len(pair.k) == layers and pair.whole is not None
        assert torch.equal(pair.stacked(), want.stacked()), repro(seed)
