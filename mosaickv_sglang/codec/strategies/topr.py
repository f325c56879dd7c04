"""Per-vector top-r (MosaicKV's channel dimension): in the SVD basis, each vector keeps its own r
largest-magnitude coordinates: r values (channel order) plus where they sit, either as r uint8
indices (8r bits) or as a D-bit bitmap; index='auto' keeps the cheaper one (bitmap once r > D/8).
Values in bf16, fp8, or int8/int4 with a per-vector scale. q.k is a gather of q at the kept
channels, p.v a scatter-add into them."""
from __future__ import annotations

import torch

from ..quant import pack_codes, unpack_codes
from .base import Encoded, Strategy, Tensors, _device, register

INDEX_FORMATS = ("auto", "u8", "bitmap")
from .values import check_format, decode_values, encode_values


@register
class TopR(Strategy):
    name = "topr"
    id = 4  # fixed: segment headers carry it
    params = {"r": (int, 16), "val": (str, "bf16"), "index": (str, "auto")}
    default_rot = True

    def validate(self) -> None:
        if self.r < 1:
            raise ValueError(f"topr r={self.r} must be >= 1")
        check_format(self.val)
        if self.index not in INDEX_FORMATS:
            raise ValueError(f"topr index='{self.index}' must be one of {INDEX_FORMATS}")

    def encode(self, x: torch.Tensor, kind: str) -> Tensors:
        if self.r > x.shape[-1] or x.shape[-1] > 256:
            raise ValueError(f"topr r={self.r} needs r <= head_dim <= 256 (head_dim {x.shape[-1]})")
        idx = x.abs().topk(self.r, dim=-1).indices.sort(-1).values
        kept = torch.gather(x, 2, idx)
        d = x.shape[-1]
        use_bitmap = self.index == "bitmap" or (self.index == "auto" and 8 * self.r > d)
        if use_bitmap:
            mask = torch.zeros(x.shape, dtype=torch.uint8, device=x.device).scatter_(2, idx, 1)
            where = {"bitmap": pack_codes(mask, 1)}
        else:
            where = {"index": idx.to(torch.uint8)}
        return {**where, **encode_values(kept, self.val)}

    def channels(self, e: Encoded) -> torch.Tensor:
        """Kept channel ids [H, S, r] (ascending), from whichever index format was stored."""
        if "index" in e.tensors:
            return e.tensors["index"].long()
        h, s, _ = e.shape
        mask = unpack_codes(e.tensors["bitmap"], 1)
        return torch.nonzero(mask)[:, -1].reshape(h, s, self.r)

    def decode(self, e: Encoded) -> torch.Tensor:
        h, s, d = e.shape
        out = torch.zeros(h, s, d, device=_device(e))
        return out.scatter_(2, self.channels(e), decode_values(e.tensors, self.val))

    def qk(self, e: Encoded, q: torch.Tensor) -> torch.Tensor:
        h, s, _ = e.shape
        idx = self.channels(e)  # [H, S, r]
        g = q.shape[1]
        qg = torch.gather(q.float()[:, :, None, :].expand(-1, -1, s, -1), 3,
                          idx[:, None].expand(-1, g, -1, -1))  # [H, G, S, r]
        return (qg * decode_values(e.tensors, self.val)[:, None]).sum(-1)

    def pv(self, e: Encoded, p: torch.Tensor) -> torch.Tensor:
        h, s, d = e.shape
        g = p.shape[1]
        idx = self.channels(e)
        contrib = p.float()[..., None] * decode_values(e.tensors, self.val)[:, None]  # [H,G,S,r]
        out = torch.zeros(h, g, d, device=p.device)
        return out.scatter_add_(2, idx[:, None].expand(-1, g, -1, -1).reshape(h, g, -1),
                                contrib.reshape(h, g, -1))
