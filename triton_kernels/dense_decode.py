"""Dense decode partial over the hot buffer: per (request, KV head) the softmax partial
(max, sum, unnormalized acc) of all G query heads of the group over a padded bf16 buffer, or
over the hot buffer itself through a row table (no gathered copy).

The partial is merged with the packed segments' partials by `band_decode` stage 2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_exact, interpreting


@triton.jit
def _dense_decode_partial(
    Q,  # fp32 [B, H, G, D], pre-scaled, raw basis
    K, V,  # bf16 [B, H, T, D] (T = padded hot length), or with INDEXED the buffers [N, H, D]
    LENS,  # int32 [B] valid hot tokens per request
    ROWS,  # int64 [B, T]: each token's row of K/V (read only with INDEXED)
    M, L, ACC,  # fp32 [B, H, G], [B, H, G], [B, H, G, D]
    H, T,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    EMULATE: tl.constexpr, INDEXED: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g, mask_d = offs_g < G, offs_d < D
    bh = b * H + h
    q = tl.load(Q + (bh * G + offs_g[:, None]) * D + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    n = tl.load(LENS + b)
    if INDEXED:
        kv, vv = K + h * D, V + h * D
    else:
        kv, vv = K + bh * T * D, V + bh * T * D

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, n, BLOCK_N):
        tok = start + offs_n
        ok = tok < n
        if INDEXED:  # the token's row of the buffers: [N, H, D], rows H * D apart
            row = tl.load(ROWS + b * T + tok, mask=ok, other=0)
            tile = row[:, None] * (H * D) + offs_d[None, :]
        else:
            tile = tok[:, None] * D + offs_d[None, :]
        k = tl.load(kv + tile, mask=ok[:, None] & mask_d[None, :], other=0.0)
        s = dot_exact(q, tl.trans(k), EMULATE)  # [G, N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(vv + tile, mask=ok[:, None] & mask_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + dot_exact(p, v, EMULATE)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    out = bh * G + offs_g
    tl.store(M + out, m, mask=mask_g)
    tl.store(L + out, l, mask=mask_g)
    tl.store(ACC + out[:, None] * D + offs_d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])


def dense_decode_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                         out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                         rows: torch.Tensor | None = None):
    """q fp32 [B, H, G, D] (pre-scaled), k/v bf16 [B, H, T, D], lens int32 [B] ->
    (m [B, H, G], l [B, H, G], acc [B, H, G, D]) float32; m = -inf, l = 0 where lens is 0.
    With `rows` (int64 [B, T]), k/v are the hot buffers themselves, bf16 [N, H, D], read in
    place: request b's token t is row rows[b, t] (no gathered copy)."""
    if q.dim() != 4 or q.dtype != torch.float32 or not q.is_contiguous():
        raise ValueError(f"dense_decode_partial: q must be contiguous float32 [B, H, G, D], "
                         f"got {q.dtype} {tuple(q.shape)}")
    bsz, h, g, d = q.shape
    for name, t in (("k", k), ("v", v)):
        if rows is not None:
            if t.dtype != torch.bfloat16 or t.dim() != 3 or tuple(t.shape[1:]) != (h, d) \
                    or not t.is_contiguous():
                raise ValueError(f"dense_decode_partial: with rows, {name} must be contiguous "
                                 f"bf16 [N, {h}, {d}], got {t.dtype} {tuple(t.shape)}")
        elif t.dtype != torch.bfloat16 or t.dim() != 4 or tuple(t.shape[:2]) != (bsz, h) \
                or t.shape[3] != d or not t.is_contiguous():
            raise ValueError(f"dense_decode_partial: {name} must be contiguous bf16 "
                             f"[{bsz}, {h}, T, {d}], got {t.dtype} {tuple(t.shape)}")
    if rows is not None and (rows.dtype != torch.int64 or rows.dim() != 2 or
                             rows.shape[0] != bsz or not rows.is_contiguous()):
        raise ValueError(f"dense_decode_partial: rows must be contiguous int64 [{bsz}, T], got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    if lens.dtype != torch.int32 or tuple(lens.shape) != (bsz,):
        raise ValueError(f"dense_decode_partial: lens must be int32 [{bsz}], got "
                         f"{lens.dtype} {tuple(lens.shape)}")
    if out is None:
        out = (q.new_empty(bsz, h, g), q.new_empty(bsz, h, g), q.new_empty(bsz, h, g, d))
    m, l, acc = out
    _dense_decode_partial[(bsz, h)](
        q, k, v, lens, lens if rows is None else rows, m, l, acc, h,
        k.shape[2] if rows is None else rows.shape[1], G=g, D=d,
        BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=32, EMULATE=interpreting(), INDEXED=rows is not None, num_warps=4)
    return m, l, acc


def dense_decode_partial_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   lens: torch.Tensor, rows: torch.Tensor | None = None):
    """`dense_decode_partial` in torch (float32 products), both layouts."""
    bsz, h, g, d = q.shape
    m = torch.full((bsz, h, g), float("-inf"), device=q.device)
    l = torch.zeros(bsz, h, g, device=q.device)
    acc = torch.zeros(bsz, h, g, d, device=q.device)
    for b in range(bsz):
        n = int(lens[b])
        if not n:
            continue
        kb = (k[rows[b, :n]].transpose(0, 1) if rows is not None else k[b, :, :n]).float()
        vb = (v[rows[b, :n]].transpose(0, 1) if rows is not None else v[b, :, :n]).float()
        s = q[b] @ kb.transpose(1, 2)  # [H, G, n]
        m[b] = s.amax(-1)
        p = torch.exp(s - m[b][..., None])
        l[b] = p.sum(-1)
        acc[b] = p @ vb
    return m, l, acc
