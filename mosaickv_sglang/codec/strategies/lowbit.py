"""Low-bit values over all channels, KIVI-style (arXiv:2402.02750): asymmetric min/max codes,
K with one (scale, zero) per channel over groups of `group` tokens (K outliers live in channels),
V with one (scale, zero) per token. `k_axis`/`v_axis` override that ('channel' or 'token').
With rot=1 it quantizes in the SVD basis. Scores and outputs are computed on the codes:
q.(s*c + z) = (q*s).c + q.z, so nothing is dequantized to a dense [S, D] tensor."""
from __future__ import annotations

import torch

from ..quant import check_bits, pack_codes, quantize_asym, quantize_in_range, unpack_codes
from .base import Encoded, Strategy, Tensors, register

AXES = ("channel", "token")


def channel_group_bounds(x: torch.Tensor, group: int):
    """x [H, S, C] -> (min, max) per channel per group of `group` tokens, each [H, S/group, 1, C]."""
    h, s, c = x.shape
    if s % group:
        raise ValueError(f"segment of {s} tokens is not a multiple of group={group}")
    grouped = x.reshape(h, s // group, group, c)
    return grouped.amin(2, keepdim=True), grouped.amax(2, keepdim=True)


def quantize_channel_groups(x: torch.Tensor, bits: int, group: int, bounds=None):
    """x [H, S, C] -> codes [H, S, C], scale/zero [H, S/group, C]: one pair per channel per group.
    `bounds`: x's `channel_group_bounds` when the caller has them (Band reduces all its channels
    once and slices them per band)."""
    h, s, c = x.shape
    lo, hi = bounds if bounds is not None else channel_group_bounds(x, group)
    codes, scale, zero = quantize_in_range(x.reshape(h, s // group, group, c), bits, lo, hi)
    return codes.reshape(h, s, c), scale.squeeze(2), zero.squeeze(2)


def channel_groups_decode(codes, scale, zero, out: torch.Tensor | None = None) -> torch.Tensor:
    """scale * code + zero per channel group, float32 [H, S, C], written into `out` (e.g. a
    channel slice of a reconstruction) when given: no temporaries besides the result."""
    h, s, c = codes.shape
    n = scale.shape[1]
    out = torch.empty(h, s, c, device=codes.device) if out is None else out
    grouped = out.view(h, n, s // n, c)
    torch.mul(codes.reshape(h, n, s // n, c), scale.float()[:, :, None], out=grouped)
    grouped.add_(zero.float()[:, :, None])
    return out


def channel_groups_qk(codes, scale, zero, q) -> torch.Tensor:
    """sum_c q_c (scale_c code_c + zero_c) = (q*scale).code + q.zero, per token group."""
    h, s, c = codes.shape
    n = scale.shape[1]
    qs = q[:, :, None, :] * scale[:, None]  # [H, G, n, C]
    sc = torch.einsum("hgnc,hnkc->hgnk", qs, codes.reshape(h, n, s // n, c))
    return (sc + torch.einsum("hgc,hnc->hgn", q, zero)[..., None]).reshape(h, q.shape[1], s)


def channel_groups_pv(codes, scale, zero, p) -> torch.Tensor:
    h, s, c = codes.shape
    n = scale.shape[1]
    pg = p.reshape(h, p.shape[1], n, s // n)
    acc = torch.einsum("hgnk,hnkc->hgnc", pg, codes.reshape(h, n, s // n, c))
    return (acc * scale[:, None]).sum(2) + torch.einsum("hgn,hnc->hgc", pg.sum(-1), zero)


@register
class LowBit(Strategy):
    name = "lowbit"
    id = 0  # fixed: segment headers carry it
    params = {"bits": (int, 4), "group": (int, 32), "k_axis": (str, "channel"),
              "v_axis": (str, "token")}
    default_rot = False

    def validate(self) -> None:
        check_bits(self.bits)
        if self.group < 1:
            raise ValueError(f"lowbit group={self.group} must be >= 1")
        for key in ("k_axis", "v_axis"):
            if getattr(self, key) not in AXES:
                raise ValueError(f"lowbit {key}='{getattr(self, key)}' must be one of {AXES}")

    def axis(self, kind: str) -> str:
        return self.k_axis if kind == "k" else self.v_axis

    def encode(self, x: torch.Tensor, kind: str) -> Tensors:
        if self.axis(kind) == "channel":
            codes, scale, zero = quantize_channel_groups(x, self.bits, self.group)
        else:
            codes, scale, zero = quantize_asym(x, self.bits, (2,))
            scale, zero = scale.squeeze(2), zero.squeeze(2)
        # channel axis: scale/zero [H, S/group, D]; token axis: [H, S]
        return {"codes": pack_codes(codes, self.bits), "scale": scale, "zero": zero}

    def _parts(self, e: Encoded):
        t = e.tensors
        codes = unpack_codes(t["codes"], self.bits).float()
        return codes, t["scale"].float(), t["zero"].float()

    def decode(self, e: Encoded) -> torch.Tensor:
        codes, scale, zero = self._parts(e)
        if self.axis(e.kind) == "channel":
            return channel_groups_decode(codes, scale, zero)
        return codes * scale[..., None] + zero[..., None]

    def qk(self, e: Encoded, q: torch.Tensor) -> torch.Tensor:
        codes, scale, zero = self._parts(e)
        q = q.float()
        if self.axis(e.kind) == "channel":
            return channel_groups_qk(codes, scale, zero, q)
        dots = torch.einsum("hgd,hsd->hgs", q, codes)
        return dots * scale[:, None] + q.sum(-1, keepdim=True) * zero[:, None]

    def pv(self, e: Encoded, p: torch.Tensor) -> torch.Tensor:
        codes, scale, zero = self._parts(e)
        p = p.float()
        if self.axis(e.kind) == "channel":
            return channel_groups_pv(codes, scale, zero, p)
        return torch.einsum("hgs,hsd->hgd", p * scale[:, None], codes) + \
            (p * zero[:, None]).sum(-1, keepdim=True)
