"""Vectors through per-row bases read in place: the decode step's rotations into and out of a
request's basis block, `y = x @ R^T` (a query into the K basis) or `y = x @ R (+ add)` (the
output back from the V basis), with each row's bf16 read transform R found through a pointer
table (`BasisTable`) instead of a stacked fp32 copy of every row's bases, made per layer.

Each row points at one basis block's `[M, H, D, D]` bf16 tensor (`codec.seal.BasisPair.whole`:
K layers, then V layers); `offset` picks the layer's `[H, D, D]` inside it (in D x D matrices).
A null pointer is the identity (a row without sealed pages). The products are fp32 FMAs
(`input_precision="ieee"`), like the fp32 matmul they replace; `rotate_rows_reference` is the
torch version on the same inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl


@dataclass
class BasisTable:
    """Each row's bases, by address, for one layer of a decode step."""
    ptrs: torch.Tensor  # int64 [R] on the device: each row's bf16 [M, H, D, D] tensor (0: identity)
    k_offset: int  # this layer's K bases in those tensors, in [D, D] matrices: layer * H
    v_offset: int  # this layer's V bases: (layers + layer) * H
    keep: list = field(default_factory=list, repr=False)  # the tensors the addresses point into


def check_bases(wholes: list[torch.Tensor | None], device) -> list[torch.Tensor]:
    """The bases tensors of `wholes` (None: the identity), checked for what the kernels assume:
    bf16, contiguous, on `device`. Host work only (no copy to the device)."""
    dev, bf16 = torch.device(device), torch.bfloat16
    if dev.type == "cuda" and dev.index is None:  # "cuda" names the current device: cuda:N
        dev = torch.device("cuda", torch.cuda.current_device())
    keep = [w for w in wholes if w is not None]
    for w in {id(w): w for w in keep}.values():  # each block once (rows share blocks)
        if w.dtype != bf16 or w.dim() != 4 or w.device != dev or not w.is_contiguous():
            raise ValueError(f"basis_pointers: bases must be contiguous bf16 [M, H, D, D] on "
                             f"{device}, got {w.dtype} {tuple(w.shape)} on {w.device}")
    return keep


def basis_pointers(wholes: list[torch.Tensor | None], device) -> tuple[torch.Tensor, list]:
    """(int64 [R] device addresses, the tensors kept) of each row's bases tensor (None: the
    identity), checked as `check_bases` does."""
    keep = check_bases(wholes, device)
    ptrs = [0 if w is None else w.data_ptr() for w in wholes]
    return torch.tensor(ptrs, dtype=torch.int64).to(device), keep


@triton.jit
def _rotate_rows(
    X,  # fp32 [R, H, G, D]
    PTRS,  # int64 [R]
    ADD,  # fp32 [R, H, G, D] (read only with HAS_ADD)
    Y,  # fp32 [R, H, G, D]
    offset, H, G,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BACK: tl.constexpr, HAS_ADD: tl.constexpr,
):
    """One program per (row, head, BLOCK_N output channels): all G query heads at once."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_g < G)[:, None]
    rows = (r * H + h) * G + offs_g
    addr = tl.load(PTRS + r)
    if addr == 0:
        y = tl.load(X + rows[:, None] * D + offs_n[None, :], mask=mask, other=0.0)
    else:
        x = tl.load(X + rows[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
        mat = addr.to(tl.pointer_type(tl.bfloat16)) + (offset + h) * D * D
        if BACK:  # y = x @ R: R[j, n]
            rt = tl.load(mat + offs_d[:, None] * D + offs_n[None, :])
        else:  # y = x @ R^T: R^T[j, n] = R[n, j]
            rt = tl.load(mat + offs_n[None, :] * D + offs_d[:, None])
        y = tl.dot(x, rt.to(tl.float32), input_precision="ieee")
    if HAS_ADD:
        y += tl.load(ADD + rows[:, None] * D + offs_n[None, :], mask=mask, other=0.0)
    tl.store(Y + rows[:, None] * D + offs_n[None, :], y, mask=mask)


def rotate_rows(x: torch.Tensor, ptrs: torch.Tensor, offset: int, *, back: bool,
                add: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x fp32 [R, H, G, D] -> y fp32 [R, H, G, D]: per row r and head h, with R_rh the bf16
    [D, D] matrix at `ptrs[r]` + (offset + h) D D elements (the identity where ptrs[r] == 0),
    y = x @ R_rh (`back`) or x @ R_rh^T, plus `add` when given. One launch, no host sync."""
    if x.dtype != torch.float32 or x.dim() != 4 or not x.is_contiguous():
        raise ValueError(f"rotate_rows: x must be contiguous fp32 [R, H, G, D], got {x.dtype} "
                         f"{tuple(x.shape)}")
    r, h, g, d = x.shape
    if d < 16 or d & (d - 1):
        raise ValueError(f"rotate_rows: head_dim {d} must be a power of two >= 16")
    if ptrs.dtype != torch.int64 or tuple(ptrs.shape) != (r,) or ptrs.device != x.device:
        raise ValueError(f"rotate_rows: ptrs must be int64 [{r}] on {x.device}, got "
                         f"{ptrs.dtype} {tuple(ptrs.shape)} on {ptrs.device}")
    if add is not None and (add.dtype != torch.float32 or add.shape != x.shape or
                            not add.is_contiguous()):
        raise ValueError(f"rotate_rows: add must be contiguous fp32 {tuple(x.shape)}")
    y = torch.empty_like(x) if out is None else out
    block_n = min(d, 64)
    if r:
        _rotate_rows[(r, h, d // block_n)](
            x, ptrs, x if add is None else add, y, offset, h, g, D=d,
            BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n, BACK=back,
            HAS_ADD=add is not None, num_warps=4)
    return y


def rotate_rows_reference(x: torch.Tensor, wholes: list[torch.Tensor | None], offset: int, *,
                          back: bool, add: torch.Tensor | None = None) -> torch.Tensor:
    """`rotate_rows` in torch, from the bases tensors themselves."""
    r, h, g, d = x.shape
    ys = []
    for i, w in enumerate(wholes):
        if w is None:
            ys.append(x[i])
            continue
        mats = w.view(-1, d, d)[offset:offset + h].float()  # [H, D, D]
        ys.append(x[i] @ (mats if back else mats.transpose(1, 2)))
    y = torch.stack(ys) if ys else x.clone()
    return y if add is None else y + add
