"""Dense: every element kept (bf16, or fp8 for a cheap 2x). The sink segment and outlier-heavy
segments stay here; it is also the chooser's answer when nothing cheaper meets the budget."""
from __future__ import annotations

import torch

from .base import Encoded, Strategy, Tensors, register
from .values import check_format, decode_values, encode_values


@register
class Dense(Strategy):
    name = "dense"
    id = 2  # fixed: segment headers carry it
    params = {"val": (str, "bf16")}
    default_rot = False

    def validate(self) -> None:
        check_format(self.val)

    def encode(self, x: torch.Tensor, kind: str) -> Tensors:
        return encode_values(x, self.val)

    def decode(self, e: Encoded) -> torch.Tensor:
        return decode_values(e.tensors, self.val)

    def qk(self, e: Encoded, q: torch.Tensor) -> torch.Tensor:
        return torch.einsum("hgd,hsd->hgs", q.float(), decode_values(e.tensors, self.val))

    def pv(self, e: Encoded, p: torch.Tensor) -> torch.Tensor:
        return torch.einsum("hgs,hsd->hgd", p.float(), decode_values(e.tensors, self.val))
