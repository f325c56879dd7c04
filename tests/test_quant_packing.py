"""Bit packing and the fp16-scaled quantizers of mosaickv_sglang.codec.quant."""
from __future__ import annotations

import pytest
import torch

from mosaickv_sglang.codec.quant import (PACK_BITS, QUANT_BITS, SCALE_DTYPE, absmax_offset,
                                         pack_codes, quantize_absmax, quantize_asym, round_fp16,
                                         unpack_codes)

from conftest import assert_finite, repro

FP32_SLACK = 1e-5  # relative float32 slack on top of the half-step bound


def _random_shape(last_multiple: int) -> tuple[int, ...]:
    lead = [int(torch.randint(1, 5, ()).item()) for _ in range(int(torch.randint(0, 3, ()).item()))]
    n = last_multiple * int(torch.randint(1, 9, ()).item())
    return (*lead, n)


@pytest.mark.parametrize("bits", PACK_BITS)
@pytest.mark.parametrize("trial", range(3))
def test_pack_unpack_round_trip(bits, trial, seed):
    per_byte = 8 // bits
    shape = _random_shape(per_byte)
    codes = torch.randint(0, 1 << bits, shape, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8, repro(seed)
    assert packed.shape == (*shape[:-1], shape[-1] // per_byte), f"{packed.shape} {repro(seed)}"
    # exactly n * bits / 8 bytes
    assert packed.numel() * packed.element_size() == codes.numel() * bits // 8, repro(seed)
    back = unpack_codes(packed, bits)
    assert back.dtype == torch.uint8 and back.shape == codes.shape, repro(seed)
    assert torch.equal(back, codes), f"{bits}-bit round trip differs {repro(seed)}"


@pytest.mark.parametrize("bits", (1, 2, 4))
def test_pack_layout_little_end_first(bits, seed):
    """Code i of a byte sits at bit offset i*bits (what a kernel's shift-and-mask assumes)."""
    per_byte = 8 // bits
    codes = torch.randint(0, 1 << bits, (3, per_byte * 4), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    grouped = codes.reshape(3, 4, per_byte).long()
    expected = sum(grouped[..., i] << (i * bits) for i in range(per_byte))
    assert torch.equal(packed.long(), expected), repro(seed)


@pytest.mark.parametrize("bits", (1, 2, 4, 8))
def test_pack_accepts_wider_int_inputs(bits, seed):
    codes = torch.randint(0, 1 << bits, (2, 16), dtype=torch.int64)
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits).long(), codes), repro(seed)


@pytest.mark.parametrize("bits", (0, 3, 5, 6, 7, 16, -1))
def test_bad_pack_bits_raise(bits):
    codes = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"{bits}-bit"):
        pack_codes(codes, bits)
    with pytest.raises(ValueError, match=rf"{bits}-bit"):
        unpack_codes(codes, bits)


@pytest.mark.parametrize("bits,n", [(1, 7), (1, 12), (2, 6), (2, 3), (4, 5), (4, 1)])
def test_pack_non_multiple_length_raises(bits, n):
    codes = torch.zeros(3, n, dtype=torch.uint8)
    with pytest.raises(ValueError) as info:
        pack_codes(codes, bits)
    msg = str(info.value)
    assert str(n) in msg and "multiple" in msg and str(8 // bits) in msg, msg


@pytest.mark.parametrize("bits", (0, 1, 3, 16))
def test_quantizers_reject_bad_bits(bits, seed):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=rf"bits={bits}"):
        quantize_asym(x, bits, (1,))
    with pytest.raises(ValueError, match=rf"bits={bits}"):
        quantize_absmax(x, bits)


def _asym_case(bits: int, reduce_dims: tuple[int, ...], seed: int, x: torch.Tensor):
    levels = (1 << bits) - 1
    codes, scale, zero = quantize_asym(x, bits, reduce_dims)
    assert codes.dtype == torch.uint8 and scale.dtype == SCALE_DTYPE and zero.dtype == SCALE_DTYPE
    assert int(codes.max()) <= levels, repro(seed)
    for d in range(x.dim()):
        expect = 1 if d in reduce_dims else x.shape[d]
        assert scale.shape[d] == expect and zero.shape[d] == expect, repro(seed)
    dec = codes.float() * scale.float() + zero.float()
    assert_finite(dec, "asym decode", seed)
    err = (dec - x).abs()
    bound = 0.5 * scale.float() * (1 + FP32_SLACK) + FP32_SLACK * x.abs()
    worst = float((err - bound).max())
    assert worst <= 0, (f"{bits}-bit asym error exceeds half a step by {worst:.3e} "
                        f"(max err {float(err.max()):.3e}) {repro(seed)}")


@pytest.mark.parametrize("bits", QUANT_BITS)
@pytest.mark.parametrize("reduce_dims", [(1,), (2,), (1, 2)])
def test_quantize_asym_half_step(bits, reduce_dims, seed):
    """Zero-centred data: every decoded value is within half a (stored fp16) step."""
    x = torch.randn(3, 32, 16) * torch.rand(3, 1, 16).add(0.1) * 4
    _asym_case(bits, reduce_dims, seed, x)


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_quantize_asym_half_step_offset_groups(bits, seed):
    """Offset groups (e.g. a K channel sitting at +10): min just above an fp16 grid point."""
    ulp = 2.0 ** -7  # fp16 spacing in [8, 16)
    base = 8 + ulp * torch.randint(1, 800, (2, 1, 8)).float()
    lo = base + 0.6 * ulp  # fp16 rounds this *up* (to base + ulp), 0.4 ulp above the true min
    span = 0.25 * ulp * ((1 << bits) - 1)  # half a step is then 0.125 ulp
    x = lo + torch.rand(2, 32, 8) * span
    x[:, 0] = lo[:, 0]  # the min is attained
    _asym_case(bits, (1,), seed, x)


@pytest.mark.parametrize("bits", QUANT_BITS)
@pytest.mark.parametrize("dim", (-1, 1, 0))
def test_quantize_absmax_half_step(bits, dim, seed):
    half = absmax_offset(bits)
    assert half == (1 << (bits - 1)) - 1
    x = torch.randn(4, 24, 16) * torch.rand(4, 24, 1).add(0.05) * 10
    codes, scale = quantize_absmax(x, bits, dim)
    assert codes.dtype == torch.uint8 and scale.dtype == SCALE_DTYPE, repro(seed)
    assert scale.shape[dim] == 1, repro(seed)
    assert int(codes.max()) <= 2 * half, repro(seed)
    dec = (codes.float() - half) * scale.float()
    assert_finite(dec, "absmax decode", seed)
    err = (dec - x).abs()
    bound = 0.5 * scale.float() * (1 + FP32_SLACK) + FP32_SLACK * x.abs()
    worst = float((err - bound).max())
    assert worst <= 0, f"{bits}-bit absmax error exceeds half a step by {worst:.3e} {repro(seed)}"
    # symmetric: the decoded range never exceeds the slice's absmax by more than half a step
    assert float((dec.abs() - x.abs().amax(dim, keepdim=True) - bound).max()) <= 0, repro(seed)


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_constant_and_zero_slices_decode_finitely(bits, seed):
    c = float(torch.randn(()))
    x = torch.full((2, 8, 16), c)
    x[1] = 0.0
    codes, scale, zero = quantize_asym(x, bits, (1, 2))
    dec = codes.float() * scale.float() + zero.float()
    assert_finite(dec, "asym decode of constant slices", seed)
    assert float((dec - x).abs().max()) <= abs(c) * 2 ** -10, repro(seed)  # fp16 zero rounding
    codes, scale = quantize_absmax(x, bits)
    dec = (codes.float() - absmax_offset(bits)) * scale.float()
    assert_finite(dec, "absmax decode of constant slices", seed)
    assert float((dec - x).abs().max()) <= abs(c) / (1 << bits), repro(seed)


@pytest.mark.parametrize("down", (True, False))
def test_round_fp16_is_directed(down, seed):
    """Directed fp16 rounding (zero points, scales, page bounds): never up (down=True) or never
    down, and at most one fp16 step away; values beyond fp16 range go to +-65504 or +-inf."""
    x = torch.randn(4096) * torch.exp(torch.randn(4096) * 4)
    x[:3] = torch.tensor([0.0, 1e5, -1e5])
    y = round_fp16(x, down=down)
    assert y.dtype == SCALE_DTYPE, repro(seed)
    yd = y.double()
    ok = (yd <= x.double()) if down else (yd >= x.double())
    assert bool(ok.all()), f"{int((~ok).sum())} values rounded the wrong way {repro(seed)}"
    inside = x.abs() <= 65504  # fp16 range; outside it saturates (finite side) or goes to inf
    assert bool(torch.isfinite(y)[inside].all()), repro(seed)
    step = torch.maximum(x.double().abs() * 2 ** -10, torch.tensor(2.0 ** -24))
    assert bool(((yd - x.double()).abs() <= step)[inside].all()), repro(seed)
    big = (x.abs() > 65504) & ((x > 0) == down)  # rounded toward zero: saturates at 65504
    assert bool((y[big].double().abs() == 65504).all()), repro(seed)
