"""The server's batched kernel decode (PackedDecode over the pool's SegmentStore) against the
torch reference per request: several requests, a request spanning two basis blocks, page
selection active, and a request with an unpacked (dense) segment routed to the reference."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from conftest import LaunchRecorder, repro
from mosaickv_sglang.codec.attention import PageReads, decode_attention
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.packed_decode import PackedDecode
from mosaickv_sglang.serving.pool import MosaicKVPool

PS, H, HQ, D, LAYERS = 128, 2, 4, 64, 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)


def make_pool(**cfg) -> MosaicKVPool:
    base = dict(hot_tokens=0, basis_block_tokens=256,
                sink_candidates=["band:b8=64,b4=0,b2=0,group=32"],
                select={"budget_tokens": 256, "sink_tokens": 32, "recent_tokens": 64})
    base.update(cfg)
    return MosaicKVPool(40 * PS, PS, torch.bfloat16, H, D, LAYERS, DEVICE, False,
                        mosaic_config=MosaicConfig(**base))


def fill(pool, req_to_token, rid, first_page, n_tokens, gen):
    slots = torch.arange(first_page * PS, first_page * PS + n_tokens, device=DEVICE)
    req_to_token[rid, :n_tokens] = slots
    for layer_id in range(LAYERS):
        k = (torch.randn(n_tokens, H, D, generator=gen) * (1 + torch.arange(D) % 7)).to(DEVICE)
        v = torch.randn(n_tokens, H, D, generator=gen).to(DEVICE)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots, k.bfloat16(), v.bfloat16())
    pool.seal_request(slots, n_tokens)
    return slots


def reference(pool, q, slots, layer):
    view = pool.layer_view(layer.layer_id, slots)
    out, _ = decode_attention(q[None].float(), view, torch.tensor([len(slots) - 1]),
                              pool.cfg.select, pool.cfg.page_tokens, sm_scale=layer.scaling)
    return out[0]


# the second selection stage (page_rescore): 16 candidates for the 8-page budget, scored on
# 32 leading channels of their compressed K, or on every channel; {}: the bound alone. Each
# case states both keys (the default, since 2026-12-07, is factor 4 on 32 channels)
NO_RESCORE = {"rescore_factor": 0, "rescore_channels": 0}
RESCORE = [{}, {"rescore_factor": 2, "rescore_channels": 32},
           {"rescore_factor": 2, "rescore_channels": 0}]


@pytest.mark.parametrize("lengths,rescore", [((700, 90, 300), {}), ((129,), {}),
                                             *(((700, 90, 300), r) for r in RESCORE[1:])])
def test_packed_decode_matches_reference(lengths, rescore, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(select={"budget_tokens": 256, "sink_tokens": 32, "recent_tokens": 64,
                             **NO_RESCORE, **rescore})
    req_to_token = torch.zeros(len(lengths), 1024, dtype=torch.long, device=DEVICE)
    slots, page = [], 1
    for rid, n in enumerate(lengths):
        slots.append(fill(pool, req_to_token, rid, page, n, gen))
        page += -(-n // PS)
    batch = SimpleNamespace(batch_size=len(lengths), req_pool_indices=torch.arange(len(lengths), device=DEVICE),
                            seq_lens=torch.tensor(lengths, device=DEVICE))
    dec = PackedDecode(pool)
    assert dec.rescore == ((2, rescore.get("rescore_channels") or D, "bands") if rescore else None)
    dec.begin(batch, req_to_token)
    changed = 0
    assert not dec.step.reference_slots and dec.step.merge == (max(lengths) > 512)
    # 5 sealed pages > the 256-token budget: the GPU selector runs
    assert (dec.step.rows is not None) == (max(lengths) > 512)
    for layer_id in range(LAYERS):
        layer = SimpleNamespace(layer_id=layer_id, scaling=D ** -0.5)
        q = torch.randn(len(lengths), HQ, D, generator=gen).bfloat16().to(DEVICE)
        out = torch.full((len(lengths), HQ, D), float("nan"), device=DEVICE)
        dec.attend(q, layer, out)
        for i, s in enumerate(slots):
            want = reference(pool, q[i], s, layer)
            err = float((out[i] - want).norm() / want.norm())
            assert err < 2e-3, (i, err, repro(seed))  # NaN fails this comparison too
            if rescore and len(s) > 512:  # the second stage changes what is read
                changed += _rescore_changes(pool, q[i], s, layer)
    if rescore:
        assert changed > 0, ("the second stage kept the bound's pages everywhere: the test "
                             "would not see it missing", repro(seed))


def _rescore_changes(pool, q, slots, layer) -> int:
    """(query, KV head) page sets the reference's second stage changes against the bound's."""
    view = pool.layer_view(layer.layer_id, slots)
    keeps = []
    for sel in (pool.cfg.select, replace(pool.cfg.select, rescore_factor=0,
                                         rescore_channels=0)):
        _, info = decode_attention(q[None].float(), view, torch.tensor([len(slots) - 1]), sel,
                                   pool.cfg.page_tokens, sm_scale=layer.scaling)
        keeps.append(info.page_keep)
    return int((keeps[0] != keeps[1]).any(-1).sum())


def test_stats_report_the_pages_selection_read(seed):
    """stats()["selection"]: with a budget (8 pages of 32 tokens) under one request's 20 sealed
    pages, the kernels read what the GPU selector's page_counts say, per layer and KV head;
    the count is what the selection rule implies (sink + recent pages forced, within the
    budget; a request under the budget read whole) and what the reference path counts."""
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool()
    lengths = (700, 300)  # 5 and 2 sealed segments: 20 and 8 pages of 32 tokens
    req_to_token = torch.zeros(len(lengths), 1024, dtype=torch.long, device=DEVICE)
    slots = [fill(pool, req_to_token, 0, 1, 700, gen), fill(pool, req_to_token, 1, 7, 300, gen)]
    batch = SimpleNamespace(batch_size=2, req_pool_indices=torch.arange(2, device=DEVICE),
                            seq_lens=torch.tensor(lengths, device=DEVICE))
    dec = PackedDecode(pool)
    assert dec.stats()["selection"] == {"pages_available": 0, "pages_read": 0,
                                        "read_fraction": None}
    counts = []  # the selector's page_counts, as attend() passes them to the kernels
    dec.wrapper.select = _recording(dec.wrapper.select, counts)
    dec.begin(batch, req_to_token)
    assert dec.step.rows is not None, "700 tokens > the 256-token budget: the selector runs"
    reference_reads = PageReads()
    for layer_id in range(LAYERS):
        layer = SimpleNamespace(layer_id=layer_id, scaling=D ** -0.5)
        q = torch.randn(len(lengths), HQ, D, generator=gen).bfloat16().to(DEVICE)
        dec.attend(q, layer, torch.empty(len(lengths), HQ, D, device=DEVICE))
        for i, s in enumerate(slots):
            view = pool.layer_view(layer_id, s)
            reference_reads.add(decode_attention(q[i:i + 1].float(), view,
                                                 torch.tensor([len(s) - 1]), pool.cfg.select,
                                                 pool.cfg.page_tokens)[1])
    got = dec.stats()["selection"]
    assert len(counts) == LAYERS, repro(seed)
    read = sum(int(c.sum()) for c in counts)
    sel, pt = pool.cfg.select, pool.cfg.page_tokens
    budget = sel.budget_tokens // pt  # 8 >= sink (1) + recent (2) forced pages
    sealed = [20, 8]
    assert read == sum(min(n, budget) for n in sealed) * H * LAYERS, (read, repro(seed))
    want = {"pages_available": sum(sealed) * H * LAYERS, "pages_read": read,
            "read_fraction": read / (sum(sealed) * H * LAYERS)}
    assert got == want, (got, want, repro(seed))
    assert got["read_fraction"] == pytest.approx(16 / 28)
    assert reference_reads.stats() == want, (reference_reads, want, repro(seed))


def _recording(fn, out: list):
    """fn, appending its result's page_counts to `out` (and returning the result)."""
    def call(*args, **kwargs):
        result = fn(*args, **kwargs)
        out.append(result[1])
        return result
    return call


def test_unpacked_segment_goes_to_reference_and_is_counted(seed):
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(sink_candidates=[])  # the sink page stays dense: not kernel-readable
    req_to_token = torch.zeros(2, 1024, dtype=torch.long, device=DEVICE)
    a = fill(pool, req_to_token, 0, 1, 300, gen)
    b = fill(pool, req_to_token, 1, 5, 60, gen)  # nothing sealed: kernel path (hot only)
    assert pool.stats()["segment_store"]["unpacked_segments"] == LAYERS
    batch = SimpleNamespace(batch_size=2, req_pool_indices=torch.arange(2, device=DEVICE),
                            seq_lens=torch.tensor([300, 60], device=DEVICE))
    dec = PackedDecode(pool)
    dec.begin(batch, req_to_token)
    assert list(dec.step.reference_slots) == [0] and dec.step.kernel_reqs.tolist() == [1]
    layer = SimpleNamespace(layer_id=0, scaling=D ** -0.5)
    q = torch.randn(2, HQ, D, generator=gen).bfloat16().to(DEVICE)
    out = torch.full((2, HQ, D), float("nan"), device=DEVICE)
    dec.attend(q, layer, out)
    for i, s in enumerate((a, b)):
        want = reference(pool, q[i], s, layer)
        assert float((out[i] - want).norm() / want.norm()) < 2e-3, repro(seed)
    assert (dec.reference_requests, dec.kernel_requests) == (1, 1)


def test_a_request_whose_prefix_pages_were_swapped_is_repaired_before_the_kernels_read(seed):
    """A request whose own prefix pages were swapped for hot copies (SGLang's radix tree dedup)
    while pages behind them are sealed: begin() seals the copies first (pool.seal_prefix_now,
    counted) and the kernels read a sealed prefix, as the reference does."""
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool()
    req_to_token = torch.zeros(1, 1024, dtype=torch.long, device=DEVICE)
    own = fill(pool, req_to_token, 0, 1, 600, gen)  # pages 1-4 sealed, the rest hot
    copies = torch.arange(20 * PS, 22 * PS, device=DEVICE)  # copies of pages 1-2, hot
    for layer_id in range(LAYERS):
        k = (torch.randn(2 * PS, H, D, generator=gen) * (1 + torch.arange(D) % 7)).to(DEVICE)
        v = torch.randn(2 * PS, H, D, generator=gen).to(DEVICE)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), copies, k.bfloat16(), v.bfloat16())
    pool.release_pages([1, 2])
    swapped = torch.cat([copies, own[2 * PS:]])
    req_to_token[0, :600] = swapped
    batch = SimpleNamespace(batch_size=1, req_pool_indices=torch.arange(1, device=DEVICE),
                            seq_lens=torch.tensor([600], device=DEVICE))
    dec = PackedDecode(pool)
    dec.begin(batch, req_to_token)
    assert pool.counters.prefix_repairs == 1 and all(p in pool.sealed for p in (20, 21, 3, 4))
    layer = SimpleNamespace(layer_id=0, scaling=D ** -0.5)
    q = torch.randn(1, HQ, D, generator=gen).bfloat16().to(DEVICE)
    out = torch.full((1, HQ, D), float("nan"), device=DEVICE)
    dec.attend(q, layer, out)
    want = reference(pool, q[0], swapped, layer)
    assert float((out[0] - want).norm() / want.norm()) < 2e-3, repro(seed)
    assert pool.counters.prefix_repairs == 1  # the reference read a prefix: nothing to repair


def test_store_blocks_are_views_and_freed_blocks_are_reused(seed):
    pool = make_pool()
    req_to_token = torch.zeros(1, 1024, dtype=torch.long, device=DEVICE)
    fill(pool, req_to_token, 0, 1, 3 * PS, torch.Generator().manual_seed(seed))
    store = pool.store
    seg = pool.sealed[2].segments[1]
    codes = next(t for n, t in seg.k.encoded.tensors.items() if n.startswith("codes"))
    assert codes.untyped_storage().data_ptr() == store.data[1].untyped_storage().data_ptr()
    live, top = store.live_bytes, list(store.top)
    assert live == sum(size for _, size in store.blocks.values()) > 0
    pool.release_pages([1, 2, 3])
    assert store.live_bytes == 0 and not store.packed.any()
    # The same data again: the same layouts, served from the free lists (no bump growth).
    fill(pool, req_to_token, 0, 1, 3 * PS, torch.Generator().manual_seed(seed))
    assert store.top == top and store.live_bytes == live


def test_decode_profile_samples_every_nth_step(seed):
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(decode_profile_every=2)
    req_to_token = torch.zeros(1, 1024, dtype=torch.long, device=DEVICE)
    fill(pool, req_to_token, 0, 1, 300, gen)
    batch = SimpleNamespace(batch_size=1, req_pool_indices=torch.arange(1, device=DEVICE),
                            seq_lens=torch.tensor([300], device=DEVICE))
    dec = PackedDecode(pool)
    layer = SimpleNamespace(layer_id=0, scaling=D ** -0.5)
    for _ in range(4):
        dec.timer.step()  # the backend starts each step before its sealing and plan
        dec.begin(batch, req_to_token)
        dec.attend(torch.randn(1, HQ, D, generator=gen).bfloat16().to(DEVICE), layer,
                   torch.empty(1, HQ, D, device=DEVICE))
    prof = dec.stats()["profile"]
    assert prof["sampled_steps"] == 2 and prof["every"] == 2
    assert {"host_plan", "between_layers", "between_steps", "bases", "arena",
            "kernels", "merge"} <= set(prof["ms_per_step"])
    assert all(v >= 0 for v in prof["ms_per_step"].values())


def test_prefill_workspace_through_unpack_kernel_matches_codec(seed):
    """pool.dense_kv (prefill over a compressed prefix) through band_unpack == the codec path."""
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool()
    req_to_token = torch.zeros(1, 1024, dtype=torch.long, device=DEVICE)
    slots = fill(pool, req_to_token, 0, 1, 700, gen)  # 5 sealed pages over 3 basis blocks
    want = [pool.dense_kv(layer_id, slots) for layer_id in range(LAYERS)]
    pool.decode_path = dec = PackedDecode(pool)
    for layer_id in range(LAYERS):
        got = pool.dense_kv(layer_id, slots)
        for g, w in zip(got, want[layer_id]):
            assert g.shape == w.shape == (700, H, D) and g.dtype == w.dtype == torch.bfloat16
            err = float((g.float() - w.float()).norm() / w.float().norm())
            # bf16 rounding of fp32 vs 3xTF32 products; NaN fails
            assert err < 1e-2, (err, repro(seed))
    assert dec.stats()["prefill_unpacked_segments"] == 5 * LAYERS


def test_start_up_compiles_the_prefix_unpack_variant(monkeypatch, seed):
    """What `PackedDecode.compile_unpack` compiles (the backend, at start-up on CUDA) is the
    variant a prefill chunk's read of a compressed prefix launches: otherwise the first such
    chunk compiles inside a live step (3.3 s on an H100, 2026-12-06)."""
    from mosaickv_kernels import band_unpack

    rec = LaunchRecorder(band_unpack._unpack_segments)
    monkeypatch.setattr(band_unpack, "_unpack_segments", rec)
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool()
    req_to_token = torch.zeros(1, 1024, dtype=torch.long, device=DEVICE)
    slots = fill(pool, req_to_token, 0, 1, 700, gen)
    pool.decode_path = dec = PackedDecode(pool)
    pool.dense_kv(0, slots)
    assert rec.launched, repro(seed)
    dec.compile_unpack()
    assert rec.launched == rec.warmed, (rec.launched, rec.warmed, repro(seed))
