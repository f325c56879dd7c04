"""GPU band encoding (mosaickv_kernels.band_pack) against the codec: on fresh random layers with
the default layouts, 2-bit bands and 32-token groups (test_band_decode_kernel.LAYOUTS), the
kernel writes exactly the arena bytes `pack_layer` stores from `Band.encode`."""
from __future__ import annotations

import pytest
import torch

from mosaickv_kernels.band_pack import pack_segments
from mosaickv_sglang.codec.arena import HDR, BlockLayout, pack_layer

from conftest import repro
from test_band_decode_kernel import make_layer

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("d", [64, 128])
def test_pack_matches_codec_bytes(d, seed):
    h = 2
    rotated: list = []
    layer = make_layer(h, d, 4, 3, rotated=rotated)
    arena = pack_layer([layer]).to(DEVICE)
    want = arena.data.clone()
    n = len(layer.segments)
    k_rot = torch.stack([k for k, _ in rotated]).to(DEVICE).contiguous()
    v_rot = torch.stack([v for _, v in rotated]).to(DEVICE).contiguous()
    arena.data.fill_(0x5A)  # poisoned: every payload byte must be rewritten
    order = torch.randperm(n)
    pack_segments(arena, order.to(torch.int32).to(DEVICE), k_rot[order.to(DEVICE)].contiguous(),
                  v_rot[order.to(DEVICE)].contiguous())
    # Alignment padding is not payload: compare only the bytes of the layouts' parts.
    payload = torch.zeros(want.numel(), dtype=torch.bool)
    for seg, row in zip(layer.segments, arena.headers.cpu().tolist()):
        lay = BlockLayout.of(seg.k.strategy, seg.v.strategy, seg.tokens, d)
        for head in range(h):
            start = row[HDR["base16"]] * 16 + head * lay.head_bytes
            for part, off in lay.offsets.items():
                payload[start + off:start + off + lay.sizes[part]] = True
    assert int(payload.sum()) == arena.payload["codes"] + arena.payload["scales"]
    diff = ((arena.data.cpu() != want.cpu()) & payload).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:4, 0].tolist()} " \
                              f"{repro(seed)}"


def test_pack_rejects_misuse():
    arena = pack_layer([make_layer(1, 64, 1, 3)])
    x = torch.zeros(1, 1, 128, 64)
    with pytest.raises(ValueError, match="k_rot must be contiguous float32"):
        pack_segments(arena, torch.zeros(1, dtype=torch.int32), x.double(), x)
    with pytest.raises(ValueError, match="seg_list must be int32"):
        pack_segments(arena, torch.zeros(1, dtype=torch.int64), x, x)
