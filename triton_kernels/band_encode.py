"""The chooser's encoding of a band candidate on the GPU, one launch: `Band.encode_decoded` of
`codec/strategies/band.py` (asymmetric min/max per channel and token group, fp16 zero rounded
down and scale rounded up, codes rounded half to even, clamped and packed along channels as
`quant.pack_codes` packs them; the reconstruction code * scale + zero, dropped tail channels 0)
for R rows at once, into the codec's own tensors:

    tensors, decoded = band_encode(x, widths)   # x float32 [R, T, D] contiguous
    # tensors: codes8/scale8/zero8, codes4/..., codes2/... as Band.encode returns them
    # (uint8 [R, T, n * bits / 8], fp16 [R, T / group, n] each); decoded float32 [R, T, D]

The torch path launches ~30 ops per band (the fp16 rounding's compares and nextafters, the
division, rounding, clamping, packing, the reconstruction); this is one program per row, the
quantization of `band_pack` (the same helpers: IEEE division, round half to even, outward fp16
rounding on the bits) and the reconstruction as a product then a sum, compiled without fused
multiply-adds (`enable_fp_fusion=False`): the same bytes and the same float32 values as the
codec (tests/test_band_encode_kernel.py). Used by the chooser when `encode_kernel` is "triton".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .band_pack import _encode_band


@triton.jit
def _band_encode(X, DEC, C8, S8, Z8, C4, S4, Z4, C2, S2, Z2,
                 T: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                 N8: tl.constexpr, N4: tl.constexpr, N2: tl.constexpr,
                 W8: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr):
    """One program per row: each non-empty band in turn (8, 4, 2 bits: leading channels first),
    then the dropped tail's reconstruction set to 0."""
    r = tl.program_id(0).to(tl.int64)
    x = X + r * T * D
    dec = DEC + r * T * D
    groups: tl.constexpr = T // GROUP
    if N8 > 0:
        _encode_band(x, C8 + r * T * N8, S8 + r * groups * N8, Z8 + r * groups * N8, dec,
                     0, N8, 8, W8, GROUP, T, D, True)
    if N4 > 0:
        _encode_band(x, C4 + r * T * (N4 // 2), S4 + r * groups * N4, Z4 + r * groups * N4,
                     dec, N8, N4, 4, W4, GROUP, T, D, True)
    if N2 > 0:
        _encode_band(x, C2 + r * T * (N2 // 4), S2 + r * groups * N2, Z2 + r * groups * N2,
                     dec, N8 + N4, N2, 2, W2, GROUP, T, D, True)
    KEPT: tl.constexpr = N8 + N4 + N2
    if KEPT < D:
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, GROUP)
        for g in tl.static_range(T // GROUP):
            tok = g * GROUP + offs_t
            tl.store(dec + tok[:, None] * D + offs_d[None, :],
                     tl.zeros([GROUP, D], tl.float32), mask=(offs_d >= KEPT)[None, :])


# 8 warps: at 4 a 128-token group of 96 4-bit channels spilled 12 bytes on sm_90 (255 registers;
# scripts/sm90_compile.py --only encode, 2026-12-08)
ENCODE_WARPS = 8


def _width(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))


def _ptr_dtypes(widths) -> list:
    """The dtypes of `_band_encode`'s nine band pointers for `widths` (an empty band's point at
    the float32 reconstruction): part of the key Triton compiles a variant on."""
    out = []
    for n in widths[:3]:
        out += [torch.uint8, torch.float16, torch.float16] if n else [torch.float32] * 3
    return out


def band_encode(x: torch.Tensor, widths: tuple[int, int, int, int]):
    """x float32 [R, T, D] contiguous, band widths (b8, b4, b2 channels, token group) ->
    (the codec's tensors {codes8, scale8, zero8, ...} for the non-empty bands, the
    reconstruction float32 [R, T, D])."""
    n8, n4, n2, group = widths
    if x.dtype != torch.float32 or x.dim() != 3 or not x.is_contiguous():
        raise ValueError(f"band_encode: x must be contiguous float32 [R, T, D], got {x.dtype} "
                         f"{tuple(x.shape)}")
    r, t, d = x.shape
    if t % group or n8 + n4 + n2 > d or (n4 * 4) % 8 or (n2 * 2) % 8 or d & (d - 1):
        raise ValueError(f"band_encode: group {group} must divide T={t}, D={d} be a power of "
                         f"two >= b8 + b4 + b2 = {n8 + n4 + n2}, and each band whole bytes")
    dev = x.device
    decoded = torch.empty(r, t, d, dtype=torch.float32, device=dev)
    out, ptrs = {}, []
    for bits, n in ((8, n8), (4, n4), (2, n2)):
        if n:
            out[f"codes{bits}"] = torch.empty(r, t, n * bits // 8, dtype=torch.uint8, device=dev)
            out[f"scale{bits}"] = torch.empty(r, t // group, n, dtype=torch.float16, device=dev)
            out[f"zero{bits}"] = torch.empty(r, t // group, n, dtype=torch.float16, device=dev)
            ptrs += [out[f"codes{bits}"], out[f"scale{bits}"], out[f"zero{bits}"]]
        else:  # an empty band: its pointers are never read
            ptrs += [decoded] * 3
    assert [p.dtype for p in ptrs] == _ptr_dtypes(widths)  # what compile_variants compiles
    if r:
        _band_encode[(r,)](x, decoded, *ptrs, T=t, D=d, GROUP=group, N8=n8, N4=n4, N2=n2,
                           W8=_width(n8), W4=_width(n4), W2=_width(n2), num_warps=ENCODE_WARPS,
                           enable_fp_fusion=False)
    return out, decoded


def compile_variants(widths, tokens: int, head_dim: int) -> int:
    """Compile `_band_encode` now for every (b8, b4, b2, group) in `widths` at `tokens` tokens a
    row and `head_dim` (Triton's `warmup`: nothing runs), so that the first segment a candidate
    encodes does not stall a live step on a compile. CUDA only. Returns variants compiled."""
    todo = [w for w in dict.fromkeys(tuple(w) for w in widths) if tokens % w[3] == 0]
    for n8, n4, n2, group in todo:
        _band_encode.warmup(torch.float32, torch.float32, *_ptr_dtypes((n8, n4, n2)), grid=(1,),
                            T=tokens, D=head_dim, GROUP=group, N8=n8, N4=n4, N2=n2,
                            W8=_width(n8), W4=_width(n4), W2=_width(n2), num_warps=ENCODE_WARPS,
                            enable_fp_fusion=False)
    return len(todo)
