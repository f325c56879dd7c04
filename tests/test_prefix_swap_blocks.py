"""A request's compressed pages, grouped by basis, are its position blocks (`basis_block_tokens`
each): what the decode graph's rows are (`GraphDecode.prepare` refuses anything else, and the
device-built tables take each row's bases from its first page). Seen broken on an H100 serving
RULER prompts (long common prefixes): SGLang prefills two requests with a common prefix in one
batch, each seals its own pages, then `cache_unfinished_req` swaps the second's prefix pages for
the radix tree's copies (the first's). Where the common prefix ends inside a basis block, that
block held the first request's pages on its bases, then the second's own on the bases it fitted
on its own (freed) first page: two runs in one block, and the decode graph's prepare raised. A
third request matching that tree path holds the same block. The pool now moves such pages to
their block's bases where they are read (`rebase_blocks`: re-pointed when the bases hold the same
values, else re-sealed), counted.

Driven at the pool level as the backend drives it (a prefill: `plan_chunk_seal` and its layers,
then `seal_request` per request in one `batched_seals`; a decode step: `seal_request_pages(...,
decode_step=True)` per request in one `batched_seals`, the token written, the graph's tables
prepared), on a bf16 CPU pool, under the read rule and basis fit of the failing server and under
the defaults (chunk rule, basis_fit "group"): the runs at every step, then the last step's
tables against the pool's own reference read (the codec, per-page bases) through the kernels'
torch oracle, and (chunk rule) against the tables built on the device. Plain radix
reuse (a prefix matched, not swapped: ending inside a block, at a block boundary, past a block;
the owner still running; two requests reusing it in one prefill batch) keeps the invariant with
nothing moved."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import repro
from mosaickv_sglang.codec.attention import decode_attention
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.packed_decode import _sealed_runs

PS, H, HQ, D, LAYERS = 128, 2, 4, 64, 2
BLOCK = 4  # pages per basis block
CONTEXT = 16 * PS
SELECT = {"budget_tokens": 256, "sink_tokens": 32, "recent_tokens": 64}
CONFIGS = {
    # the failing server's (RULER, decode graph on)
    "position-first_page": dict(read_rule="position", basis_fit="first_page", hot_tokens=0,
                                k_error_budget=0.12, v_error_budget=0.2,
                                select={**SELECT, "enabled": True, "rescore_factor": 4,
                                        "rescore_channels": 32}),
    "chunk-group": dict(hot_tokens=PS, select=SELECT),  # the defaults' rules
}


def make_pool(cfg: dict):
    from mosaickv_sglang.serving.pool import MosaicKVPool

    config = MosaicConfig(basis_block_tokens=BLOCK * PS, decode_kernel="triton",
                          sink_candidates=["band:b8=64,b4=0,b2=0,group=32"], **cfg)
    return MosaicKVPool(96 * PS, PS, torch.bfloat16, H, D, LAYERS, "cpu", False,
                        mosaic_config=config)


class Requests:
    """Requests' K/V (one tensor per request for its whole length, so a token written at any
    step has its values) and their req_to_token rows (row 0: SGLang's padding row)."""

    def __init__(self, pool, gen, rows: int = 6):
        self.pool, self.gen = pool, gen
        self.req_to_token = torch.zeros(rows, CONTEXT, dtype=torch.int32)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lens: dict[int, int] = {}

    def new(self, rid: int, first_page: int, like: int | None = None, common: int = 0,
            noise: float = 0.0) -> torch.Tensor:
        """Request `rid` on its own pages from `first_page` on; its first `common` tokens are
        those of request `like` (the same K/V, plus `noise`: computed in another batch)."""
        k = torch.randn(LAYERS, CONTEXT, H, D, generator=self.gen) * (1 + torch.arange(D) % 7)
        v = torch.randn(LAYERS, CONTEXT, H, D, generator=self.gen)
        if like is not None:
            for mine, theirs in zip((k, v), self.kv[like]):
                mine[:, :common] = theirs[:, :common] + noise * torch.randn(
                    LAYERS, common, H, D, generator=self.gen)
        self.kv[rid] = (k, v)
        self.req_to_token[rid] = torch.arange(first_page * PS, first_page * PS + CONTEXT)
        return self.req_to_token[rid]

    def write(self, rid: int, first: int, end: int) -> None:
        slots = self.req_to_token[rid, first:end].long()
        k, v = self.kv[rid]
        for layer_id in range(LAYERS):
            self.pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots,
                                    k[layer_id, first:end].bfloat16(),
                                    v[layer_id, first:end].bfloat16())

    def pages(self, rid: int, n: int | None = None):
        n = self.lens[rid] if n is None else n
        return (self.req_to_token[rid, :n:PS] // PS).long()

    def prefill(self, batch: list[tuple[int, int, int]]) -> None:
        """One prefill forward of (rid, first new position, end) requests, as the backend runs
        it: the K/V written, the pages its tokens read compressed sealed layer by layer
        (position rule), then each request's sealable pages in one `batched_seals`."""
        pool = self.pool
        for rid, first, end in batch:
            self.write(rid, first, end)
            self.lens[rid] = end
        cs = pool.plan_chunk_seal([(self.pages(rid, end).tolist(), end - 1, None)
                                   for rid, _, end in batch])
        if cs is not None:
            for local in range(LAYERS):
                pool.seal_chunk_layer(cs, local)
            pool.finish_chunk_seal(cs)
        with pool.batched_seals():
            for rid, _, end in batch:
                pool.seal_request(self.req_to_token[rid, :end].long(), end, None)

    def swap(self, rid: int, tree_row: torch.Tensor, n_pages: int) -> None:
        """SGLang's cache_unfinished_req for `rid`: its first `n_pages` pages duplicate the radix
        tree's (`tree_row`), so they are freed and its row points at the tree's."""
        self.pool.release_pages(self.pages(rid, n_pages * PS).tolist())
        self.req_to_token[rid, :n_pages * PS] = tree_row[:n_pages * PS]

    def decode_step(self, graph, rids: list[int]) -> None:
        """One decode step of `rids` as the backend's host work runs it before a graph replay:
        seal (every request in one `batched_seals`), the step's token written, the tables."""
        pool = self.pool
        for rid in rids:
            self.lens[rid] += 1
        with pool.batched_seals():
            for rid in rids:
                pool.seal_request_pages(self.pages(rid).numpy(), self.lens[rid] - 1,
                                        decode_step=True)
        for rid in rids:
            self.write(rid, self.lens[rid] - 1, self.lens[rid])
        lens = torch.tensor([self.lens[r] for r in rids])
        fb = SimpleNamespace(batch_size=len(rids), req_pool_indices=torch.tensor(rids),
                             seq_lens=lens, seq_lens_cpu=lens)
        graph.bucket_for(len(rids))
        graph.prepare(fb, self.req_to_token, len(rids))


def position_blocks(pool, req, rid) -> list[int]:
    """The sizes of `rid`'s runs of compressed pages sharing a basis, or [] when they are its
    position blocks (what `GraphDecode.prepare` checks)."""
    n, runs, _ = _sealed_runs(pool, req.pages(rid).numpy(), req.lens[rid])
    sizes = [len(r) for r in runs]
    return [] if sizes == [min(BLOCK, n - j) for j in range(0, n, BLOCK)] else sizes


def check_reads(graph, pool, req, rids, gen, seed, why) -> None:
    """The step's graph tables (rows: each one's pages and bases address) read what the pool's
    reference read gives (the codec with each page's own bases), for every request, every layer,
    through the kernels' torch oracle (no selection: every page)."""
    from mosaickv_kernels.request_decode import request_decode_reference

    bk = graph.bucket
    by_ptr = {t.data_ptr(): t for t in bk.keep}
    wholes = [by_ptr.get(p) for p in bk.basis_ptrs.tolist()]
    q = torch.randn(len(rids), HQ, D, generator=gen).bfloat16()
    for local in range(LAYERS):
        got = request_decode_reference(q, graph.tables(bk, local), wholes, local, LAYERS,
                                       graph.width, graph.row_pages, graph.pps, D ** -0.5)
        for b, rid in enumerate(rids):
            view = pool.layer_view(local, req.req_to_token[rid, :req.lens[rid]].long())
            want, _ = decode_attention(q[b:b + 1].float(), view,
                                       torch.tensor([req.lens[rid] - 1]), None, 32,
                                       sm_scale=D ** -0.5)
            err = float((got[b] - want[0]).norm() / want[0].norm())
            assert err < 2e-3, (why, rid, local, err, repro(seed))
    if not pool.position_rule:  # the chunk rule's tables built on the device (each row's bases
        # from its first page's address) equal the host's
        from mosaickv_sglang.serving.graph_decode import DevicePageTable

        lens = torch.tensor([req.lens[r] for r in rids])
        dev = graph.device_tables(bk, torch.tensor(rids), lens, req.req_to_token, len(rids),
                                  DevicePageTable.of(pool))
        end = int(bk.seg_indptr[-1])
        assert dev["seg_indptr"].equal(bk.seg_indptr), (why, repro(seed))
        assert dev["seg_ids"][:end].equal(bk.seg_ids[:end]), (why, repro(seed))
        assert dev["basis_ptrs"].equal(bk.basis_ptrs), (why, repro(seed))


def _graph(pool):
    from mosaickv_sglang.serving.graph_decode import GraphDecode

    return GraphDecode(pool, CONTEXT, None)


@pytest.mark.parametrize("common", [2, 4, 6], ids=["inside-block0", "at-block", "inside-block1"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_prefix_swapped_inside_a_block_reads_as_position_blocks(config, common, seed):
    """A and B (a common prefix of `common` pages, B's copy computed apart: slightly other
    values) prefilled in one batch; B's copies swapped for A's; C then matches the tree path
    (A's pages, then B's) and prefills its own; all three decode across page boundaries with
    the graph's tables prepared each step. Every request's runs are its position blocks, the
    tables read what the reference reads, and A's pages (never swapped) keep their bytes."""
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(CONFIGS[config])
    graph, req = _graph(pool), Requests(pool, gen)
    a = req.new(1, 1)
    b = req.new(2, 20, like=1, common=common * PS, noise=1e-2)
    req.prefill([(1, 0, 10 * PS + 50), (2, 0, 11 * PS + 70)])
    before = {p: pool.sealed[p] for p in req.pages(1).tolist() if p in pool.sealed}
    req.swap(2, a, common)
    assert req.req_to_token[2, :common * PS].equal(a[:common * PS])
    # C: B's tokens to a page past the common prefix, from the tree (A's pages, then B's), and
    # its own pages on (inside the same block unless the common prefix ends at a block end)
    matched = (common + 1) * PS
    c = req.new(3, 40, like=2, common=matched)
    c[:matched] = req.req_to_token[2, :matched]
    req.prefill([(3, matched, matched + 2 * PS + 30)])
    rids = [1, 2, 3]
    for step in range(PS + 8):
        req.decode_step(graph, rids)  # raised: "sealed pages are not in position blocks"
        for rid in rids:
            assert not position_blocks(pool, req, rid), (step, rid, repro(seed))
    check_reads(graph, pool, req, rids, gen, seed, "after the steps")
    moved = pool.counters.basis_aliased_pages + pool.counters.basis_resealed_pages
    if common % BLOCK:  # B's own pages after the common prefix, to the end of its block
        assert pool.counters.basis_rebases >= 1 and moved == BLOCK - common % BLOCK, \
            (pool.counters, repro(seed))
    else:
        assert pool.counters.basis_rebases == moved == 0, (pool.counters, repro(seed))
    # A's pages are A's: none of them was touched (entries, bases, bytes)
    assert all(pool.sealed[p] is sp for p, sp in before.items()), repro(seed)


def test_equal_bases_are_shared_without_resealing(seed):
    """B's copy of the common prefix holds exactly A's values (the same tokens computed alike):
    under basis_fit "first_page" its block's bases, fitted on its copy of the block's first
    page, equal A's. Its own pages in that block are re-pointed at A's bases, their segments
    (bytes) unchanged."""
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(CONFIGS["position-first_page"])
    graph, req = _graph(pool), Requests(pool, gen)
    common = 6
    a = req.new(1, 1)
    req.new(2, 20, like=1, common=common * PS)
    req.prefill([(1, 0, 10 * PS + 50), (2, 0, 11 * PS + 70)])
    own = req.pages(2).tolist()[common:BLOCK * 2]  # B's own pages in the common prefix's block
    segments = {p: pool.sealed[p].segments for p in own}
    req.swap(2, a, common)
    req.decode_step(graph, [1, 2])
    assert not position_blocks(pool, req, 2), repro(seed)
    c = pool.counters
    assert (c.basis_rebases, c.basis_aliased_pages, c.basis_resealed_pages) == (1, 2, 0), \
        (c, repro(seed))
    first = int(req.pages(2)[BLOCK])
    for p in own:
        assert pool.sealed[p].bases is pool.sealed[first].bases, repro(seed)
        assert pool.sealed[p].segments is segments[p], repro(seed)
    check_reads(graph, pool, req, [1, 2], gen, seed, "aliased")


@pytest.mark.parametrize("shared", [2, 4, 6], ids=["inside-block0", "at-block", "past-block"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_matched_prefix_keeps_position_blocks(config, shared, seed):
    """SGLang's plain radix reuse: B and C match A's first `shared` pages while A still runs
    (the tree's logical pages in their rows) and prefill their own in one batch; all three
    decode with the graph's tables. Nothing is mixed, so nothing is moved."""
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(CONFIGS[config])
    graph, req = _graph(pool), Requests(pool, gen)
    a = req.new(1, 1)
    req.prefill([(1, 0, 10 * PS + 50)])
    req.decode_step(graph, [1])
    for rid, first_page, end in ((2, 20, 11 * PS + 70), (3, 40, 7 * PS + 3)):
        row = req.new(rid, first_page, like=1, common=shared * PS)
        row[:shared * PS] = a[:shared * PS]
    req.prefill([(2, shared * PS, 11 * PS + 70), (3, shared * PS, 7 * PS + 3)])
    rids = [1, 2, 3]
    for step in range(PS + 8):
        req.decode_step(graph, rids)
        for rid in rids:
            assert not position_blocks(pool, req, rid), (step, rid, repro(seed))
    check_reads(graph, pool, req, rids, gen, seed, "reuse")
    assert pool.counters.basis_rebases == 0, (pool.counters, repro(seed))
