"""Decompress packed band segments into a dense workspace in the raw basis, for prefill (or any
dense attention) over a compressed prefix.

One program per (listed segment, KV head, block of tokens), K and V both: the codes are read
through the layout's per-channel plan (`arena.BlockLayout.channel_plan`: any layout mix in one
launch; a one-off cost per prefill, so generic gathers rather than band-specialized tiles),
dequantized with their token group's fp16 scale/zero, and rotated back with the request's read
transform: x_raw = x_rot @ basis^T (the arena keeps q_rot = q @ k_basis and out = o_rot @
v_basis^T, so k_raw = k_rot @ k_basis^T and v_raw = v_rot @ v_basis^T), a 3xTF32 tensor-core dot
(~fp32 accuracy). 16-token blocks: no register spills at D=128 (ptxas sm_90, 250 registers;
32-token blocks spill). Checked on the CPU interpreter only; not yet timed on a GPU.

    k_ws = torch.empty(n * T, H, D, dtype=torch.bfloat16, device="cuda")   # token-major
    unpack_segments(arena, seg_list, seg_req, k_ws, v_ws)    # row i*T + t: segment i, token t
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import rounds_bf16_stores, store_rounded
from .layout import HDR, HEADER_WIDTH, PLAN_FIELDS, PackedArena

PLAN_ROW = {name: i for i, name in enumerate(PLAN_FIELDS)}


@triton.jit
def _unpack_kind(ARENA_U8, ARENA_F16, plan, base, group, tok, offs_d, D: tl.constexpr,
                 PLAN_W: tl.constexpr, R_CODE: tl.constexpr, R_ROW: tl.constexpr,
                 R_SHIFT: tl.constexpr, R_MASK: tl.constexpr, R_SCALE: tl.constexpr,
                 R_ZERO: tl.constexpr, R_GROUP: tl.constexpr):
    """Dequantized [BLOCK_T, BLOCK_D] float32 tile of one kind (rotated basis); 0 for dropped
    or padding channels."""
    md = offs_d < D
    code = tl.load(plan + R_CODE * D + offs_d, mask=md, other=0)
    row = tl.load(plan + R_ROW * D + offs_d, mask=md, other=0)
    shift = tl.load(plan + R_SHIFT * D + offs_d, mask=md, other=0)
    bits = tl.load(plan + R_MASK * D + offs_d, mask=md, other=0)
    keep = (bits != 0)[None, :]
    raw = tl.load(ARENA_U8 + base + code[None, :] + tok[:, None] * row[None, :], mask=keep,
                  other=0)
    codes = (raw.to(tl.int32) >> shift[None, :]) & bits[None, :]
    goff = (tok // group)[:, None] * tl.load(plan + R_GROUP * D + offs_d, mask=md, other=0)[None, :]
    f16 = ARENA_F16 + base // 2
    s = tl.load(f16 + (tl.load(plan + R_SCALE * D + offs_d, mask=md, other=0)[None, :] + goff) // 2,
                mask=keep, other=0.0).to(tl.float32)
    z = tl.load(f16 + (tl.load(plan + R_ZERO * D + offs_d, mask=md, other=0)[None, :] + goff) // 2,
                mask=keep, other=0.0).to(tl.float32)
    return tl.where(keep, codes.to(tl.float32) * s + z, 0.0)


@triton.jit
def _rotate_store(x, BASIS, OUT, row0, ok_t, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_J: tl.constexpr, ROUND_BF16: tl.constexpr):
    """OUT[row0, :] = x @ BASIS^T (3xTF32), BLOCK_J output channels at a time (a whole [D, D]
    basis tile would not fit in registers). ROUND_BF16: the interpreter with a bf16 OUT, whose
    cast truncates (a GPU's rounds to nearest): rounded on the bits first."""
    md = offs_d < D
    for j0 in tl.static_range(0, BLOCK_D, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        mj = offs_j < D
        bt = tl.load(BASIS + offs_j[None, :] * D + offs_d[:, None],  # [c, j] = basis[j, c]
                     mask=md[:, None] & mj[None, :], other=0.0)
        out = store_rounded(tl.dot(x, bt, input_precision="tf32x3"), ROUND_BF16)
        tl.store(OUT + row0[:, None] * D + offs_j[None, :], out.to(OUT.dtype.element_ty),
                 mask=ok_t[:, None] & mj[None, :])


@triton.jit
def _unpack_segments(
    ARENA_U8, ARENA_F16, HEADERS, PLANS,
    SEG_LIST, SEG_REQ,  # int32 [n]: arena segment id and request (basis row) of each output
    K_BASIS, V_BASIS,  # fp32 [B, H, D, D]
    OUT_K, OUT_V,  # [n * T, H, D] (any float dtype)
    H, T,
    D: tl.constexpr, HDR_W: tl.constexpr, PLAN_W: tl.constexpr, BASE_COL: tl.constexpr,
    STRIDE_COL: tl.constexpr, LAYOUT_COL: tl.constexpr, K_GROUP_COL: tl.constexpr,
    V_GROUP_COL: tl.constexpr, R_CODE: tl.constexpr, R_ROW: tl.constexpr,
    R_SHIFT: tl.constexpr, R_MASK: tl.constexpr, R_SCALE: tl.constexpr, R_ZERO: tl.constexpr,
    R_GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    tok = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    seg = tl.load(SEG_LIST + i).to(tl.int64)
    req = tl.load(SEG_REQ + i).to(tl.int64)
    hdr = HEADERS + seg * HDR_W
    base = tl.load(hdr + BASE_COL).to(tl.int64) * 16 + h * tl.load(hdr + STRIDE_COL)
    plan = PLANS + tl.load(hdr + LAYOUT_COL).to(tl.int64) * (2 * PLAN_W * D)
    basis = (req * H + h) * D * D
    row0 = (i * T + tok) * H + h
    x = _unpack_kind(ARENA_U8, ARENA_F16, plan, base, tl.load(hdr + K_GROUP_COL), tok, offs_d, D,
                     PLAN_W, R_CODE, R_ROW, R_SHIFT, R_MASK, R_SCALE, R_ZERO, R_GROUP)
    _rotate_store(x, K_BASIS + basis, OUT_K, row0, tok < T, offs_d, D, BLOCK_D, BLOCK_J,
                  ROUND_BF16)
    x = _unpack_kind(ARENA_U8, ARENA_F16, plan + PLAN_W * D, base, tl.load(hdr + V_GROUP_COL),
                     tok, offs_d, D, PLAN_W, R_CODE, R_ROW, R_SHIFT, R_MASK, R_SCALE, R_ZERO,
                     R_GROUP)
    _rotate_store(x, V_BASIS + basis, OUT_V, row0, tok < T, offs_d, D, BLOCK_D, BLOCK_J,
                  ROUND_BF16)


def _check(arena: PackedArena, seg_list: torch.Tensor, seg_req: torch.Tensor, outs) -> int:
    if not isinstance(arena, PackedArena):
        raise TypeError(f"unpack_segments: arena must be a PackedArena, got "
                        f"{type(arena).__name__}")
    n = seg_list.numel()
    for name, t in (("seg_list", seg_list), ("seg_req", seg_req)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.numel() != n or t.device != arena.device:
            raise ValueError(f"unpack_segments: {name} must be int32 [{n}] on {arena.device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    shape = (n * arena.segment_tokens, arena.num_kv_heads, arena.head_dim)
    for name, t in zip(("out_k", "out_v"), outs):
        if tuple(t.shape) != shape or not t.is_contiguous() or not t.is_floating_point() or \
                t.device != arena.device:
            raise ValueError(f"unpack_segments: {name} must be a contiguous float tensor "
                             f"{list(shape)} on {arena.device}, got {t.dtype} {tuple(t.shape)}")
    return n


def unpack_segments(arena: PackedArena, seg_list: torch.Tensor, seg_req: torch.Tensor,
                    out_k: torch.Tensor, out_v: torch.Tensor, block_tokens: int = 16) -> None:
    """Write the raw-basis K and V of segments `seg_list` (arena segment ids; `seg_req` = the
    request whose basis each uses) to out_k / out_v [n * T, H, D] (token-major, row i*T + t)."""
    n = _check(arena, seg_list, seg_req, (out_k, out_v))
    if n == 0:
        return
    t, h, d = arena.segment_tokens, arena.num_kv_heads, arena.head_dim
    _unpack_segments[(n, h, triton.cdiv(t, block_tokens))](
        arena.data, arena.data.view(torch.float16), arena.headers, arena.plans, seg_list,
        seg_req, arena.k_basis, arena.v_basis, out_k, out_v, h, t,
        **_constants(d, block_tokens, rounds_bf16_stores(out_k.dtype)))


def _constants(head_dim: int, block_tokens: int = 16, round_bf16: bool = False) -> dict:
    """`_unpack_segments`' compile-time arguments at `head_dim`: what a launch passes and what
    `compile_variant` compiles ahead."""
    return dict(D=head_dim, HDR_W=HEADER_WIDTH, PLAN_W=len(PLAN_FIELDS), BASE_COL=HDR["base16"],
                STRIDE_COL=HDR["head_stride"], LAYOUT_COL=HDR["layout"],
                K_GROUP_COL=HDR["k_group"], V_GROUP_COL=HDR["v_group"], R_CODE=PLAN_ROW["code"],
                R_ROW=PLAN_ROW["row"], R_SHIFT=PLAN_ROW["shift"], R_MASK=PLAN_ROW["mask"],
                R_SCALE=PLAN_ROW["scale"], R_ZERO=PLAN_ROW["zero"],
                R_GROUP=PLAN_ROW["group_bytes"], BLOCK_T=block_tokens,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_J=32,
                ROUND_BF16=round_bf16, num_warps=4)


def compile_variant(heads: int, tokens: int, head_dim: int, out_dtype: torch.dtype) -> None:
    """Compile `_unpack_segments` now for the variant `unpack_segments` launches with these
    shapes (float32 bases, `out_dtype` outputs; Triton's `warmup`: nothing runs), so that the
    first chunk reading a compressed prefix does not stall on a compile (seconds: the 3.3 s
    `read_prefix` of the first 32K prompt's second chunk on an H100, 2026-12-06). CUDA only."""
    _unpack_segments.warmup(torch.uint8, torch.float16, torch.int32, torch.int32, torch.int32,
                            torch.int32, torch.float32, torch.float32, out_dtype, out_dtype,
                            heads, tokens, grid=(1, heads, 1),
                            **_constants(head_dim, round_bf16=rounds_bf16_stores(out_dtype)))


def decode_rotated_reference(arena: PackedArena, seg_list: torch.Tensor):
    """Torch oracle: (k_rot, v_rot) float32 [n, H, T, D] of the listed segments in their bases,
    read from the arena bytes through the layout plans (on the arena's device)."""
    h = arena.num_kv_heads
    hdr = arena.headers[seg_list.long()].long()  # [n, W]
    f16 = arena.data.view(torch.float16)
    dev = arena.device
    tok = torch.arange(arena.segment_tokens, device=dev)[None, None, :, None]
    base = (hdr[:, HDR["base16"]] * 16)[:, None, None, None] + \
        torch.arange(h, device=dev)[None, :, None, None] * \
        hdr[:, HDR["head_stride"]][:, None, None, None]  # [n, H, 1, 1]
    out = []
    for kind, group_col in ((0, "k_group"), (1, "v_group")):
        plan = arena.plans[hdr[:, HDR["layout"]], kind].long()  # [n, PLAN_W, D]
        pf = {name: plan[:, i][:, None, None, :] for i, name in enumerate(PLAN_FIELDS)}
        codes = (arena.data[base + pf["code"] + tok * pf["row"]].long() >> pf["shift"]) & pf["mask"]
        goff = (tok // hdr[:, HDR[group_col]][:, None, None, None]) * pf["group_bytes"]
        scale = f16[(base + pf["scale"] + goff) // 2].float()
        zero = f16[(base + pf["zero"] + goff) // 2].float()
        out.append(torch.where(pf["mask"] > 0, codes * scale + zero, 0.0))
    return out[0], out[1]


def unpack_segments_reference(arena: PackedArena, seg_list: torch.Tensor,
                              seg_req: torch.Tensor):
    """Torch oracle of `unpack_segments`: float32 (k, v) [n * T, H, D] in the raw basis."""
    k_rot, v_rot = decode_rotated_reference(arena, seg_list)
    req = seg_req.long()
    k = k_rot @ arena.k_basis[req].transpose(-1, -2)  # [n, H, T, D]
    v = v_rot @ arena.v_basis[req].transpose(-1, -2)
    n, h, t, d = k.shape
    return (k.permute(0, 2, 1, 3).reshape(n * t, h, d),
            v.permute(0, 2, 1, 3).reshape(n * t, h, d))
