"""Decompression of packed segments (mosaickv_kernels.band_unpack) against its torch reference
and against the codec's own decode + un-rotation, on fresh random layers with mixed layouts."""
from __future__ import annotations

import pytest
import torch

from mosaickv_kernels.band_unpack import unpack_segments, unpack_segments_reference
from mosaickv_sglang.codec.arena import pack_layer
from mosaickv_sglang.codec.basis import unrotate

from conftest import assert_rel_close
from test_band_decode_kernel import make_layer

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_unpack_matches_reference_and_codec(seed):
    h, d = 2, 64
    layers = [make_layer(h, d, 3, 5), make_layer(h, d, 2, 9, first=1)]
    arena = pack_layer(layers).to(DEVICE)
    seg_list = torch.tensor([4, 0, 2], dtype=torch.int32)  # any order, any subset
    seg_req = torch.tensor([1, 0, 0], dtype=torch.int32)
    t = arena.segment_tokens
    out = [torch.full((3 * t, h, d), float("nan"), device=DEVICE) for _ in range(2)]  # poisoned
    unpack_segments(arena, seg_list.to(DEVICE), seg_req.to(DEVICE), *out)
    ref = unpack_segments_reference(arena, seg_list.to(DEVICE), seg_req.to(DEVICE))
    for kind, got, want in zip("kv", out, ref):
        assert_rel_close(got.cpu(), want.cpu(), 1e-5, f"unpack {kind}", seed)
    # The reference against the codec: Band.decode in the basis, then x @ U^-1.
    segs = [(1, 1), (0, 0), (0, 2)]  # (request, segment index) of seg_list's entries
    for i, (b, s) in enumerate(segs):
        seg = layers[b].segments[s]
        for kind, choice, bases, got in (("k", seg.k, layers[b].k_bases, out[0]),
                                         ("v", seg.v, layers[b].v_bases, out[1])):
            raw = unrotate(choice.strategy.decode(choice.encoded), bases[seg.basis])
            mine = got[i * t:(i + 1) * t].cpu().permute(1, 0, 2)  # [H, T, D]
            assert_rel_close(mine, raw, 1e-4, f"{kind} of segment {i} vs codec", seed)


def test_unpack_bf16_workspace_and_misuse(seed):
    h, d = 1, 64
    arena = pack_layer([make_layer(h, d, 2, 3)]).to(DEVICE)
    t = arena.segment_tokens
    ids = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    req = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    k = torch.empty(2 * t, h, d, dtype=torch.bfloat16, device=DEVICE)
    v = torch.empty_like(k)
    unpack_segments(arena, ids, req, k, v)
    want = unpack_segments_reference(arena, ids, req)
    assert_rel_close(k.float().cpu(), want[0].cpu(), 5e-3, "bf16 k", seed)
    # the bf16 store rounds to nearest, as a GPU's cast (the interpreter's truncates: rounded on
    # the bits there): the same as the float32 outputs' own rounding
    k32, v32 = (torch.empty(2 * t, h, d, device=DEVICE) for _ in range(2))
    unpack_segments(arena, ids, req, k32, v32)
    for name, got, full in (("k", k, k32), ("v", v, v32)):
        assert torch.equal(got.cpu(), full.to(torch.bfloat16).cpu()), (name, seed)
    with pytest.raises(ValueError, match="seg_req must be int32"):
        unpack_segments(arena, ids, req.long(), k, v)
    with pytest.raises(ValueError, match="out_v must be a contiguous float tensor"):
        unpack_segments(arena, ids, req, k, v[:t])
