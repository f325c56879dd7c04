"""Batched decode attention through the packed Triton kernels, over the pool's SegmentStore.

Once per decode step (at the first layer) the batch's structure is read on the host: each
request's sealed pages (a prefix of its pages), split into *rows* by basis block (the kernel
rotates q once per row), plus its hot tokens, attached to its last row. Per layer the kernel runs
over every row of the batch in one launch, reading the arena in place; rows of one request are
merged with their log-sum-exps. Page selection runs on the device from the store's page metadata
(`page_select`: bounds, then the top pages per request across its rows), the same rule as the
reference selector. A request whose sealed pages include a segment the kernel cannot read
(dense fallback, non-band sink) goes through the reference path, counted and logged once.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from mosaickv_kernels.band_decode import BandDecodeWrapper
from mosaickv_kernels.page_select import RowSelection

from .codec.arena import PackedArena
from .codec.attention import decode_attention
from .codec.basis import inverse

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """Host-side structure of one decode batch, shared by every layer of the step."""
    kernel_reqs: list[int]  # batch indices decoded by the kernel
    reference_reqs: list[int]  # batch indices decoded by the torch reference (unpacked pages)
    slots: list[torch.Tensor]  # per batch index: its slots, position order
    row_req: torch.Tensor  # int64 [R]: batch index of each row
    row_bases: list  # per row: the BasisPair of its pages (None: no pages)
    row_pages: list[list[int]]  # per row: logical pages, position order
    seg_indptr: torch.Tensor  # int32 [R+1]
    seg_ids: torch.Tensor  # int32 [sum pages]
    hot_index: torch.Tensor  # int64 [R, T_max]: hot-buffer rows (padding -> row 0)
    hot_lens: torch.Tensor  # int32 [R]
    select_reqs: list[int]  # kernel requests whose pages exceed the selection budget
    rows: RowSelection | None  # the selector's row layout, when some request needs selection
    merge: bool  # some request spans several rows


class PackedDecode:
    def __init__(self, pool):
        if pool.dtype != torch.bfloat16:
            raise ValueError(f"mosaickv decode_kernel 'triton' reads a bf16 hot buffer, but the KV "
                             f"cache is {pool.dtype}: serve with --dtype bfloat16 or set "
                             f"decode_kernel 'reference' in --mosaickv-config")
        if torch.device(pool.device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("mosaickv decode_kernel 'triton' on a CPU runs through Triton's "
                             "interpreter: set TRITON_INTERPRET=1, or use decode_kernel 'auto'")
        self.pool = pool
        self.cfg = pool.cfg
        self.wrapper = BandDecodeWrapper()
        self.step: StepPlan | None = None
        sel, pt = self.cfg.select, self.cfg.page_tokens
        self.budget_pages = sel.budget_tokens // pt  # as codec.attention._select counts them
        self.sink_pages, self.recent_pages = -(-sel.sink_tokens // pt), -(-sel.recent_tokens // pt)
        self.kernel_requests = 0  # request-steps decoded by the kernel
        self.reference_requests = 0  # request-steps sent to the reference path (unpacked pages)

    # ---- per step ----------------------------------------------------------------------
    def begin(self, forward_batch, req_to_token) -> None:
        pool, ps = self.pool, self.pool.page_size
        kernel_reqs, reference_reqs, slots_of = [], [], []
        row_req, row_bases, row_pages, hot_rows, select_reqs = [], [], [], [], []
        for i in range(forward_batch.batch_size):
            rid = int(forward_batch.req_pool_indices[i])
            seq_len = int(forward_batch.seq_lens[i])
            slots = req_to_token[rid, :seq_len]
            slots_of.append(slots)
            pages = (slots[::ps] // ps).tolist()
            n = 0
            while n < len(pages) and pages[n] in pool.sealed:
                n += 1
            if n and not bool(pool.store.packed[:, pages[:n]].all()):
                reference_reqs.append(i)
                continue
            kernel_reqs.append(i)
            if self.cfg.select.enabled and n * ps > self.cfg.select.budget_tokens:
                select_reqs.append(i)
            runs: list[list[int]] = []
            for p in pages[:n]:
                if runs and pool.sealed[p].bases is pool.sealed[runs[-1][-1]].bases:
                    runs[-1].append(p)
                else:
                    runs.append([p])
            for r, run in enumerate(runs or [[]]):
                row_req.append(i)
                row_pages.append(run)
                row_bases.append(pool.sealed[run[0]].bases if run else None)
                last = r == max(len(runs) - 1, 0)
                hot_rows.append(pool.physical_loc(slots[n * ps:]) if last else slots[:0])
        dev = pool.device
        t_max = max([h.numel() for h in hot_rows] + [1])
        hot_index = torch.zeros(len(hot_rows), t_max, dtype=torch.long, device=dev)
        for r, h in enumerate(hot_rows):
            hot_index[r, :h.numel()] = h.to(dev)
        counts = torch.tensor([len(p) for p in row_pages], dtype=torch.int32)
        indptr = torch.zeros(len(row_pages) + 1, dtype=torch.int32)
        indptr[1:] = counts.cumsum(0)
        self.step = StepPlan(
            kernel_reqs, reference_reqs, slots_of, torch.tensor(row_req, dtype=torch.long, device=dev),
            row_bases, row_pages, indptr.to(dev),
            torch.tensor([p for run in row_pages for p in run], dtype=torch.int32, device=dev),
            hot_index, torch.tensor([h.numel() for h in hot_rows], dtype=torch.int32, device=dev),
            select_reqs, None, len(row_req) > len(kernel_reqs))
        if select_reqs:
            pps = ps // self.cfg.page_tokens
            self.step.rows = RowSelection(row_req, [len(p) * pps for p in row_pages], dev)
        self.kernel_requests += len(kernel_reqs)
        if reference_reqs:
            if not self.reference_requests:
                logger.warning("MosaicKV: %d request(s) hold segments the packed kernel cannot read "
                               "(dense fallback or non-band sink): decoded by the torch reference; "
                               "counted in stats as reference_decode_requests", len(reference_reqs))
            self.reference_requests += len(reference_reqs)

    # ---- per layer ---------------------------------------------------------------------
    def attend(self, q: torch.Tensor, layer, out: torch.Tensor) -> None:
        """q [B, Hq, D] -> writes out [B, Hq, D] for every request of the step."""
        st, pool = self.step, self.pool
        for i in st.reference_reqs:
            view = pool.layer_view(layer.layer_id, st.slots[i])
            o, _ = decode_attention(q[i:i + 1].float(), view, torch.tensor([len(st.slots[i]) - 1]),
                                    self.cfg.select, self.cfg.page_tokens, sm_scale=layer.scaling)
            out[i] = o[0].to(out.dtype)
        if not st.kernel_reqs:
            return
        arena = self._arena(layer.layer_id - pool.start_layer)
        if layer.layer_id == pool.start_layer:
            self.wrapper.plan(arena, q.shape[1], sm_scale=layer.scaling)
        q_rows = q[st.row_req]
        sel = {}
        if st.rows is not None:  # some request exceeds the budget: the GPU selector
            sel = dict(zip(("page_ids", "page_counts"), self.wrapper.select(
                q_rows, arena, pool.store.meta[layer.layer_id - pool.start_layer],
                budget_pages=self.budget_pages, sink_pages=self.sink_pages,
                recent_pages=self.recent_pages, rows=st.rows)))
        o_rows = self.wrapper.run(q_rows, arena, out_dtype=torch.float32, **sel)
        if not st.merge:
            out[st.row_req] = o_rows.to(out.dtype)
            return
        # Rows of one request: weights softmax(lse) over its rows (empty rows weigh 0).
        hq, d = q.shape[1], q.shape[2]
        lse = self.wrapper.lse.reshape(len(st.row_req), hq)
        top = torch.full((q.shape[0], hq), float("-inf"), device=q.device).scatter_reduce(
            0, st.row_req[:, None].expand(-1, hq), lse, "amax")
        w = torch.exp(lse - top[st.row_req])
        w = torch.where(torch.isfinite(lse), w, torch.zeros_like(w))
        num = torch.zeros(q.shape[0], hq, d, device=q.device)
        den = torch.zeros(q.shape[0], hq, device=q.device)
        num.index_add_(0, st.row_req, torch.where(w[..., None] > 0, o_rows * w[..., None], 0.0))
        den.index_add_(0, st.row_req, w)
        idx = torch.tensor(st.kernel_reqs, device=q.device)
        out[idx] = (num[idx] / den[idx, :, None]).to(out.dtype)

    def _arena(self, local: int) -> PackedArena:
        st, pool = self.step, self.pool
        h, d = pool.head_num, pool.head_dim
        eye = torch.eye(d, device=pool.device).expand(h, d, d)
        u_k = torch.stack([eye if b is None else b.k[local].float() for b in st.row_bases])
        u_v = torch.stack([eye if b is None else b.v[local].float() for b in st.row_bases])
        # The kernel reads q @ k_basis and o_rot @ v_basis^T: the exact inverses' transposes.
        k_basis = inverse(u_k.reshape(-1, d, d)).transpose(1, 2).reshape(u_k.shape).contiguous()
        v_basis = inverse(u_v.reshape(-1, d, d)).transpose(1, 2).reshape(u_v.shape).contiguous()
        hot_k = pool.k_buffer[local][st.hot_index].permute(0, 2, 1, 3).contiguous()
        hot_v = pool.v_buffer[local][st.hot_index].permute(0, 2, 1, 3).contiguous()
        store = pool.store
        return PackedArena(store.data[local], store.headers[local], st.seg_indptr, st.seg_ids,
                           k_basis, v_basis, hot_k, hot_v, st.hot_lens, store.plans,
                           segment_tokens=pool.page_size, page_tokens=self.cfg.page_tokens,
                           payload={"codes": 0, "scales": 0}, min_group=store.min_group)
