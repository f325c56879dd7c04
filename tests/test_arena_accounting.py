"""The pool's running byte total (`arena_bytes`, what the byte gate's log line and the start-up
budget compare) is exactly what its tables hold: every sealed page's bytes plus the bytes of the
distinct bases they use, recomputed from `pool.sealed`, never from the counter; and once every
request is gone and the cache flushed, nothing is left (no byte, no sealed page, no hot page).

Driven at the pool level as a soak drives a server (`benchmarks/soak_bench.py` on the H100,
2026-12-07: arena_bytes grew past the start-up budget under `daemon: process`, read_rule
"chunk"): concurrent requests prefilled in chunks and decoded, short and long ones, prefixes
reused from a radix-like cache, twins prefilled side by side whose common prefix is then swapped
for the first one's pages (SGLang's `cache_unfinished_req`: `seal_prefix_now`, `rebase_blocks`
at the read), aborts while their pages are with the daemon, finished requests cached and evicted
later, backpressure from a small hot buffer, and (parametrized) cold recompression through the
workers. The invariant is checked after every step."""
from __future__ import annotations

import random
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from conftest import repro
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.pool import MosaicKVPool

PS, H, D, LAYERS = 128, 2, 64, 2
BLOCK = 4  # pages per basis block
PAGES = 80  # logical pages (page 0 is never handed out)
CHUNK = 3 * PS  # prefill chunk
CONTEXT = 24 * PS
# the GPU soak's rules: read_rule "chunk", basis_fit "group", a 64-token window, the daemon
CHUNK_RULE = dict(read_rule="chunk", basis_fit="group", hot_tokens=64)
COLD = {"enabled": True, "k_error_budget": 0.5, "v_error_budget": 0.5, "pages_per_step": 4,
        "after_tokens": PS}


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_pool(**cfg) -> MosaicKVPool:
    config = MosaicConfig(basis_block_tokens=BLOCK * PS, daemon="process", daemon_workers=1,
                          daemon_queue_segments=8, hot_buffer_fraction=0.3,
                          daemon_hot_watermark=0.15, daemon_boundary_share=0.0,
                          daemon_install_batch=2, basis_inherit_below_tokens=0,
                          **{**CHUNK_RULE, **cfg})
    return MosaicKVPool(PAGES * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=config)


def recounted(pool) -> int:
    """Bytes of the live sealed pages plus their distinct bases, from the pool's tables."""
    bases = {sp.bases.key(): sp.bases.nbytes() for sp in pool.sealed.values()}
    return sum(sp.nbytes for sp in pool.sealed.values()) + sum(bases.values())


def check(pool, owned: set[int], where) -> None:
    """arena_bytes is the tables' bytes; the bases' reference counts are the pages using them;
    no two bases keys share tensors (counted twice); every sealed or hot page is owned (by a
    running request or the cache: no leak); hot pages are mapped once each."""
    assert pool.arena_bytes == recounted(pool), where
    assert pool._basis_refs == dict(Counter(sp.bases.key() for sp in pool.sealed.values())), \
        where
    storages = {}
    for sp in pool.sealed.values():
        storages.setdefault(sp.bases.k[0].untyped_storage().data_ptr(), set()).add(
            sp.bases.key())
    assert all(len(keys) == 1 for keys in storages.values()), where
    assert set(pool.sealed) <= owned, (where, sorted(set(pool.sealed) - owned))
    hot = pool.hot_page_of[1:].numpy()
    mapped = [int(h) for h in hot if h > 0]
    assert len(set(mapped)) == len(mapped), where
    assert len(mapped) + len(pool.free_hot_pages) == pool.num_hot_pages, where
    assert {i + 1 for i, h in enumerate(hot) if h > 0} <= owned, where


class Sim:
    """Requests over a refcounted page allocator, as SGLang's scheduler and radix cache hold
    logical pages; K/V values per request (a twin's common prefix has its first's values)."""

    def __init__(self, pool, rng: random.Random, gen: torch.Generator):
        self.pool, self.rng, self.gen = pool, rng, gen
        self.free = list(range(PAGES - 1, 0, -1))
        self.refs: dict[int, int] = {}
        self.live: list[dict] = []
        self.cached: list[list[int]] = []  # finished requests' full pages (the "tree")
        self.counts = Counter()

    def owned(self) -> set[int]:
        return set(self.refs)

    def kv(self, like: dict | None = None, common: int = 0):
        k = torch.randn(LAYERS, CONTEXT, H, D, generator=self.gen) * (1 + torch.arange(D) % 7)
        v = torch.randn(LAYERS, CONTEXT, H, D, generator=self.gen)
        if like is not None:
            k[:, :common], v[:, :common] = like["k"][:, :common], like["v"][:, :common]
        return k, v

    def take(self) -> int:
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def unref(self, pages: list[int]) -> None:
        gone = []
        for page in pages:
            self.refs[page] -= 1
            if not self.refs[page]:
                del self.refs[page]
                gone.append(page)
        if gone:
            self.pool.release_pages(gone)  # the allocator's _release_page_ids
            self.free.extend(gone)

    def slots(self, req, end: int | None = None) -> torch.Tensor:
        end = req["tokens"] if end is None else end
        return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in req["pages"]])[:end]

    def admit(self) -> None:
        if len(self.live) >= 4 or len(self.free) < 30:
            return
        kind = self.rng.choice(["short", "short", "long", "shared", "twin", "abort"])
        prompt = self.rng.randint(64, 5 * PS) if kind in ("short", "abort", "twin") else \
            self.rng.randint(6 * PS, 14 * PS)
        output = 6 * PS if kind == "abort" else self.rng.randint(8, 2 * PS)
        req = {"kind": kind, "pages": [], "tokens": 0, "prompt": prompt, "end": prompt + output}
        req["k"], req["v"] = self.kv()
        if kind == "shared" and self.cached:  # a cached prefix matched (radix reuse)
            donor = self.rng.choice(self.cached)
            n = self.rng.randint(1, len(donor))
            req["pages"], req["tokens"] = list(donor[:n]), n * PS
            req["prompt"] = max(req["prompt"], req["tokens"] + 1)
            req["end"] = max(req["end"], req["prompt"] + 1)
            for page in req["pages"]:
                self.refs[page] += 1
            self.pool.count_reuse([p * PS for p in req["pages"]])
            self.counts["reused"] += 1
        self.live.append(req)
        if kind == "twin" and prompt > 2 * PS:  # a second request with a common prefix, in
            # the same prefill batch: its own copies are swapped for the first's after a chunk
            common = self.rng.randint(PS, min(prompt, CHUNK) - 1) // PS * PS
            twin = dict(req, kind="twin2", pages=[], tokens=0, twin_of=req, common=common)
            twin["k"], twin["v"] = self.kv(req, common)
            self.live.append(twin)

    def prefill_or_decode(self, step: int) -> None:
        pool = self.pool
        with pool.batched_seals():
            for req in list(self.live):
                start = req["tokens"]
                # a prefill chunk, else a decode step (a few tokens at once: shorter runs)
                end = min(start + CHUNK, req["prompt"]) if start < req["prompt"] else \
                    min(start + self.rng.choice([1, 8, 32]), req["end"])
                while len(req["pages"]) * PS < end:
                    req["pages"].append(self.take())
                slots = self.slots(req, end)
                for layer in range(LAYERS):
                    pool.set_kv_buffer(SimpleNamespace(layer_id=layer), slots[start:],
                                       req["k"][layer, start:end], req["v"][layer, start:end])
                req["tokens"] = end
                if start < req["prompt"]:  # a prefill forward's seals
                    pool.seal_request(slots, end)
                else:  # a decode step's (its tokens before this step's)
                    pool.seal_request_pages((slots[::PS] // PS).numpy(), end - 1,
                                            decode_step=True)
        for req in list(self.live):  # cache_unfinished_req: the twin reads the first's pages
            first = req.get("twin_of")
            if first is not None and any(r is first for r in self.live) \
                    and req["tokens"] >= req["common"] \
                    and first["tokens"] >= req["common"]:
                n = req["common"] // PS
                own = req["pages"][:n]
                req["pages"][:n] = first["pages"][:n]
                for page in first["pages"][:n]:
                    self.refs[page] += 1
                self.unref(own)
                del req["twin_of"]
                self.counts["swapped"] += 1

    def read(self) -> None:
        for req in self.live:  # the reference decode's read (repairs prefixes and blocks)
            self.pool.request_view(0, self.slots(req))

    def finish_or_abort(self) -> None:
        for req in list(self.live):
            if req["tokens"] >= req["end"]:  # finished: seal_finished, then into the cache
                self.pool.seal_finished(self.slots(req))
                full = req["tokens"] // PS
                self.unref(req["pages"][full:])
                if full:
                    self.cached.append(req["pages"][:full])
                self.drop(req)
                self.counts["finished"] += 1
            elif req["kind"] == "abort" and req["tokens"] > req["prompt"] \
                    and self.rng.random() < 0.2:
                self.unref(req["pages"])
                self.drop(req)
                self.counts["aborted"] += 1
        while self.cached and (len(self.free) < 30 or self.rng.random() < 0.1):
            self.unref(self.cached.pop(self.rng.randrange(len(self.cached))))  # evicted
            self.counts["evicted"] += 1

    def drop(self, req) -> None:
        self.live = [r for r in self.live if r is not req]

    def warm(self) -> set[int]:
        return {p for req in self.live for p in req["pages"][-2:]}


def wait_for_worker(pool) -> None:
    deadline = time.time() + 120
    while float(pool.daemon.channel.heartbeats[0]) <= pool.daemon.workers[0].spawned_at:
        assert time.time() < deadline
        time.sleep(0.1)


@pytest.mark.parametrize("cold", [False, True])
def test_arena_bytes_are_the_live_pages_and_their_bases(seed, cold):
    rng = random.Random(seed)
    pool = make_pool(**({"cold": COLD} if cold else {}))
    try:
        wait_for_worker(pool)
        sim = Sim(pool, rng, torch.Generator().manual_seed(seed))
        for step in range(200):
            sim.admit()
            sim.prefill_or_decode(step)
            check(pool, sim.owned(), (step, "after the forward", repro(seed)))
            sim.read()
            sim.finish_or_abort()
            pool.step_boundary()
            if cold and pool.cold_waiting():
                pool.recompress_cold(sim.warm())
            check(pool, sim.owned(), (step, "after the boundary", repro(seed)))
            time.sleep(0.01)
        st = pool.stats()  # the soak's "bytes exact": the counter vs every kept tensor
        assert st["arena_bytes"] == sum(n for kind, n in st["bytes"].items()
                                        if kind != "hot_buffer_capacity"), repro(seed)
        for req in list(sim.live):
            sim.unref(req["pages"])
        sim.live.clear()
        while sim.cached:
            sim.unref(sim.cached.pop())
        deadline = time.time() + 120
        while pool.pending or pool.daemon.open_jobs():
            pool.step_boundary()
            assert time.time() < deadline
            time.sleep(0.02)
        check(pool, set(), ("drained", repro(seed)))
        assert pool.arena_bytes == 0 and not pool.sealed and not pool._basis_refs, repro(seed)
        assert len(pool.free_hot_pages) == pool.num_hot_pages, repro(seed)
        assert pool.store.live_bytes == 0, repro(seed)
        # the workload did what it is about
        c = sim.counts
        assert c["finished"] and c["reused"] and c["swapped"] and c["evicted"], c
        assert pool.daemon.counters.adopted_pages > 0, pool.daemon.counters
    finally:
        pool.daemon.close()


def _planned_pool(pages: int) -> MosaicKVPool:
    """A pool sized by the start-up plan (`memory_bytes`) for `pages` slots at the smallest
    layout plus an 8-page hot buffer, chunk rule, daemon off: one-page requests take its bases
    past their reserve."""
    from mosaickv_sglang.serving.sizing import PageBytes, slot_fraction

    cfg = MosaicConfig(basis_block_tokens=BLOCK * PS, daemon="off", **CHUNK_RULE)
    pb = PageBytes.of(cfg, H, D, 4)
    memory = int(pages * slot_fraction(cfg, pb) * pb.dense * LAYERS) + 9 * pb.dense * LAYERS
    return MosaicKVPool(pages * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=cfg, hot_tokens=8 * PS, memory_bytes=memory)


def test_bases_past_their_reserve_are_what_the_over_budget_warning_names(seed, caplog):
    """What took the H100 soak's packed bytes past the start-up budget with no dense fallback:
    short requests each hold a whole bases pair for a page or two, while the sizing reserves
    one pair per basis_block_tokens of sealed tokens. Every byte is a live page's or a live
    bases' (recounted), the pages' own bytes stay within the arena's share (nothing outside
    it), and the warning and `capacity()["bases"]` say that the bases are over their reserve
    (the warning said "dense fallbacks")."""
    pages = 64
    pool = _planned_pool(pages)
    g = torch.Generator().manual_seed(seed)
    caplog.set_level("WARNING", logger="mosaickv_sglang.serving.pool")
    page = 0
    while pool.arena_bytes <= pool.arena_budget_bytes:  # one-page requests, finished, cached
        page += 1
        assert page < pages, (pool.arena_bytes, pool.arena_budget_bytes, repro(seed))
        slots = torch.arange(page * PS, (page + 1) * PS)
        for layer in range(LAYERS):
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), slots,
                               torch.randn(PS, H, D, generator=g) * (1 + torch.arange(D) % 7),
                               torch.randn(PS, H, D, generator=g))
        pool.seal_finished(slots)
        check(pool, set(range(1, page + 1)), (page, repro(seed)))
    warned = [r.getMessage() for r in caplog.records if "start-up sizing" in r.getMessage()]
    assert len(warned) == 1 and pool.counters.arena_over_budget == 1, warned
    assert f"the {page} distinct bases" in warned[0] and "dense fallbacks" not in warned[0], \
        warned[0]
    bases = pool.capacity()["bases"]
    assert bases["bytes"] == pool.bases_bytes == pool.arena_bytes - sum(
        sp.nbytes for sp in pool.sealed.values())
    assert bases["count"] == len(pool.sealed) == page, (bases, repro(seed))
    # the summary line names them too
    assert f"bases {page} ({pool.bases_bytes / 1e6:.1f}/" in pool.summary(), pool.summary()
    assert bases["bytes"] > bases["reserve_bytes"] == pool.memory_plan.bases_bytes, bases
    assert pool.arena_bytes - bases["bytes"] <= pool.arena_budget_bytes - bases["reserve_bytes"]
    assert pool.capacity()["outside_bytes"] == 0 and pool.counters.over_budget == 0
    pool.release_pages(list(range(1, page + 1)))
    assert pool.arena_bytes == pool.bases_bytes == 0 and not pool._basis_refs


def test_the_byte_gate_takes_bases_past_their_reserve_from_the_arena(seed):
    """Bases past their reserve are memory the start-up plan gave the arena: the byte gate backs
    fewer free slots by them (before, nothing limited them: 4.3 GB past the plan in the H100
    soak of 2026-12-07, an OOM at a high --mem-fraction-static)."""
    from mosaickv_sglang.serving.sizing import byte_deficit

    pages = 64
    pool = _planned_pool(pages)
    g = torch.Generator().manual_seed(seed)
    page = 0
    while pool.bases_over_reserve() < 4 * pool.store.allocators[0].unit * LAYERS:
        page += 1  # one-page requests, finished, cached: a whole bases pair each
        assert page < pages - 4, (pool.bases_bytes, pool.bases_reserve_bytes, repro(seed))
        slots = torch.arange(page * PS, (page + 1) * PS)
        for layer in range(LAYERS):
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), slots,
                               torch.randn(PS, H, D, generator=g), torch.randn(PS, H, D, generator=g))
        pool.seal_finished(slots)
    free = pool.logical_size - (page + 1) * PS
    excess = pool.bases_over_reserve()
    assert excess == pool.bases_bytes - pool.bases_reserve_bytes > 0
    unsealed = 1  # the padding page's slot: allocated, never sealed
    gated = pool.refresh_byte_gate(free)
    assert gated == byte_deficit(free, unsealed, pool.store.page_fits(excess), PS), repro(seed)
    # the arena alone would back more: the excess costs at least the pages its bytes hold
    assert gated > byte_deficit(free, unsealed, pool.store.page_fits(), PS), (gated, repro(seed))
    pool.release_pages(list(range(1, page + 1)))
    assert pool.bases_over_reserve() == 0
    # (the same free slots: the released pages' slots count as allocated and unsealed)
    assert pool.refresh_byte_gate(free) == byte_deficit(free, page + 1, pool.store.page_fits(),
                                                        PS)
