"""The chooser's error check for a band candidate on the GPU, without encoding it: per (segment,
KV head) row the squared reconstruction error of `Band.encode` then `Band.decode` (asymmetric
min/max per channel and token group, fp16 zero rounded down and scale rounded up, codes rounded
half to even and clamped, dropped tail channels reconstructed as 0) and the row's squared norm,
in one pass over the rotated values: no codes, scales or reconstruction in memory.

    err2, norm2 = band_errors(x_rot, widths)   # x_rot float32 [R, T, D]; -> float32 [R] each

`widths` = (b8, b4, b2 channels, token group), as `band_pack` takes them. The chooser
(`codec/layer.py`, `chooser: "errors_first"`) checks every candidate this way, one launch each,
brings the errors to the host once, and encodes each segment only with the candidate it picked.
`band_errors_reference` is the torch version: the codec's own encode and decode.

The quantization is `band_pack`'s (the same helpers: IEEE division, round half to even,
outward fp16 rounding on the bits), so the codes are the ones the pack kernel writes; the
reconstruction is code * scale + zero (a product, then a sum, as `channel_groups_decode`), and
the sums are float32 in the kernel's order, not torch's: a segment whose error is within
float32 rounding of its budget may be judged on the other side of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .band_pack import _round_fp16, _round_half_even

CHUNK = 32  # tokens per load: a [CHUNK, D] float32 tile per step, bounds for a group first


@triton.jit
def _band_errors(X, ERR, NORM, T: tl.constexpr, D: tl.constexpr, N8: tl.constexpr,
                 N4: tl.constexpr, N2: tl.constexpr, GROUP: tl.constexpr,
                 CHUNK: tl.constexpr):
    """One program per row [T, D]: for each token group, the channels' min and max (a pass over
    the group's chunks), then each chunk quantized with its channel's band, decoded, and its
    squared error summed; channels past the bands contribute x^2 (reconstructed as 0)."""
    r = tl.program_id(0).to(tl.int64)
    x_row = X + r * T * D
    offs_c = tl.arange(0, D)
    offs_t = tl.arange(0, CHUNK)
    bits = tl.where(offs_c < N8, 8, tl.where(offs_c < N8 + N4, 4,
                                             tl.where(offs_c < N8 + N4 + N2, 2, 0)))
    kept = bits > 0
    levels = ((1 << bits) - 1).to(tl.float32)
    err = tl.zeros([D], tl.float32)
    norm = tl.zeros([D], tl.float32)
    for g in range(T // GROUP):
        lo = tl.full([D], float("inf"), tl.float32)
        hi = tl.full([D], float("-inf"), tl.float32)
        for c in range(GROUP // CHUNK):
            tok = g * GROUP + c * CHUNK + offs_t
            x = tl.load(x_row + tok[:, None] * D + offs_c[None, :])
            lo = tl.minimum(lo, tl.min(x, 0))
            hi = tl.maximum(hi, tl.max(x, 0))
        zero = _round_fp16(tl.where(kept, lo, 0.0), True).to(tl.float32)
        span = tl.math.div_rn(tl.where(kept, hi, 0.0) - zero, tl.where(kept, levels, 1.0))
        scale = _round_fp16(tl.maximum(span, 1e-8), False).to(tl.float32)
        for c in range(GROUP // CHUNK):
            tok = g * GROUP + c * CHUNK + offs_t
            x = tl.load(x_row + tok[:, None] * D + offs_c[None, :])
            q = tl.math.div_rn(x - zero[None, :], tl.broadcast_to(scale[None, :], [CHUNK, D]))
            code = tl.minimum(tl.maximum(_round_half_even(q), 0.0), levels[None, :])
            prod = code * scale[None, :]
            dec = tl.where(kept[None, :], prod + zero[None, :], 0.0)
            diff = dec - x
            err += tl.sum(diff * diff, 0)
            norm += tl.sum(x * x, 0)
    tl.store(ERR + r, tl.sum(err, 0))
    tl.store(NORM + r, tl.sum(norm, 0))


def band_errors(x: torch.Tensor, widths: tuple[int, int, int, int],
                out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Squared reconstruction error and squared norm per row of x (float32 [R, T, D],
    contiguous) under the band layout `widths` = (b8, b4, b2 channels, token group):
    float32 [R] each, written into `out` (two contiguous float32 [R] tensors, e.g. rows of one
    buffer for several candidates) when given."""
    n8, n4, n2, group = widths
    if x.dtype != torch.float32 or x.dim() != 3 or not x.is_contiguous():
        raise ValueError(f"band_errors: x must be contiguous float32 [R, T, D], got {x.dtype} "
                         f"{tuple(x.shape)}")
    r, t, d = x.shape
    if t % group or group % CHUNK or d & (d - 1) or n8 + n4 + n2 > d:
        raise ValueError(f"band_errors: group {group} must divide T={t} and be a multiple of "
                         f"{CHUNK}, D={d} a power of two >= b8 + b4 + b2 = {n8 + n4 + n2}")
    if out is None:
        err = torch.empty(r, dtype=torch.float32, device=x.device)
        norm = torch.empty(r, dtype=torch.float32, device=x.device)
    else:
        err, norm = out
        for o in out:
            if o.dtype != torch.float32 or o.shape != (r,) or not o.is_contiguous() or \
                    o.device != x.device:
                raise ValueError(f"band_errors: out must be two contiguous float32 [{r}] "
                                 f"tensors on {x.device}, got {o.dtype} {tuple(o.shape)}")
    if r:
        _band_errors[(r,)](x, err, norm, T=t, D=d, N8=n8, N4=n4, N2=n2, GROUP=group,
                           CHUNK=CHUNK, num_warps=4)
    return err, norm


def compile_variants(widths, tokens: int, head_dim: int) -> int:
    """Compile `_band_errors` now for every (b8, b4, b2, group) in `widths` at `tokens` tokens a
    row and `head_dim` (Triton's `warmup`: nothing runs, nothing is allocated), so that the
    chooser's first segment of a candidate does not stall a live step on a compile. Widths the
    kernel does not take (a group not a multiple of CHUNK or not dividing `tokens`) are
    skipped. CUDA only. Returns how many were compiled."""
    todo = [w for w in dict.fromkeys(tuple(w) for w in widths)
            if w[3] % CHUNK == 0 and tokens % w[3] == 0]
    for n8, n4, n2, group in todo:
        _band_errors.warmup(torch.float32, torch.float32, torch.float32, grid=(1,), T=tokens,
                            D=head_dim, N8=n8, N4=n4, N2=n2, GROUP=group, CHUNK=CHUNK,
                            num_warps=4)
    return len(todo)


def band_errors_reference(x: torch.Tensor, strategy) -> tuple[torch.Tensor, torch.Tensor]:
    """`band_errors` through the codec: `strategy` (a Band) encodes and decodes x [R, T, D];
    the squared error and squared norm per row, float32 [R]."""
    _, dec = strategy.encode_decoded(x, "k")
    return (dec - x).square().sum((1, 2)), x.square().sum((1, 2))
