"""A prefill chunk's attention: its queries over the request's compressed prefix (read back)
and its own dense tokens, under the read rule (`chunk_attention`), through one of two kernels
(`extend_attention`: torch SDPA, or FlashInfer's single-request prefill on CUDA; config
`prefill_attention`, resolved by `prefill_attention_kernel`). No SGLang import:
the attention backend calls it, and so do its tests and `benchmarks/prefill_attention_bench.py`
on a machine without SGLang.
"""
from __future__ import annotations

import logging

import torch
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention

logger = logging.getLogger(__name__)


def extend_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scale: float, kernel: str = "sdpa") -> torch.Tensor:
    """Causal attention of a request's n new tokens over its whole sequence: q [Hq, n, D], keys
    and values [Hk, S, D] (the new tokens last) -> [Hq, n, D] (any strides with the last dim
    contiguous). A fresh prompt (n == S) is plain causal; a chunk after a prefix is causal
    aligned to the bottom right (new token i sees keys 0 .. S - n + i).

    `kernel` "flashinfer": FlashInfer's single-request prefill (CUDA; GQA and the bottom-right
    mask inside the kernel; keys passed as token-major views, no copy: in 0.6.15 its sm90 (FA3)
    path reads HND keys' head count and length as if they were NHD, a division by zero).
    "sdpa": torch's SDPA, the bottom-right mask as `causal_lower_right` on its efficient kernel
    without materializing an [n, S] mask (at a 128K prompt in 8K chunks that mask, broadcast
    over the heads, would not fit), KV heads repeated for GQA on that path (its call takes
    equal head counts)."""
    if kernel == "flashinfer":
        import flashinfer  # noqa: PLC0415 (CUDA only: prefill_attention_kernel checked it)
        return flashinfer.single_prefill_with_kv_cache(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), causal=True,
            kv_layout="NHD", sm_scale=scale).transpose(0, 1)
    n, s = q.shape[1], keys.shape[1]
    if n == s:
        return scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True,
                                            scale=scale, enable_gqa=q.shape[0] != keys.shape[0])[0]
    group = q.shape[0] // keys.shape[0]
    if group > 1:
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    return scaled_dot_product_attention(q[None], keys[None], values[None],
                                        attn_mask=causal_lower_right(n, s), scale=scale)[0]


def prefill_attention_kernel(choice: str, device, dtype: torch.dtype) -> str:
    """The kernel `extend_attention` runs for config `prefill_attention` on `device` with
    queries of `dtype`: "sdpa" off CUDA, and under "auto" for a dtype FlashInfer has no kernel
    for or where it does not import (logged: same math, slower); an error for "flashinfer"
    in those cases."""
    if choice == "sdpa":
        return "sdpa"
    on_cuda, why = torch.device(device).type == "cuda", None
    if not on_cuda:
        why = f"it needs a CUDA device (the pool is on {device})"
    elif dtype not in (torch.float16, torch.bfloat16):
        why = f"its kernels take fp16/bf16 queries, the model runs {dtype}"
    if why is not None:
        if choice == "flashinfer":
            raise ValueError(f"mosaickv prefill_attention 'flashinfer': {why}; use 'auto' or "
                             "'sdpa'")
        if on_cuda:
            logger.warning("MosaicKV: prefill attention runs torch SDPA, not FlashInfer: %s", why)
        return "sdpa"
    try:
        import flashinfer  # noqa: F401, PLC0415
    except ImportError as exc:
        if choice == "flashinfer":
            raise ValueError(f"mosaickv prefill_attention 'flashinfer': FlashInfer does not "
                             f"import ({exc}): install flashinfer-python or use 'sdpa'") from exc
        logger.warning("MosaicKV: FlashInfer does not import (%s): prefill attention runs "
                       "torch SDPA (same math, slower)", exc)
        return "sdpa"
    return "flashinfer"


def chunk_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kd: torch.Tensor,
                    vd: torch.Tensor, first: int, read: torch.Tensor, ja: int, page: int,
                    scale: float, per_page: bool = True, kernel: str = "sdpa") -> torch.Tensor:
    """A prefill chunk's attention under the read rule: q [Hq, n, D] for positions first ..
    first + n - 1; kc/vc [Hk, jc * page, D] the pages read compressed by the chunk's last token;
    kd/vd [Hk, T, D] the dense tokens from position ja * page on; read [n] (int64, non-decreasing)
    how many pages each query reads compressed (>= ja). Query t reads kc's first read[t] pages
    and the dense tokens from page read[t] up to itself -> [Hq, n, D].

    The queries go in runs that share read[t] and, with `per_page` (the position rule), their
    own page (chunks are page aligned): one causal attention per run over exactly the keys its
    queries read, [first read[t] compressed pages, dense tokens from page read[t] to the run's
    last query]. So under the position rule a query's arithmetic (the keys' order and count in
    the softmax and the P @ V reduction, the rows computed with it) depends on its position and
    the K/V only, never on where the chunk starts or ends: the same bits whatever the chunking
    (one masked call over the chunk's whole key range gave other float sums for the same query
    under another chunking: docs/determinism.md). Under the chunk rule (every query reads `ja`
    pages, per_page False) a chunk is one run, one causal call. `kernel`: `extend_attention`'s."""
    n = q.shape[1]
    read = read.tolist()
    out = torch.empty_like(q)
    r0 = 0
    while r0 < n:
        j, own = read[r0], (first + r0) // page
        r1 = r0 + 1
        while r1 < n and read[r1] == j and (not per_page or (first + r1) // page == own):
            r1 += 1
        lo, hi = (j - ja) * page, first + r1 - ja * page  # the run's dense keys in kd
        keys = torch.cat([kc[:, :j * page], kd[:, lo:hi]], 1)
        values = torch.cat([vc[:, :j * page], vd[:, lo:hi]], 1)
        out[:, r0:r1] = extend_attention(q[:, r0:r1], keys, values, scale, kernel)
        r0 = r1
    return out
