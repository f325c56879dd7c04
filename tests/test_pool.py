"""MosaicKVPool without a server: logical pages -> hot rows -> sealed segments, reads that match
the dense data, byte accounting kept incrementally, frees and clear."""
from types import SimpleNamespace

import pytest
import torch

from conftest import repro
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.pool import MosaicKVPool

PS, H, D, LAYERS = 128, 2, 64, 2


def make_pool(**cfg) -> MosaicKVPool:
    config = MosaicConfig(hot_tokens=0, **cfg)
    return MosaicKVPool(16 * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=config)


def write(pool, slots, seed):
    g = torch.Generator().manual_seed(seed)
    kv = []
    for layer_id in range(LAYERS):
        k = torch.randn(len(slots), H, D, generator=g)
        v = torch.randn(len(slots), H, D, generator=g)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots, k, v)
        kv.append((k, v))
    return kv


def test_lossless_pool_roundtrip_seal_free_and_accounting():
    pool = make_pool(k_candidates=["dense:val=fp32"], v_candidates=["dense:val=fp32"],
                     sink_candidates=[], select={"enabled": False})
    slots = torch.arange(PS, 4 * PS + 40)  # pages 1..4 (page 0 is padding), partly filled last
    kv = write(pool, slots, seed=0)
    assert pool.seal_request(slots, len(slots)) == 3  # three full pages; the partial one stays hot
    for layer_id, (k, v) in enumerate(kv):
        keys, values = pool.dense_kv(layer_id, slots)
        assert torch.equal(keys, k) and torch.equal(values, v)  # exact through the sealed pages
        pages, hot_k, _, hot_start = pool.request_view(layer_id, slots)
        assert pages == [1, 2, 3] and hot_start == 3 * PS and hot_k.shape[1] == 40
    st = pool.stats()
    kept = sum(n for kind, n in st["bytes"].items() if kind != "hot_buffer_capacity")
    assert st["arena_bytes"] == kept > 0 and st["sealed_pages"] == 3
    assert pool.seal_request(slots, len(slots)) == 0  # sealed pages are not compressed twice
    pool.release_pages([1, 2, 3, 4])
    assert pool.stats()["sealed_pages"] == 0 and pool.arena_bytes == 0
    assert len(pool.free_hot_pages) == pool.num_hot_pages


def test_default_config_compresses_and_never_writes_into_sealed_pages():
    pool = make_pool(sink_segments=0)  # every page through the K/V candidates (bands)
    slots = torch.arange(PS, 3 * PS)
    write(pool, slots, seed=1)
    pool.seal_request(slots, len(slots))
    st = pool.stats()
    assert st["sealed_pages"] == 2
    # codes + scales well under a third of bf16 (with only 2 pages the bases dominate the rest)
    dense = st["sealed_tokens"] * st["dense_bytes_per_token"]
    assert 3 * (st["bytes"]["values"] + st["bytes"]["scales"]) < dense
    assert any(key.startswith("k:band") for key in st["counters"]["strategies"])
    with pytest.raises(RuntimeError, match="sealed"):
        write(pool, slots[:4], seed=2)
    pool.clear()
    assert pool.stats()["sealed_pages"] == 0 and pool.arena_bytes == 0


def test_config_that_does_not_fit_the_head_dim_is_refused():
    with pytest.raises(ValueError, match="does not fit this model"):
        MosaicKVPool(16 * PS, PS, torch.float32, H, 16, LAYERS, "cpu", False,
                     mosaic_config=MosaicConfig())


def test_seal_and_reuse_counts_by_position():
    """A shared 2-page prefix sealed once and handed to two requests: one seal and two reuses
    per prefix position; a second request's own page adds a seal at its position only."""
    pool = make_pool(k_candidates=["dense:val=fp32"], v_candidates=["dense:val=fp32"],
                     sink_candidates=[], select={"enabled": False})
    prefix = torch.arange(PS, 3 * PS)  # logical pages 1, 2
    write(pool, prefix, seed=3)
    pool.seal_request(prefix, len(prefix))
    mine = torch.cat([prefix, torch.arange(5 * PS, 6 * PS)])  # + page 5 at position 2
    write(pool, mine[2 * PS:], seed=4)
    assert pool.count_reuse(prefix[::PS].tolist()) == 2
    pool.seal_request(mine, len(mine))
    hot = torch.arange(7 * PS, 8 * PS)  # a matched page that is still hot is not a reuse
    write(pool, hot, seed=5)
    assert pool.count_reuse(mine[::PS].tolist() + [int(hot[0])]) == 3
    counters = pool.stats()["counters"]
    assert counters["sealed_by_position"] == [1, 1, 1]
    assert counters["reused_by_position"] == [2, 2, 1]
    assert counters["reused_pages"] == 5 and counters["sealed_pages"] == 3


def test_a_hot_buffer_smaller_than_one_prefill_chunk_is_refused_at_start_up():
    from mosaickv_sglang.serving.pool import hot_buffer_requests
    assert hot_buffer_requests(8192, 128, 8192, 131072, 0.05) == 1  # one chunk, nothing beside
    with pytest.raises(ValueError, match=r"hot_buffer_fraction.*--chunked-prefill-size 8192"):
        hot_buffer_requests(8064, 128, 8192, 131072, 0.05)
    # a chunk is at most context - 1 prompt tokens, in whole pages
    assert hot_buffer_requests(8192, 128, 16384, 8192, 0.25) == 1
    # chunking off (None or -1): the whole context is one prefill
    for off in (None, -1):
        with pytest.raises(ValueError, match="raise hot_buffer_fraction to >= 0.800"):
            hot_buffer_requests(4096, 128, off, 5121, 0.64)
    assert hot_buffer_requests(4096, 128, -1, 4097, 0.5) == 1
    # every page beyond the chunk carries one more running request's last page
    assert hot_buffer_requests(24960, 128, 8192, 131072, 0.05) == 195 - 64 + 1
    # the read rule's window keeps ceil(window / page) more pages hot per request, chunk included
    assert hot_buffer_requests(1024, 128, 512, 2048, 0.25, window_tokens=128) == 2
    assert hot_buffer_requests(1024, 128, 512, 2048, 0.25, window_tokens=0) == 5


def test_running_requests_are_capped_to_what_the_hot_buffer_carries(caplog):
    """The H200 crash of 2026-11-30 (32768-token chunk, 32768-token buffer, 3 requests: the third
    prefill found the buffer full) is a start-up error now; a derived limit is lowered, logged."""
    from mosaickv_sglang.serving.pool import cap_running_requests, hot_buffer_requests
    fit = hot_buffer_requests(32768, 128, 32768, 33792, 0.25)
    assert fit == 1
    with pytest.raises(ValueError, match=r"--max-running-requests 3 does not fit.*<= 1"):
        cap_running_requests(fit, 3, 3, 128, 0.25)
    assert cap_running_requests(132, 15, 15, 128, 0.05) == 15  # fits: unchanged
    assert cap_running_requests(132, 2048, None, 128, 0.05) == 132
    assert "lowered from 2048 to 132" in caplog.text


def test_the_configure_hook_hands_the_cap_to_the_scheduler():
    """`_cap_running_requests` (AFTER KVCacheConfigurator.configure) returns SGLang's result
    with the scheduler's max running requests lowered, in the result and the pool config."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigResult

    from mosaickv_sglang.config import MosaicConfig
    from mosaickv_sglang.serving.pool import MosaicKVPool
    from mosaickv_sglang.integration.wiring import _cap_running_requests

    pool = object.__new__(MosaicKVPool)
    pool.running_requests_fit, pool.page_size, pool.cfg = 132, 128, MosaicConfig()
    mem = SimpleNamespace(max_running_requests=2048)

    def result(kv_pool):
        return KVCacheConfigResult(
            max_total_num_tokens=499968, max_running_requests=2048,
            full_max_total_num_tokens=None, swa_max_total_num_tokens=None,
            req_to_token_pool=None, token_to_kv_pool=kv_pool, token_to_kv_pool_allocator=None,
            memory_pool_config=mem)
    configurator = SimpleNamespace(server_args=SimpleNamespace(max_running_requests=None))
    got = _cap_running_requests(result(pool), configurator, pre_model_load_memory=0)
    assert got.max_running_requests == 132 and mem.max_running_requests == 132
    other = result(object())  # not a MosaicKV pool: untouched
    assert _cap_running_requests(other, configurator, pre_model_load_memory=0) is other




def test_reference_decode_reads_are_counted_in_stats(seed):
    """The torch reference's page reads (the CPU server's decode path) reach the server stats:
    with a budget below the context, selection reads fewer pages than it could."""
    from mosaickv_sglang.codec.attention import decode_attention

    pool = make_pool(select={"enabled": True, "budget_tokens": 128, "sink_tokens": 32,
                             "recent_tokens": 32}, hot_buffer_fraction=0.5)
    slots = torch.arange(PS, 9 * PS)
    write(pool, slots, seed)
    pool.seal_request(slots, len(slots))
    assert pool.stats()["decode"]["selection_reference"]["pages_available"] == 0
    view = pool.layer_view(0, slots)
    q = torch.randn(1, 2 * H, D)
    _, info = decode_attention(q, view, torch.tensor([len(slots) - 1]), pool.cfg.select,
                               pool.cfg.page_tokens)
    pool.reference_reads.add(info)
    st = pool.stats()["decode"]["selection_reference"]
    assert st["pages_available"] == info.pages_total > st["pages_read"] == info.pages_read > 0
    assert st["read_fraction"] == info.pages_read / info.pages_total < 1


def test_graph_write_mapping_equals_the_eager_one_and_the_device_table_follows(seed):
    """`map_write_pages` (the decode graph's: pages from the host) takes the same hot pages as
    `prepare_writes` (from the slots), and the device hot-page table, refreshed by the span
    that changed, equals the host table after each step (a CUDA pool's separate copy, stood in
    for here by a second tensor)."""
    import numpy as np

    a, b = make_pool(), make_pool()
    b.hot_page_dev = b.hot_page_of.clone()  # as on CUDA: a separate table, refreshed by spans
    b._hot_uploaded = b.hot_page_of.numpy().copy()
    gen = torch.Generator().manual_seed(seed)
    for step in range(6):
        slots = torch.randperm(3 * PS, generator=gen)[:2] + PS  # pages 1..3 (4 hot pages)
        a.prepare_writes(slots)
        b.map_write_pages((slots // PS).numpy().astype(np.int64))
        assert torch.equal(a.hot_page_of, b.hot_page_of), (step, repro(seed))
        assert torch.equal(b.hot_page_dev, b.hot_page_of), (step, repro(seed))
        if step == 3:  # a page back to the free list, then taken again
            page = int((slots[0] // PS))
            for pool in (a, b):
                pool.free_hot_pages.append(int(pool.hot_page_of[page]))
                pool.hot_page_of[page] = -1
    c = make_pool()  # a sealed page is never written again
    write(c, torch.arange(PS, 2 * PS), seed)
    c.seal_request(torch.arange(PS, 2 * PS), PS)
    assert 1 in c.sealed and int(c.hot_page_of[1]) < 0
    with pytest.raises(RuntimeError, match="sealed"):
        c.map_write_pages(np.array([1]))


def test_write_by_table_maps_at_each_forwards_first_layer(seed):
    """`write_by_table` (the decode graph's write) maps its slots through the device hot-page
    table once per forward, at the first layer, and the other layers reuse it: a slot tensor
    changed in place between forwards (a graph's static buffer) is mapped again at the next
    first layer, and every layer's K/V lands in the row `physical_loc` gives."""
    import numpy as np

    pool = make_pool()
    gen = torch.Generator().manual_seed(seed)
    loc = torch.zeros(3, dtype=torch.long)  # one tensor for every forward, as a graph's
    for step in range(4):
        loc.copy_(torch.randperm(3 * PS, generator=gen)[:3] + PS)
        pool.map_write_pages((loc // PS).numpy().astype(np.int64))
        want = pool.physical_loc(loc)
        for layer_id in range(LAYERS):
            k = torch.randn(3, H, D, generator=gen)
            v = torch.randn(3, H, D, generator=gen)
            pool.write_by_table(SimpleNamespace(layer_id=layer_id), loc, k, v)
            assert torch.equal(pool.k_buffer[layer_id][want], k), (step, layer_id, repro(seed))
            assert torch.equal(pool.v_buffer[layer_id][want], v), (step, layer_id, repro(seed))
