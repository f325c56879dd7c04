"""Storage formats for the values a strategy keeps (fp32 for lossless fp32 caches, bf16, fp8, or
int8/int4 with a per-vector fp16 absmax scale)."""
from __future__ import annotations

import torch

from ..quant import absmax_offset, pack_codes, quantize_absmax, unpack_codes

VALUE_FORMATS = ("fp32", "bf16", "fp8", "int8", "int4")
FP8_MAX = 448.0


def check_format(fmt: str) -> None:
    if fmt not in VALUE_FORMATS:
        raise ValueError(f"val='{fmt}' is not a value format; use one of {VALUE_FORMATS}")


def encode_values(x: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """x [..., r] -> tensors to keep (scale per vector along the last axis for int formats)."""
    if fmt == "fp32":
        return {"values": x.float().contiguous()}
    if fmt == "bf16":
        return {"values": x.to(torch.bfloat16)}
    if fmt == "fp8":
        return {"values": x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)}
    bits = 8 if fmt == "int8" else 4
    codes, scale = quantize_absmax(x, bits)
    return {"values": pack_codes(codes, bits), "value_scale": scale}


def decode_values(t: dict[str, torch.Tensor], fmt: str) -> torch.Tensor:
    """Float32 view of the kept values (the compact [..., r] tensor, never the dense cache)."""
    if fmt in ("fp32", "bf16", "fp8"):
        return t["values"].float()
    bits = 8 if fmt == "int8" else 4
    codes = unpack_codes(t["values"], bits).float() - absmax_offset(bits)
    return codes * t["value_scale"].float()
