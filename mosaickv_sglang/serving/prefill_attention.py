"""A prefill chunk's attention: its queries over the request's compressed prefix (read back)
and its own dense tokens, under the read rule. `ChunkAttention` plans a forward's runs once
and runs each layer as one launch (FlashInfer's batch prefill over a paged buffer on CUDA, or
torch SDPA per run, the reference: config `prefill_attention`, resolved by
`prefill_attention_kernel`); `chunk_attention` is one request's chunk through it, and
`extend_attention` one causal call. No SGLang import: the attention backend calls it, and so
do its tests and `benchmarks/prefill_attention_bench.py` on a machine without SGLang.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
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


# ---- a prefill forward's chunk attention: plan once, run per layer ----------------------------
# Under the read rule a chunk's queries go in runs (`chunk_runs`) that share what they read: the
# first j pages compressed, then the dense tokens from page j up to the run's last query. Every
# run is one causal "request" over a paged K/V: a per-layer buffer holds each request's
# compressed pages (kc, jc of them) and its dense tokens (kd, from page ja on, padded to whole
# pages), and a run's page list names j pages of the first and the pages of the second it
# reads. The lists depend only on positions and counts, not on the layer, so they are planned
# once per forward (`ChunkAttention.plan`, cached by the caller's key) and each layer is one
# gather of kc/kd into the buffer plus one launch (`ChunkAttention.run`): FlashInfer's batch
# prefill over the paged buffer, or the reference (each run's keys gathered and passed to
# `extend_attention`). A run's arithmetic depends only on its queries and keys, so a query gets
# the same bits whatever the chunking (docs/determinism.md): the reference computes each run
# alone, and FlashInfer's batch prefill is planned without split-KV (a run's softmax is one
# pass over its keys; tested on the GPU in tests/test_batch_invariance.py).


def chunk_runs(first: int, read: torch.Tensor, page: int, per_page: bool) -> list[tuple]:
    """The runs of a chunk at positions first .. first + n - 1 with read [n] (non-decreasing:
    how many pages each query reads compressed): (r0, r1, j) for queries r0 .. r1 - 1 that all
    read j pages compressed and, with `per_page` (the position rule), lie in one page."""
    n = read.numel()
    cut = torch.ones(n, dtype=torch.bool)
    cut[1:] = read[1:] != read[:-1]
    if bool((read[1:] < read[:-1]).any()):
        raise ValueError("chunk_runs: read must be non-decreasing over the chunk")
    if per_page:
        cut |= (torch.arange(first, first + n) % page) == 0
    starts = cut.nonzero().flatten().tolist()
    return list(zip(starts, starts[1:] + [n], read[starts].tolist()))


@dataclass
class ChunkPlan:
    """The host metadata of one forward's chunk attention (`plan_chunks`): `runs` (request,
    q row 0, q row 1, kv length) per run; FlashInfer's page-table arrays (int32, host);
    per request its first page in the gathered buffer (`bases`), compressed pages `jc` and
    dense tokens `kd_len`; `pages` the buffer's pages, `rows` the queries."""
    page: int
    runs: list
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    bases: list
    jc: list
    kd_len: list
    pages: int
    rows: int


def plan_chunks(specs: list, page: int, per_page: bool) -> ChunkPlan:
    """specs: per request of the forward (in query order) (first, n, read, ja, jc): its chunk's
    first position and length, read [n] (`chunk_attention`'s), ja the pages its first token
    reads compressed (its dense tokens start at page ja) and jc the pages its last token reads
    compressed -> the ChunkPlan."""
    runs, qo, kvp, idx, last, bases, jcs, kd_lens = [], [0], [0], [], [], [], [], []
    base = row = 0
    for i, (first, n, read, ja, jc) in enumerate(specs):
        if n <= 0 or read.numel() != n:
            raise ValueError(f"plan_chunks: request {i}: {n} queries, read has {read.numel()}")
        kd_len = first + n - ja * page  # dense tokens from page ja on, the chunk's last included
        kd_pages = -(-kd_len // page)
        for r0, r1, j in chunk_runs(first, read, page, per_page):
            lo, hi = (j - ja) * page, first + r1 - ja * page  # the run's dense keys in kd
            if not ja <= j <= jc or hi <= lo:
                raise ValueError(f"plan_chunks: request {i}, queries {first + r0}..{first + r1 - 1}"
                                 f" read {j} pages compressed, outside [{ja}, {jc}] or past "
                                 "themselves")
            dense = np.arange(lo // page, -(-hi // page)) + base + jc
            idx.append(np.arange(base, base + j))
            idx.append(dense)
            kvp.append(kvp[-1] + j + dense.size)
            last.append(hi - (dense[-1] - base - jc) * page)
            runs.append((i, row + r0, row + r1, j * page + hi - lo))
            qo.append(row + r1)
        bases.append(base)
        jcs.append(jc)
        kd_lens.append(kd_len)
        base += jc + kd_pages
        row += n
    i32 = lambda x: torch.as_tensor(np.asarray(x, dtype=np.int32))  # noqa: E731
    return ChunkPlan(page, runs, i32(qo), i32(kvp), i32(np.concatenate(idx)), i32(last), bases,
                     jcs, kd_lens, base, row)


def gather_chunks(plan: ChunkPlan, kcs: list, kds: list) -> torch.Tensor:
    """One layer's K (or V) buffer [pages, page, H, D] for `plan`: each request's compressed
    pages kc [jc * page, H, D] then its dense tokens kd [kd_len, H, D] (token-major, as the
    pool returns them), the last dense page's tail zeroed (FlashInfer may load it; masked)."""
    ps = plan.page
    ref = kds[0]
    buf = ref.new_empty(plan.pages * ps, *ref.shape[1:])
    for base, jc, kd_len, kc, kd in zip(plan.bases, plan.jc, plan.kd_len, kcs, kds):
        if kc.shape[0] < jc * ps or kd.shape[0] != kd_len:
            raise ValueError(f"gather_chunks: {kc.shape[0]} compressed rows for {jc} pages, "
                             f"{kd.shape[0]} dense rows for {kd_len}")
        d0 = (base + jc) * ps
        buf[base * ps:d0] = kc[:jc * ps]
        buf[d0:d0 + kd_len] = kd
        buf[d0 + kd_len:d0 + -(-kd_len // ps) * ps] = 0
    return buf.view(plan.pages, ps, *ref.shape[1:])


class ChunkAttention:
    """A forward's chunk attention through `kernel` ("flashinfer": one batch prefill launch per
    layer over the gathered buffer; "sdpa": `extend_attention` per run; "flashinfer_single":
    FlashInfer's single-request prefill per run, the former path, kept for the bench).
    `plan` once per forward (host metadata; FlashInfer's own plan), `run` per layer."""

    WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (its recommended size)

    def __init__(self, kernel: str):
        if kernel not in ("flashinfer", "sdpa", "flashinfer_single"):
            raise ValueError(f"ChunkAttention: unknown kernel {kernel!r}")
        self.kernel = kernel
        self._wrapper = None
        self._key = None
        self.plan_: ChunkPlan | None = None
        self.replans = 0  # FlashInfer plans made (a forward's layers share one)

    def plan(self, specs: list, page: int, per_page: bool, heads: tuple, dtype: torch.dtype,
             scale: float, device, key=None) -> ChunkPlan:
        """Plan the forward's runs (`plan_chunks`); `heads` (Hq, Hk, D). With `key` (hashable,
        equal exactly when specs, page and rule are), a plan for the same key is reused."""
        full = (key, page, per_page, heads, dtype, scale, str(device))
        if key is not None and full == self._key:
            return self.plan_
        plan = plan_chunks(specs, page, per_page)
        if self.kernel == "flashinfer":
            import flashinfer  # noqa: PLC0415 (CUDA only: prefill_attention_kernel checked it)
            if self._wrapper is None:
                ws = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            hq, hk, d = heads
            self._wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                               plan.last_page_len, hq, hk, d, page, causal=True, sm_scale=scale,
                               q_data_type=dtype, kv_data_type=dtype, disable_split_kv=True)
            self.replans += 1
        self.plan_, self._key = plan, (full if key is not None else None)
        return plan

    def run(self, plan: ChunkPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [rows, Hq, D] (token-major, the plan's queries in order); k, v `gather_chunks`'
        buffers -> [rows, Hq, D] (into `out` if given)."""
        if q.shape[0] != plan.rows:
            raise ValueError(f"ChunkAttention.run: {q.shape[0]} queries, the plan has {plan.rows}")
        if self.kernel == "flashinfer":
            return self._wrapper.run(q, (k, v), out=out)
        out = torch.empty_like(q) if out is None else out
        kf, vf = k.flatten(0, 1), v.flatten(0, 1)
        ps, ind, ptr = plan.page, plan.kv_indices, plan.kv_indptr.tolist()
        kernel = "flashinfer" if self.kernel == "flashinfer_single" else "sdpa"
        for r, (_, r0, r1, kv_len) in enumerate(plan.runs):
            pages = ind[ptr[r]:ptr[r + 1]].to(torch.long)
            rows = (pages[:, None] * ps + torch.arange(ps)).flatten()[:kv_len].to(kf.device)
            keys, values = (x[rows].transpose(0, 1) for x in (kf, vf))
            out[r0:r1] = extend_attention(q[r0:r1].transpose(0, 1), keys, values, scale,
                                          kernel).transpose(0, 1)
        return out


def chunk_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kd: torch.Tensor,
                    vd: torch.Tensor, first: int, read: torch.Tensor, ja: int, page: int,
                    scale: float, per_page: bool = True, kernel: str = "sdpa") -> torch.Tensor:
    """One request's chunk under the read rule (a `ChunkAttention` plan and run for it alone):
    q [Hq, n, D] for positions first .. first + n - 1; kc/vc [Hk, jc * page, D] the pages read
    compressed by the chunk's last token; kd/vd [Hk, T, D] the dense tokens from position
    ja * page on; read [n] (int64, non-decreasing) how many pages each query reads compressed
    (>= ja). Query t reads kc's first read[t] pages and the dense tokens from page read[t] up
    to itself -> [Hq, n, D] (head-major views, as before the batched path).

    The queries go in runs that share read[t] and, with `per_page` (the position rule), their
    own page (chunks are page aligned): one causal attention per run over exactly the keys its
    queries read. So under the position rule a query's arithmetic (the keys' order and count in
    the softmax and the P @ V reduction) depends on its position and the K/V only, never on
    where the chunk starts or ends: the same bits whatever the chunking (one masked call over
    the chunk's whole key range gave other float sums for the same query under another
    chunking: docs/determinism.md). Under the chunk rule (every query reads `ja` pages,
    per_page False) a chunk is one run."""
    n, jc = q.shape[1], kc.shape[1] // page
    runner = ChunkAttention(kernel)
    plan = runner.plan([(first, n, read, ja, jc)], page, per_page,
                       (q.shape[0], kc.shape[0], q.shape[2]), q.dtype, scale, q.device)
    k = gather_chunks(plan, [kc.transpose(0, 1)], [kd.transpose(0, 1)])
    v = gather_chunks(plan, [vc.transpose(0, 1)], [vd.transpose(0, 1)])
    return runner.run(plan, q.transpose(0, 1).contiguous(), k, v, scale).transpose(0, 1)
