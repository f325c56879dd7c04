"""The packed arena's layout, defined where the kernels that read it live: the header and plan
columns the kernels index, and `PackedArena`, one layer of a batch as the decode kernels read
it. The package's codec (`mosaickv_sglang/codec/arena.py`) writes this layout and re-exports
these names; nothing here imports the package."""
from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 16  # bytes; every part and every (segment, head) block starts on this boundary
KIND_FIELDS = ("b8", "b4", "b2", "group",
               "codes8", "codes4", "codes2",
               "scale8", "zero8", "scale4", "zero4", "scale2", "zero2")
HEADER_FIELDS = (("tokens", "base16", "head_stride", "layout")
                 + tuple(f"k_{f}" for f in KIND_FIELDS) + tuple(f"v_{f}" for f in KIND_FIELDS))
# Per-channel read plan of a layout (`channel_plan`), one int32 row of head_dim per field.
PLAN_FIELDS = ("code", "row", "shift", "mask", "scale", "zero", "group_bytes", "unused")
HEADER_WIDTH = 32  # int32 columns per row (fields padded: one 128-byte line per segment)
HDR = {name: i for i, name in enumerate(HEADER_FIELDS)}  # column of each field
MAX_ARENA_BYTES = (2**31 - 1) * ALIGN  # base16 is int32


@dataclass
class PackedArena:
    """One layer of a batch, packed for the band decode kernel (the layout: the docstring of
    mosaickv_sglang/codec/arena.py, which writes it)."""
    data: torch.Tensor  # uint8 [N], N a multiple of 16
    headers: torch.Tensor  # int32 [num_segments, HEADER_WIDTH]
    seg_indptr: torch.Tensor  # int32 [B+1]
    seg_ids: torch.Tensor  # int32 [num_segments], request-major, in token order
    k_basis: torch.Tensor | None  # float32 [B, H, D, D] (q_rot = q @ k_basis), or None with
    v_basis: torch.Tensor | None  # `basis`; float32 [B, H, D, D] (out = acc_rot @ v_basis^T)
    hot_k: torch.Tensor  # bf16 [B, H, T_hot_max, D], zero padded
    hot_v: torch.Tensor
    hot_lens: torch.Tensor  # int32 [B]
    plans: torch.Tensor  # int32 [num_layouts, 2, len(PLAN_FIELDS), D], header 'layout' indexes
    segment_tokens: int
    page_tokens: int
    payload: dict[str, int]  # 'codes', 'scales': bytes copied from the Encoded tensors
    min_group: int = 32  # smallest K/V token group of any segment (kernels tile tokens by it)
    # instead of k_basis/v_basis: each row's bases read in place by address (decode only;
    # mosaickv_kernels.basis_rotate.BasisTable)
    basis: object | None = None
    # with hot_rows (int64 [B, T_hot_max]) hot_k/hot_v are the layer's hot buffers themselves,
    # bf16 [N, H, D], read in place: request b's hot token t is row hot_rows[b, t]
    hot_rows: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.seg_indptr.numel() - 1

    @property
    def num_kv_heads(self) -> int:
        return self.hot_k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.hot_k.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def segments_per_request(self) -> list[int]:
        return (self.seg_indptr[1:] - self.seg_indptr[:-1]).tolist()

    def pages_per_request(self) -> list[int]:
        ppseg = self.segment_tokens // self.page_tokens
        return [n * ppseg for n in self.segments_per_request()]

    def to(self, device) -> "PackedArena":
        if self.basis is not None or self.hot_rows is not None:
            raise ValueError("PackedArena.to: an arena reading bases by address or the hot "
                             "buffer in place cannot move devices")
        moved = {name: getattr(self, name).to(device) for name in
                 ("data", "headers", "seg_indptr", "seg_ids", "k_basis", "v_basis", "hot_k",
                  "hot_v", "hot_lens", "plans")}
        return PackedArena(**moved, segment_tokens=self.segment_tokens,
                           page_tokens=self.page_tokens, payload=dict(self.payload),
                           min_group=self.min_group)

    def byte_breakdown(self) -> dict[str, int]:
        """Bytes held, by kind, measured from the tensors: codes + scales + padding == arena."""
        out = dict(self.payload)
        out["padding"] = _nbytes(self.data) - out["codes"] - out["scales"]
        out["headers"] = _nbytes(self.headers) + _nbytes(self.plans)
        out["segment_lists"] = _nbytes(self.seg_indptr) + _nbytes(self.seg_ids)
        out["bases"] = 0 if self.k_basis is None else _nbytes(self.k_basis) + _nbytes(self.v_basis)
        out["hot"] = (_nbytes(self.hot_k) + _nbytes(self.hot_v) if self.hot_rows is None
                      else _nbytes(self.hot_rows)) + _nbytes(self.hot_lens)
        return out

    def nbytes(self) -> int:
        return sum(self.byte_breakdown().values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
