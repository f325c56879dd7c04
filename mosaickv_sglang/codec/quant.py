"""Low-bit value helpers shared by the strategies: asymmetric quantization and bit packing.

Codes are packed little-end-first along the last axis, so a kernel reads a byte and shifts.
Scales and zero points are fp16: they are part of the physical bytes a strategy keeps.
"""
from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16
QUANT_BITS = (2, 4, 8)
PACK_BITS = (1, 2, 4, 8)  # 1-bit packing carries bitmaps


def check_bits(bits: int) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"bits={bits} is not supported; use one of {QUANT_BITS}")


def _check_pack_bits(bits: int) -> None:
    if bits not in PACK_BITS:
        raise ValueError(f"cannot pack {bits}-bit codes; use one of {PACK_BITS}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along the last axis into uint8. Byte operations on
    strided slices (code i of each byte is every per_byte-th code from i), not an int32 sum:
    sealing packs every candidate it tries, and int32 grouping was 4x the bytes."""
    _check_pack_bits(bits)
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    per_byte = 8 // bits
    n = codes.shape[-1]
    if n % per_byte:
        raise ValueError(f"last axis {n} is not a multiple of {per_byte} ({bits}-bit codes)")
    packed = codes[..., 0::per_byte].clone()
    for i in range(1, per_byte):
        packed |= codes[..., i::per_byte] << (i * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 codes, last axis multiplied by 8 // bits."""
    _check_pack_bits(bits)
    if bits == 8:
        return packed
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    codes = torch.empty(*packed.shape[:-1], packed.shape[-1], per_byte, dtype=torch.uint8,
                        device=packed.device)
    for i in range(per_byte):
        torch.bitwise_and(packed >> (i * bits), mask, out=codes[..., i])
    return codes.view(*packed.shape[:-1], packed.shape[-1] * per_byte)


def round_fp16(x: torch.Tensor, down: bool) -> torch.Tensor:
    """fp16 cast that never moves a value up (down=True) or down (down=False)."""
    y = x.to(SCALE_DTYPE)
    bad = (y.float() > x) if down else (y.float() < x)
    toward = torch.full_like(y, float("-inf") if down else float("inf"))
    return torch.where(bad, torch.nextafter(y, toward), y)


def quantize_asym(x: torch.Tensor, bits: int, reduce_dims: tuple[int, ...]):
    """Asymmetric min/max quantization; one (scale, zero) per slice reduced over `reduce_dims`.

    Returns (codes uint8, scale fp16, zero fp16), scale/zero keeping the reduced dims as size 1.
    The stored fp16 scale/zero are the ones used to compute codes, so decode is exact w.r.t. them.
    """
    check_bits(bits)
    return quantize_in_range(x, bits, x.amin(dim=reduce_dims, keepdim=True),
                             x.amax(dim=reduce_dims, keepdim=True))


def quantize_in_range(x: torch.Tensor, bits: int, lo: torch.Tensor, hi: torch.Tensor):
    """`quantize_asym` with each slice's min and max given (lo, hi broadcast against x): a
    caller quantizing several channel bands of one tensor reduces it once, over contiguous
    rows (a reduction over a band's strided slice was 3x slower on the CPU)."""
    check_bits(bits)
    levels = (1 << bits) - 1
    # Round the fp16 zero down and the scale up, so [zero, zero + levels*scale] covers [lo, hi]
    # and no value is clamped by more than rounding.
    zero = round_fp16(lo, down=True)
    # Divided by a device tensor, not the int: torch on CUDA turns division by a Python scalar
    # into a multiply by its reciprocal (an ulp off, enough to move the fp16 scale now and
    # then); IEEE division keeps the bits of the CPU and of the GPU pack kernel (band_pack).
    span = (hi - zero.float()) / torch.full((), levels, dtype=torch.float32, device=x.device)
    scale = round_fp16(span.clamp_min(1e-8), down=False)
    codes = (x - zero.float()).div_(scale.float()).round_().clamp_(0, levels)  # one temporary
    return codes.to(torch.uint8), scale, zero


def quantize_absmax(x: torch.Tensor, bits: int, dim: int = -1):
    """Symmetric quantization with one fp16 scale per slice along `dim` (codes offset to unsigned)."""
    check_bits(bits)
    half = (1 << (bits - 1)) - 1
    scale = (x.abs().amax(dim=dim, keepdim=True) / half).clamp_min(1e-8).to(SCALE_DTYPE)
    codes = torch.round(x / scale.float()).clamp_(-half, half) + half
    return codes.to(torch.uint8), scale


def absmax_offset(bits: int) -> int:
    return (1 << (bits - 1)) - 1
