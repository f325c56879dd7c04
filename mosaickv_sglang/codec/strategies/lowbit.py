"""Low-bit values over all channels, KIVI-style (arXiv:2402.02750): asymmetric min/max codes,
K with one (scale, zero) per channel over groups of `group` tokens (K outliers live in channels),
V with one (scale, zero) per token. `k_axis`/`v_axis` override that ('channel' or 'token').
With rot=1 it quantizes in the SVD basis. Scores and outputs are computed on the codes:
q.(s*c + z) = (q*s).c + q.z, so nothing is dequantized to a dense [S, D] tensor."""
from __future__ import annotations

import torch

from ..quant import check_bits, pack_codes, quantize_asym, unpack_codes
from .base import Encoded, Strategy, Tensors, register

AXES = ("channel", "token")


@register
class LowBit(Strategy):
    name = "lowbit"
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
        h, s, d = x.shape
        if self.axis(kind) == "channel":
            if s % self.group:
                raise ValueError(f"segment of {s} tokens is not a multiple of group={self.group}")
            codes, scale, zero = quantize_asym(x.reshape(h, s // self.group, self.group, d),
                                               self.bits, (2,))
            codes, scale, zero = codes.reshape(h, s, d), scale.squeeze(2), zero.squeeze(2)
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
        h, s, d = e.shape
        codes, scale, zero = self._parts(e)
        if self.axis(e.kind) == "channel":
            n = scale.shape[1]
            return (codes.reshape(h, n, s // n, d) * scale[:, :, None] + zero[:, :, None]).reshape(h, s, d)
        return codes * scale[..., None] + zero[..., None]

    def qk(self, e: Encoded, q: torch.Tensor) -> torch.Tensor:
        h, s, d = e.shape
        codes, scale, zero = self._parts(e)
        q = q.float()
        if self.axis(e.kind) == "channel":
            n = scale.shape[1]
            qs = q[:, :, None, :] * scale[:, None]  # [H, G, n, D]
            sc = torch.einsum("hgnd,hnkd->hgnk", qs, codes.reshape(h, n, s // n, d))
            return (sc + torch.einsum("hgd,hnd->hgn", q, zero)[..., None]).reshape(h, -1, s)
        dots = torch.einsum("hgd,hsd->hgs", q, codes)
        return dots * scale[:, None] + q.sum(-1, keepdim=True) * zero[:, None]

    def pv(self, e: Encoded, p: torch.Tensor) -> torch.Tensor:
        h, s, d = e.shape
        codes, scale, zero = self._parts(e)
        p = p.float()
        if self.axis(e.kind) == "channel":
            n = scale.shape[1]
            pg = p.reshape(h, p.shape[1], n, s // n)
            acc = torch.einsum("hgnk,hnkd->hgnd", pg, codes.reshape(h, n, s // n, d))
            return (acc * scale[:, None]).sum(2) + torch.einsum("hgn,hnd->hgd", pg.sum(-1), zero)
        return torch.einsum("hgs,hsd->hgd", p * scale[:, None], codes) + \
            (p * zero[:, None]).sum(-1, keepdim=True)
