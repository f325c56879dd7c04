"""Banded bit allocation in the SVD basis (transform coding): after rotation, channels are
sorted by energy, so the leading `b8` channels get 8-bit codes, the next `b4` 4-bit, the next
`b2` 2-bit, and the tail (least energy) is dropped; a shared channel mask with graded precision.
Each band keeps one fp16 (scale, zero) per channel per `group` tokens, for K and V alike (in the
rotated basis per-channel ranges are well defined for both). For a Gaussian source this is the
classic reverse water-filling answer to "fewest bits for a given error", which per-vector top-r
and uniform KIVI only approximate; bands are fixed per strategy so a kernel tiles them plainly.
Band widths are given per 64 channels and scale with head_dim (b4=60 means 120 at D=128)."""
from __future__ import annotations

import torch

from ..quant import pack_codes, unpack_codes
from .base import Encoded, Strategy, Tensors, _device, register
from .lowbit import (channel_group_bounds, channel_groups_decode, channel_groups_pv,
                     channel_groups_qk, quantize_channel_groups)

BAND_BITS = (8, 4, 2)
UNIT = 64  # band widths are per this many channels


@register
class Band(Strategy):
    name = "band"
    id = 1  # fixed: segment headers carry it
    params = {"b8": (int, 8), "b4": (int, 24), "b2": (int, 16), "group": (int, 64)}
    default_rot = True

    def validate(self) -> None:
        for bits in BAND_BITS:
            n = getattr(self, f"b{bits}")
            if n < 0 or (n * bits) % 8:
                raise ValueError(f"band b{bits}={n}: must be >= 0 with b{bits}*{bits} a multiple of 8")
        if self.group < 1:
            raise ValueError(f"band group={self.group} must be >= 1")

    def validate_dims(self, head_dim: int) -> None:
        if head_dim % UNIT or sum(getattr(self, f"b{b}") for b in BAND_BITS) > UNIT:
            raise ValueError(f"band {self.spec}: widths are per {UNIT} channels (sum <= {UNIT}) "
                             f"and head_dim must be a multiple of {UNIT}, got {head_dim}")

    def bands(self, head_dim: int = UNIT):
        """(first channel, channels, bits) for each non-empty band, leading channels first."""
        scale = head_dim // UNIT
        start = 0
        for bits in BAND_BITS:
            n = getattr(self, f"b{bits}") * scale
            if n:
                yield start, n, bits
                start += n

    def widths(self, head_dim: int) -> tuple[int, int, int, int]:
        """(8-bit, 4-bit, 2-bit channels, token group) at head_dim: what the kernels compile
        (band_pack, band_errors)."""
        self.validate_dims(head_dim)
        scale = head_dim // UNIT
        return self.b8 * scale, self.b4 * scale, self.b2 * scale, self.group

    def encode(self, x: torch.Tensor, kind: str) -> Tensors:
        return self._encode(x, None)

    def encode_decoded(self, x: torch.Tensor, kind: str) -> tuple[Tensors, torch.Tensor]:
        decoded = self._reconstruction(x.shape, x.device)
        return self._encode(x, decoded), decoded

    def _encode(self, x: torch.Tensor, decoded: torch.Tensor | None) -> Tensors:
        """The bands' codes, scales and zeros (each channel's range over a token group reduced
        once for all bands); `decoded`, when given, gets each band rebuilt from its codes as
        `decode` rebuilds it from the packed ones (the codes are the same bytes)."""
        self.validate_dims(x.shape[-1])
        lo, hi = channel_group_bounds(x, self.group)
        out = {}
        for start, n, bits in self.bands(x.shape[-1]):
            band = slice(start, start + n)
            codes, scale, zero = quantize_channel_groups(x[..., band], bits, self.group,
                                                         (lo[..., band], hi[..., band]))
            if decoded is not None:
                channel_groups_decode(codes, scale, zero, out=decoded[..., band])
            out.update({f"codes{bits}": pack_codes(codes, bits), f"scale{bits}": scale,
                        f"zero{bits}": zero})
        return out

    def _reconstruction(self, shape, device) -> torch.Tensor:
        """float32 [H, S, D] for a reconstruction: the bands fill their channels, the dropped
        tail is zero."""
        out = torch.empty(shape, device=device)
        out[..., sum(n for _, n, _ in self.bands(shape[-1])):].zero_()
        return out

    def _band(self, e: Encoded, bits: int):
        t = e.tensors
        return (unpack_codes(t[f"codes{bits}"], bits).float(), t[f"scale{bits}"].float(),
                t[f"zero{bits}"].float())

    def decode(self, e: Encoded) -> torch.Tensor:
        out = self._reconstruction(e.shape, _device(e))
        for start, n, bits in self.bands(e.shape[-1]):
            t = e.tensors
            channel_groups_decode(unpack_codes(t[f"codes{bits}"], bits), t[f"scale{bits}"],
                                  t[f"zero{bits}"], out=out[..., start:start + n])
        return out

    def qk(self, e: Encoded, q: torch.Tensor) -> torch.Tensor:
        q = q.float()
        return sum(channel_groups_qk(*self._band(e, bits), q[..., start:start + n])
                   for start, n, bits in self.bands(e.shape[-1]))

    def pv(self, e: Encoded, p: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(e.shape[0], p.shape[1], e.shape[2], device=p.device)
        for start, n, bits in self.bands(e.shape[-1]):
            out[..., start:start + n] = channel_groups_pv(*self._band(e, bits), p.float())
        return out
