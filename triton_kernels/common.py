"""Helpers shared by the kernels: dots on tensor cores (fp32-accurate, or one bf16 / fp16 MMA),
launch flags, stores rounded as a GPU rounds them, and the packed layout's per-channel read plan
(`channel_plan`)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU): bf16 tl.dot is wrong there, see `dot_exact`."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def rounds_bf16_stores(dtype) -> bool:
    """A kernel storing float32 results into a `dtype` tensor must round them itself
    (`store_rounded`): the interpreter with a bf16 output, whose cast truncates (a GPU's
    rounds to nearest)."""
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def _round_bf16(x):
    """float32 -> the nearest bf16 value (ties to even), still as float32 (exact in bf16).
    Done on the bits because the interpreter's bf16 cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def store_rounded(x, ROUND_BF16: tl.constexpr):
    """`x` (float32) as a store into the output should see it: rounded to the nearest bf16 on
    the bits first where the interpreter's cast would truncate (`rounds_bf16_stores`)."""
    if ROUND_BF16:
        x = _round_bf16(x)
    return x


@triton.jit
def dot_exact(a, b, EMULATE: tl.constexpr):
    """a @ b in float32 where `b` (integer codes <= 255 or bf16 cache entries) is exact in bf16.

    `a` (float32) is split as hi + lo, two bf16 numbers, so two bf16 MMAs with fp32 accumulation
    give ~2^-17 relative accuracy per product instead of bf16's 2^-9. EMULATE runs the same two
    products on float32 operands holding the same values (the interpreter mis-computes bf16 dots).
    """
    hi = _round_bf16(a)
    lo = _round_bf16(a - hi)
    if EMULATE:
        bf = b.to(tl.float32)
        out = tl.dot(hi, bf) + tl.dot(lo, bf)
    else:
        bb = b.to(tl.bfloat16)
        out = tl.dot(hi.to(tl.bfloat16), bb) + tl.dot(lo.to(tl.bfloat16), bb)
    return out


@triton.jit
def dot_bf16(a, b, EMULATE: tl.constexpr):
    """a @ b as one bf16 MMA with float32 accumulation; `a` (float32) is rounded to bf16 (2^-9
    relative), `b` is exact in bf16. EMULATE takes the same values in float32."""
    if EMULATE:
        out = tl.dot(_round_bf16(a), b.to(tl.float32))
    else:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return out


@triton.jit
def dot_fp16(a, b, EMULATE: tl.constexpr):
    """a @ b as one fp16 MMA with float32 accumulation; `a` (float32, |a| < 65504) is rounded to
    fp16 (2^-11 relative), `b` is fp16. EMULATE rounds `a` the same way and multiplies in
    float32 (the interpreter's half-precision dots are not trusted, see `dot_exact`)."""
    if EMULATE:
        out = tl.dot(a.to(tl.float16).to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a.to(tl.float16), b.to(tl.float16))
    return out


@triton.jit
def channel_plan(plan, F16, base, group, tok0, ch, D: tl.constexpr, R_CODE: tl.constexpr,
                 R_ROW: tl.constexpr, R_SHIFT: tl.constexpr, R_MASK: tl.constexpr,
                 R_SCALE: tl.constexpr, R_ZERO: tl.constexpr, R_GROUP: tl.constexpr):
    """The layout's per-channel plan at channels `ch` (any shape): each code's byte offset in
    the head block, row stride, shift and mask (`keep`: not dropped), and the scale and zero of
    the token group of `tok0` (float32, 0 for dropped channels)."""
    code = tl.load(plan + R_CODE * D + ch)
    row = tl.load(plan + R_ROW * D + ch)
    shift = tl.load(plan + R_SHIFT * D + ch)
    bits = tl.load(plan + R_MASK * D + ch)
    keep = bits != 0
    goff = (tok0 // group) * tl.load(plan + R_GROUP * D + ch)
    f16 = F16 + base // 2
    scale = tl.load(f16 + (tl.load(plan + R_SCALE * D + ch) + goff) // 2, mask=keep,
                    other=0.0).to(tl.float32)
    zero = tl.load(f16 + (tl.load(plan + R_ZERO * D + ch) + goff) // 2, mask=keep,
                   other=0.0).to(tl.float32)
    return code, row, shift, bits, keep, scale, zero
