"""A daemon result read in place (views of its shared-memory slot, no device copy) is adopted
into the store exactly as its device copy is, and nothing the store or the page's segments keep
points into the slot afterwards: overwriting the slot changes nothing. On CUDA the copy kernel
reads the pinned, mapped slot over PCIe (`SegmentStore.reads_host`); on a CPU the torch copies
and the kernel (Triton's interpreter) read it directly. The gpu-marked case is the same on the
device machine. Two pages from two slots in one batch (`adopt_pages`, one kernel launch) land
as the one page does."""
from __future__ import annotations

import pytest
import torch

from conftest import repro
from mosaickv_sglang.codec.arena import HDR, META_FIELDS, pack_page
from mosaickv_sglang.codec.layer import Candidates
from mosaickv_sglang.codec.seal import seal_group
from mosaickv_sglang.codec.strategies import parse_strategy
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.daemon.channel import Channel, ChannelSpec, dump, load
from mosaickv_sglang.serving.segment_store import SegmentStore

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
LAYERS, H, D = 2, 2, 64


def _page(seed: int, cfg: MosaicConfig):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(LAYERS, 2, H, cfg.segment_tokens, D, generator=g)
          * torch.logspace(0.5, -1, D)).bfloat16()
    page = seal_group(lambda idx: (kv[None, :, 0], kv[None, :, 1]), [cfg.segment_tokens * 3],
                      None, cfg, Candidates.from_config(cfg), parse_strategy("dense"))[0]
    packed = pack_page(page, cfg.page_tokens)
    assert packed is not None, "the default config must seal arena-ready pages"
    return page, packed


def _store(cfg, device, path, capacity=1 << 20):
    return SegmentStore(LAYERS, 2, H, D, cfg.segment_tokens, cfg.page_tokens, device,
                        cfg.select.meta_channels, capacity, pack_kernel=path)


def _segment_tensors(segs):
    return [(seg.header.cpu(), {n: t.cpu().clone() for c in (seg.k, seg.v)
                                for n, t in c.encoded.tensors.items()}) for seg in segs]


def _check(device, path, seed):
    cfg = MosaicConfig()
    page, packed = _page(seed, cfg)
    channel = Channel.create(ChannelSpec(LAYERS, H, D, cfg.segment_tokens, "bfloat16", 2, 1,
                                         1 << 20))
    try:
        if device == "cuda":
            assert channel.pin(), "cudaHostRegister failed"
        region = channel.result(1)  # not the first slot: views count from the block's start
        off, n = dump(packed, region, {id(page.bases): "bases"})
        refs = {"bases": page.bases}
        want = _store(cfg, device, path)
        want_segs = want.store_pages([1], [load(region, off, n, refs, device)])[0]
        got = _store(cfg, device, path)
        first = channel.result(0)
        assert got.reads_host(first), "the store cannot read the slot in place"
        off0, n0 = dump(packed, first, {id(page.bases): "bases"})
        # two pages from two slots in one batch (one launch on the kernel path)
        got_pages = got.store_pages([1, 2], [load(region, off, n, refs, None),
                                             load(first, off0, n0, refs, None)])
        full = _store(cfg, device, path, capacity=16)  # no room: segments keep their own bytes
        full_segs = full.store_pages([1], [load(region, off, n, refs, None)])[0]
        if device == "cuda":
            torch.cuda.synchronize()
        region.fill_(0xA5)  # the slots reused by the next results
        first.fill_(0x5A)
        for layer, p in ((layer, p) for layer in range(LAYERS) for p in (1, 2)):
            (wa, size), (ga, _) = want.blocks[(layer, 1)], got.blocks[(layer, p)]
            assert torch.equal(want.data[layer][wa:wa + size], got.data[layer][ga:ga + size]), \
                repro(seed)
            hw, hg = want.headers[layer][1].clone(), got.headers[layer][p].clone()
            hw[HDR["base16"]] = hg[HDR["base16"]] = 0
            assert torch.equal(hw, hg), repro(seed)
            for f in META_FIELDS:
                assert torch.equal(getattr(want.meta[layer], f)[1],
                                   getattr(got.meta[layer], f)[p]), f"{f} {repro(seed)}"
        assert not full.blocks and full.arena_full == LAYERS
        expect = _segment_tensors(want_segs)
        for segs in (*got_pages, full_segs):
            for (hw, tw), (hg, tg) in zip(expect, _segment_tensors(segs)):
                assert torch.equal(hw, hg) and tw.keys() == tg.keys(), repro(seed)
                assert all(torch.equal(tw[k], tg[k]) for k in tw), repro(seed)
    finally:
        channel.close(unlink=True)


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case (interpreter kernels)")
def test_a_result_read_in_place_is_adopted_as_its_device_copy(path, seed):
    _check("cpu", path, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_result_read_in_place_from_a_pinned_slot_is_adopted_as_its_device_copy(seed):
    _check("cuda", "triton", seed)
