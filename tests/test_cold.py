"""Recompression of cold pages (`cold`, codec/cold.py, `MosaicKVPool.recompress_cold`): cheaper
bytes, an error against the original K/V within the cold budget, warm pages untouched, every
byte re-counted, nothing left after a free."""
from types import SimpleNamespace

import pytest
import torch

from conftest import repro
from mosaickv_sglang.codec.layer import relative_error
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.graph_decode import band_pairs
from mosaickv_sglang.serving.pool import MosaicKVPool

PS, H, D, LAYERS = 128, 2, 64, 2
COLD = {"enabled": True, "k_error_budget": 0.5, "v_error_budget": 0.5, "pages_per_step": 3}
CHUNK_RULE = {"read_rule": "chunk", "basis_fit": "group"}  # what cold recompression needs


def make_pool(**cold) -> MosaicKVPool:
    cfg = MosaicConfig(hot_tokens=0, cold={**COLD, **cold}, **CHUNK_RULE)
    return MosaicKVPool(24 * PS, PS, torch.bfloat16, H, D, LAYERS, "cpu", False,
                        mosaic_config=cfg)


def write(pool, first_page: int, pages: int, seed: int):
    """One request of `pages` full pages at logical pages first_page.., sealed; its K/V."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(first_page * PS, (first_page + pages) * PS)
    kv = []
    for layer in range(LAYERS):
        k = (torch.randn(len(slots), H, D, generator=g) * (1 + torch.arange(D) % 7)).bfloat16()
        v = torch.randn(len(slots), H, D, generator=g).bfloat16()
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), slots, k, v)
        kv.append((k.float(), v.float()))
    assert pool.seal_request(slots, len(slots)) == pages
    return slots, kv


def _bytes(pool) -> int:
    st = pool.stats()
    return sum(n for kind, n in st["bytes"].items() if kind != "hot_buffer_capacity")


@pytest.mark.parametrize("seed", [0, 1])
def test_cold_pages_shrink_within_budget_and_warm_pages_wait(seed):
    pool = make_pool()
    slots_a, kv_a = write(pool, 1, 4, seed)
    slots_b, _ = write(pool, 5, 4, seed + 100)
    warm = set(range(5, 9))  # request b is still running near these pages
    before = {p: pool.sealed[p].nbytes for p in pool.sealed}
    total = pool.arena_bytes
    n = pool.recompress_cold(warm) + pool.recompress_cold(warm)  # 3 pages a step
    assert n == 3, repro(seed)  # request a's pages past its sink page
    assert all(pool.sealed[p].nbytes < before[p] for p in range(2, 5)), repro(seed)
    # the sink pages (8-bit, cheaper candidates exist) and the warm pages are as they were
    assert all(pool.sealed[p].nbytes == before[p] for p in warm | {1, 5}), repro(seed)
    assert pool.recompress_cold(warm) == 0  # nothing cold left; b waits in the queue
    # every byte re-counted, the running totals equal the tensors
    assert pool.arena_bytes == _bytes(pool) < total
    assert pool.counters.cold_saved_bytes == total - pool.arena_bytes
    store = pool.store
    assert store.live_bytes == sum(size for _, size in store.blocks.values())
    assert (store.layer_live == [sum(n for (lyr, _), (_, n) in store.blocks.items()
                                     if lyr == layer) for layer in range(LAYERS)]).all()
    # what a read gets back is within the cold budget of the original K/V, page by page
    for layer in range(LAYERS):
        k_read, v_read = pool.dense_kv(layer, slots_a)
        k, v = kv_a[layer]
        for i in range(1, 4):
            rows = slice(i * PS, (i + 1) * PS)
            assert relative_error(k_read[rows].float(), k[rows]) <= 0.5 * 1.05, repro(seed)
            assert relative_error(v_read[rows].float(), v[rows]) <= 0.5 * 1.05, repro(seed)
    seg = pool.sealed[2].segments[0]
    assert seg.k.reason == "cold" and seg.k.error <= 0.5
    assert store.packed[:, 1:5].all() and not store.unreadable  # the kernel still reads them
    # b becomes cold once nothing is warm
    assert pool.recompress_cold(set()) == 3 and pool.recompress_cold(set()) == 0
    pool.release_pages(list(range(1, 9)))
    assert pool.arena_bytes == 0 and store.live_bytes == 0 and not pool.cold_done
    assert int(store.layer_live.sum()) == 0 and store.top == [0] * LAYERS


def test_a_zero_budget_keeps_every_page_and_counts_it():
    pool = make_pool(k_error_budget=0.0, v_error_budget=0.0)
    write(pool, 1, 3, 0)
    total = pool.arena_bytes
    assert pool.recompress_cold(set()) == 0
    assert pool.counters.cold_kept == 2 and pool.arena_bytes == total  # past the sink page


def test_cold_layouts_are_in_the_graphs_frozen_pairs_and_config_is_checked():
    cfg = MosaicConfig(cold={"enabled": True}, **CHUNK_RULE)
    pairs = band_pairs(cfg)
    assert (cfg.cold.k_candidates[0], cfg.cold.v_candidates[0]) in pairs
    assert (cfg.cold.k_candidates[0], cfg.v_candidates[0]) in pairs  # one kind recompressed
    with pytest.raises(ValueError, match="cold.k_candidates"):
        MosaicConfig(cold={"k_candidates": ["dense"]})
    with pytest.raises(ValueError, match="read_rule 'chunk'"):
        MosaicConfig(cold={"enabled": True}, read_rule="position", basis_fit="first_page")
    # the default is the position rule: the error names the preset that enables cold
    with pytest.raises(ValueError, match='"preset": "chunk_rule"'):
        MosaicConfig.from_dict({"cold": {"enabled": True}})
    assert MosaicConfig.from_dict({"preset": "chunk_rule", "cold": {"enabled": True}}).cold.enabled


def test_warm_pages_are_each_running_requests_last_tokens():
    """The step boundary's warm set: per running / just-prefilled / chunked request, the pages
    holding its last `after_tokens` KV tokens (page aligned), read from req_to_token."""
    from mosaickv_sglang.integration.wiring import _warm_pages

    table = torch.zeros(4, 2048, dtype=torch.int32)
    table[1] = torch.arange(10 * PS, 10 * PS + 2048)  # request in row 1: pages 10..25
    table[2] = torch.arange(40 * PS, 40 * PS + 2048)  # row 2: pages 40..
    table[3] = torch.arange(60 * PS, 60 * PS + 2048)

    def req(row, n):
        return SimpleNamespace(req_pool_idx=row, kv_committed_len=n)

    sched = SimpleNamespace(running_batch=SimpleNamespace(reqs=[req(1, 1000)]),
                            last_batch=SimpleNamespace(reqs=[req(2, 300)]),
                            chunked_req=req(3, 0),  # nothing written yet: nothing warm
                            req_to_token_pool=SimpleNamespace(req_to_token=table))
    # row 1: tokens 744..999 -> positions from 640 (page aligned): pages 15..17
    assert _warm_pages(sched, PS, 256) == {15, 16, 17, 40, 41, 42}
    sched.last_batch = None
    assert _warm_pages(sched, PS, 4096) == set(range(10, 18))
