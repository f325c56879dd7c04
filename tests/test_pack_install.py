"""Sealing through the GPU pack kernel (`pack_kernel: triton`, forced here on the CPU under
TRITON_INTERPRET=1) fills the serving store exactly as the torch copies do: the same arena bytes
(padding included), headers, page metadata, blocks and re-pointed segment tensors, for head_dim
64 and 128, 8/4/2-bit bands, sink segments, dense fallbacks, selection on and off; and
PackedDecode over the two pools gives the same outputs, bit for bit. The gpu-marked test does
the same on CUDA at the Llama-3.1-8B head shape, where torch and the kernel each run on the GPU."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import LaunchRecorder, repro
from mosaickv_sglang.codec.basis import fit_basis
from mosaickv_sglang.codec.layer import Candidates, seal_segments
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.packed_decode import PackedDecode
from mosaickv_sglang.serving.pool import MosaicKVPool
from mosaickv_sglang.serving.segment_store import SegmentStore

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)
S, PT = 128, 32
# (K candidates, V candidates, sink, error budget): each sealing call yields one layout (or dense)
CALLS = [
    (["band:b8=4,b4=44,b2=16,group=128"], ["band:b8=0,b4=48,b2=16,group=128"], False, 1.0),
    (["band:b8=16,b4=48,b2=0,group=64"], ["band:b8=4,b4=60,b2=0,group=128"], False, 1.0),
    (["band:b8=8,b4=24,b2=16,group=32"], ["band:b8=8,b4=24,b2=16,group=32"], False, 1.0),
    (None, None, True, 1.0),  # sink: 8 bits on every channel, 32-token groups
    (["band:b8=4,b4=44,b2=16,group=128"], ["band:b8=4,b4=44,b2=16,group=128"], False, 0.0),
]


def _segments(h: int, d: int, per_call: int, select: bool, gen, device):
    """Segments of every CALLS layout, interleaved in page order (the last call goes dense:
    no candidate meets a zero budget, and no rescue), each with its rotated K/V kept."""
    out = []
    for kc, vc, sink, budget in CALLS:
        k = (torch.randn(per_call, h, S, d, generator=gen) * torch.logspace(0.5, -1, d)).to(device)
        v = (torch.randn(per_call, h, S, d, generator=gen) * torch.logspace(0, -1, d)).to(device)
        cfg = MosaicConfig(**({} if kc is None else {"k_candidates": kc, "v_candidates": vc}),
                           k_error_budget=budget, v_error_budget=budget, sink_error_budget=1.0,
                           rescue_candidates=[])
        kb = torch.stack([fit_basis(x) for x in k])
        vb = torch.stack([fit_basis(x) for x in v])
        out.append(seal_segments(k, v, kb, vb, 0, [S] * per_call, cfg, Candidates.from_config(cfg),
                                 sink, select, keep_rotated=True))
    return [seg for row in zip(*out) for seg in row]


def _store(path: str, h: int, d: int, pages: int, select: bool, device) -> SegmentStore:
    return _poisoned(SegmentStore(2, pages + 1, h, d, S, PT, device, 8 if select else None,
                                  pages * h * 2 * S * d * 2, pack_kernel=path))


def _poisoned(store: SegmentStore) -> SegmentStore:
    """Arena bytes that are not zero before install: every block byte must be written."""
    for data in store.data:
        data.fill_(0x5A)
    return store


def _assert_same_store(a: SegmentStore, b: SegmentStore, seed: int) -> None:
    assert a.blocks == b.blocks and a.top == b.top and a.live_bytes == b.live_bytes, repro(seed)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.plans.cpu(), b.plans.cpu())
    for layer in range(len(a.data)):
        top = a.top[layer]
        diff = (a.data[layer][:top] != b.data[layer][:top]).nonzero().flatten()
        assert diff.numel() == 0, f"layer {layer}: {diff.numel()} arena bytes differ, first at " \
                                  f"{diff[:4].tolist()} {repro(seed)}"
        assert torch.equal(a.headers[layer], b.headers[layer]), repro(seed)
        if a.meta is not None:
            for name in ("channels", "lo", "hi", "rest_norm"):
                assert torch.equal(getattr(a.meta[layer], name), getattr(b.meta[layer], name)), \
                    f"{name} {repro(seed)}"


def _install_both(h: int, d: int, select: bool, per_call: int, seed: int, device):
    """The same segments installed by torch copies and by the kernel (two layers, pages in a
    scrambled order) -> (torch store, kernel store, segments of each)."""
    gen = torch.Generator().manual_seed(seed)
    layers = [_segments(h, d, per_call, select, gen, device) for _ in range(2)]
    n = len(layers[0])
    pages = torch.randperm(n, generator=gen).add(1).tolist()
    stores, segs = {}, {}
    for path in ("torch", "triton"):
        stores[path] = _store(path, h, d, n, select, device)
        segs[path] = [copy.deepcopy(layer) for layer in layers]
        for layer, row in enumerate(segs[path]):
            stores[path].install(layer, pages, row)
    return stores, segs


@pytest.mark.parametrize("d,select", [(64, True), (128, False)])
def test_kernel_install_equals_torch_install(d, select, seed):
    stores, segs = _install_both(2, d, select, 2, seed, DEVICE)
    _assert_same_store(stores["torch"], stores["triton"], seed)
    n = len(segs["torch"][0])
    dense = n // len(CALLS)
    assert stores["triton"].pack_counts == {"kernel": 2 * (n - dense), "torch": 0,
                                            "no_rotated": 0}, repro(seed)
    assert stores["torch"].pack_counts == {"kernel": 0, "torch": 2 * (n - dense),
                                           "no_rotated": 0}
    for row_a, row_b in zip(segs["torch"], segs["triton"]):
        for a, b in zip(row_a, row_b):
            assert a.rotated is None and b.rotated is None  # dropped by install
            for ca, cb in ((a.k, b.k), (a.v, b.v)):
                assert ca.strategy.spec == cb.strategy.spec
                for name, t in ca.encoded.tensors.items():
                    assert torch.equal(t, cb.encoded.tensors[name]), f"{name} {repro(seed)}"


def test_kernel_path_without_rotated_is_copied_and_counted(seed):
    gen = torch.Generator().manual_seed(seed)
    segs = _segments(2, 64, 1, True, gen, DEVICE)
    want = _store("torch", 2, 64, len(segs), True, DEVICE)
    got = _store("triton", 2, 64, len(segs), True, DEVICE)
    same = copy.deepcopy(segs)
    for seg in segs:
        seg.rotated = None  # as a daemon result comes in
    pages = list(range(1, len(segs) + 1))
    want.install(0, pages, same)
    got.install(0, pages, segs)
    _assert_same_store(want, got, seed)
    assert got.pack_counts["kernel"] == 0 and got.pack_counts["no_rotated"] == len(segs) - 1


def test_pack_kernel_choice(monkeypatch):
    assert MosaicConfig().pack_kernel == "auto"
    with pytest.raises(ValueError, match="pack_kernel='gpu' must be one of"):
        MosaicConfig(pack_kernel="gpu")
    assert not _store("auto", 1, 64, 1, False, "cpu").pack_kernel  # auto: the kernel on CUDA only
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _store("triton", 1, 64, 1, False, "cpu").pack_kernel
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1, or use pack_kernel 'auto'"):
        _store("triton", 1, 64, 1, False, "cpu")


# ---- through the pool and PackedDecode -------------------------------------------------------

def _pool(path: str, d: int, select: bool) -> MosaicKVPool:
    cfg = MosaicConfig(hot_tokens=0, basis_block_tokens=256, pack_kernel=path,
                       select={"enabled": select, "budget_tokens": 256, "sink_tokens": 32,
                               "recent_tokens": 64})
    return MosaicKVPool(40 * S, S, torch.bfloat16, 2, d, 2, DEVICE, False, mosaic_config=cfg)


@pytest.mark.parametrize("d,select", [(64, True), (128, False)])
def test_decode_over_kernel_packed_pool_is_identical(d, select, seed):
    """Two requests (one across two basis blocks) sealed by each path: same store, same decode."""
    lengths = (400, 150)
    gen = torch.Generator().manual_seed(seed)
    data = [[(torch.randn(n, 2, d, generator=gen) * (1 + torch.arange(d) % 7),
              torch.randn(n, 2, d, generator=gen)) for _ in range(2)] for n in lengths]
    q = [torch.randn(len(lengths), 4, d, generator=gen).bfloat16() for _ in range(2)]
    outs, pools = {}, {}
    for path in ("torch", "triton"):
        pool = pools[path] = _pool(path, d, select)
        _poisoned(pool.store)
        req_to_token = torch.zeros(len(lengths), 1024, dtype=torch.long, device=DEVICE)
        page = 1
        for rid, (n, kv) in enumerate(zip(lengths, data)):
            slots = torch.arange(page * S, page * S + n, device=DEVICE)
            req_to_token[rid, :n] = slots
            for layer_id, (k, v) in enumerate(kv):
                pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots,
                                   k.bfloat16().to(DEVICE), v.bfloat16().to(DEVICE))
            pool.seal_request(slots, n)
            page += -(-n // S)
        dec = PackedDecode(pool)
        dec.begin(SimpleNamespace(batch_size=len(lengths),
                                  req_pool_indices=torch.arange(len(lengths), device=DEVICE),
                                  seq_lens=torch.tensor(lengths, device=DEVICE)), req_to_token)
        outs[path] = []
        for layer_id in range(2):
            out = torch.full((len(lengths), 4, d), float("nan"), device=DEVICE)
            dec.attend(q[layer_id].to(DEVICE), SimpleNamespace(layer_id=layer_id,
                                                               scaling=d ** -0.5), out)
            outs[path].append(out)
    stats = pools["triton"].stats()["segment_store"]
    sealed = 2 * len(pools["triton"].sealed)
    assert stats["pack_kernel"] and stats["packed_by"] == {"kernel": sealed, "torch": 0,
                                                           "no_rotated": 0}, repro(seed)
    assert pools["torch"].stats()["segment_store"]["packed_by"]["torch"] == sealed
    _assert_same_store(pools["torch"].store, pools["triton"].store, seed)
    for a, b in zip(outs["torch"], outs["triton"]):
        assert bool(torch.isfinite(a).all()) and torch.equal(a, b), repro(seed)


# ---- device ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_install_equals_torch_install_gpu(seed):
    """Llama-3.1-8B heads (8 x 128), 8 segments per layout and layer: ~10^5 fp16 scales, where
    torch's reciprocal-multiply division (if it came back) would differ a dozen times."""
    stores, _ = _install_both(8, 128, True, 8, seed, "cuda")
    _assert_same_store(stores["torch"], stores["triton"], seed)
    assert stores["triton"].pack_counts["kernel"] > 0


# ---- every pack variant compiled at start-up -------------------------------------------------

def test_start_up_compiles_every_pack_variant_sealing_launches(monkeypatch, seed):
    """What `SegmentStore.compile_pack_kernels` compiles (on CUDA, at start-up) covers every
    launch that installing pages of those layouts makes, compile-time arguments included: a
    variant it missed would be compiled inside a live step (the H100's 2.8 s decode stall at
    1 x 32K on a cold Triton cache, 2026-12-05, is the kind of thing this prevents)."""
    from mosaickv_kernels import band_pack

    rec = LaunchRecorder()
    monkeypatch.setattr(band_pack, "_pack_kind", rec)
    h, d = 2, 128
    gen = torch.Generator().manual_seed(seed)
    segs = _segments(h, d, 1, False, gen, DEVICE)
    store = _store("triton", h, d, len(segs), False, DEVICE)
    store.install(0, list(range(1, len(segs) + 1)), segs)
    sink = MosaicConfig().sink_candidates[0]
    pairs = [(kc[0], vc[0]) for kc, vc, _, _ in CALLS if kc is not None] + [(sink, sink)]
    variants = store.pack_variants(pairs, S)
    assert band_pack.compile_variants(variants, h, S, d) == len(variants) == 9
    assert rec.launched and rec.launched <= rec.warmed, repro(seed)
    # the pairs the server compiles for: every K and V band candidate, sink and rescue
    from mosaickv_sglang.serving.graph_decode import band_pairs
    cfg = MosaicConfig()
    kinds = {kind for kind, _ in store.pack_variants(band_pairs(cfg), S)}
    assert kinds == {"k", "v"}
    assert len(store.pack_variants(band_pairs(cfg), S)) == len(
        {(x, s) for x, specs in (("k", cfg.k_candidates), ("v", cfg.v_candidates))
         for s in specs + cfg.sink_candidates + cfg.rescue_candidates if s.startswith("band:")})
    assert store.compile_pack_kernels(pairs, S) == (9 if DEVICE == "cuda" else 0)
