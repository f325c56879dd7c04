"""The decode step as static-shaped device work, for SGLang's full decode CUDA graph.

Under ``decode_cuda_graph: "full"`` each layer's MosaicKV attention is recorded in the graph
SGLang captures per batch size, so a replay launches nothing from Python. What that takes:

* **A fixed row layout.** Request b's w-th basis block is row ``b * W + w`` (W: the blocks a
  request of the model's context length can have). Rows are position blocks, so a row's place
  in its request, the selection's gather of rows into one line per request and the merge of a
  request's rows never change; rows a request does not reach, and padded requests, are empty.
* **Per-step tables written in place, before the replay** (`prepare`, host side, from the same
  sealed/hot state and the same per-request reads as the eager plan, `packed_decode.request_reads`):
  each row's segments (a CSR list into a fixed-size buffer), its bases' address, each request's
  hot-buffer rows, each request's page count for the selection.
* **Kernels that read in place with grids fixed per batch size**: `rotate_rows` (bases by
  address), the indexed hot partial, one stage-1 launch per width class of the candidate
  layouts (registered up front: `SegmentStore.freeze_layouts`), the selection always on (a
  request within the budget keeps all its pages), a split count fixed at capture.
* Empty rows give lse -inf and weigh nothing in the merge; a padded request reads the padding
  page's token 0 (slot 0, which its row wrote), so its output is finite.

A batch holding a page the kernel cannot read runs eagerly (`graph_refusal`, counted in stats).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from mosaickv_kernels.band_decode import BandDecodeWrapper
from mosaickv_kernels.basis_rotate import BasisTable, basis_pointers
from mosaickv_kernels.page_select import RowSelection
from mosaickv_kernels.row_merge import merge_rows

from ..codec.arena import PackedArena
from .packed_decode import host_batch, host_seq_lens, hot_slots, readable, request_reads

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    """The static tables and the kernels' plan of one captured batch size."""
    bs: int
    rows: int  # bs * W
    row_req: torch.Tensor  # int64 [R]: b for row b * W + w
    req_rows: torch.Tensor  # int64 [bs, W]
    reqs: torch.Tensor  # int64 [bs]
    seg_indptr: torch.Tensor  # int32 [R + 1]
    seg_ids: torch.Tensor  # int32 [R * block_pages]
    basis_ptrs: torch.Tensor  # int64 [R]
    hot_rows: torch.Tensor  # int64 [R, hot_cap]
    hot_lens: torch.Tensor  # int32 [R]
    selection: RowSelection | None
    wrapper: BandDecodeWrapper
    keep: list  # the bases tensors this step's addresses point into


def band_pairs(cfg) -> list[tuple[str, str]]:
    """Every (K, V) band-spec pair the chooser can store under `cfg`: its K and V candidates
    with the sink and rescue candidates (band strategies only: others are never packed)."""
    extra = list(dict.fromkeys(cfg.sink_candidates + cfg.rescue_candidates))
    ks = [k for k in dict.fromkeys(cfg.k_candidates + extra) if k.startswith("band:")]
    vs = [v for v in dict.fromkeys(cfg.v_candidates + extra) if v.startswith("band:")]
    return [(k, v) for k in ks for v in vs]


class GraphDecode:
    def __init__(self, pool, context_len: int, timer):
        cfg = pool.cfg
        self.pool, self.cfg, self.timer = pool, cfg, timer
        ps = pool.page_size
        self.block_pages = cfg.basis_block_tokens // ps  # segments per row
        self.pps = ps // cfg.page_tokens
        self.row_pages = self.block_pages * self.pps  # 32-token pages per row
        self.width = -(-context_len // cfg.basis_block_tokens)  # W: rows per request
        self.context_len = context_len
        # hot tokens a request may have at a step: the read rule's window, the page being
        # filled, and the daemon's pages in flight (sealed here when over: prepare)
        self.hot_cap = cfg.graph_hot_tokens
        sel, pt = cfg.select, cfg.page_tokens
        self.budget_pages = sel.budget_tokens // pt
        self.sink_pages, self.recent_pages = -(-sel.sink_tokens // pt), -(-sel.recent_tokens // pt)
        self.buckets: dict[int, _Bucket] = {}
        # the kernels' float32 workspace, shared by every bucket (one graph replays at a time):
        # the largest bucket's size, not the sum over buckets
        self.workspace: dict[str, torch.Tensor] = {}
        self.bucket: _Bucket | None = None  # of the step being replayed (or captured)
        self.steps = 0  # replayed steps
        self.eager_steps = 0  # decode steps the graph refused (graph_refusal)
        self.request_steps = 0
        self.pages_available = 0  # (32-token page, KV head, layer) triples, counted in prepare
        self.pages_read_unselected = 0

    # ---- capture ----------------------------------------------------------------------
    def bucket_for(self, bs: int) -> _Bucket:
        """The tables of batch size `bs`, made once (before its capture): every address the
        graph holds."""
        if bs in self.buckets:
            return self.buckets[bs]
        dev, w = self.pool.device, self.width
        r = bs * w
        i64 = dict(dtype=torch.long, device=dev)
        row_req = torch.arange(bs, **i64).repeat_interleave(w)
        selection = None
        if self.cfg.select.enabled:
            selection = RowSelection(row_req.tolist(), [self.row_pages] * r, dev)
        bk = _Bucket(bs, r, row_req, torch.arange(r, **i64).view(bs, w), torch.arange(bs, **i64),
                     torch.zeros(r + 1, dtype=torch.int32, device=dev),
                     torch.zeros(max(r * self.block_pages, 1), dtype=torch.int32, device=dev),
                     torch.zeros(r, **i64), torch.zeros(r, self.hot_cap, **i64),
                     torch.zeros(r, dtype=torch.int32, device=dev), selection,
                     BandDecodeWrapper(), [])
        self.buckets[bs] = bk
        return bk

    def plan_bucket(self, bk: _Bucket, num_qo_heads: int, sm_scale: float) -> None:
        """The kernels' plan of a bucket (splits, workspace), once: at its first forward, which
        SGLang runs as a warm-up before the capture."""
        if bk.wrapper._planned:
            return
        # Splits from the pages a row reads on average under selection (a request's budget over
        # its W rows), not from what a row could hold: sized by the row's capacity, a 32K step
        # at batch 1 had 15 splits x 16 classes = 240 parts per (row, head) to merge, 86 us of a
        # 300 us layer on an H200 (results/h200_2026-12-04_full_graph). A row holding more of
        # the selection walks more pages per split (same result).
        per_row = -(-self.budget_pages // self.width) if bk.selection is not None else None
        bk.wrapper.plan(self._arena(bk, 0), num_qo_heads, sm_scale=sm_scale,
                        width_classes=self.pool.store.width_classes,
                        static_pages=self.row_pages, max_selected_pages=per_row,
                        workspace=self.workspace)

    # ---- before each replay (host) ---------------------------------------------------------
    def graph_refusal(self, forward_batch, req_to_token) -> str | None:
        """Why this batch cannot replay the graph (then it runs eagerly), or None."""
        pool, bs = self.pool, forward_batch.req_pool_indices.numel()
        seq_lens = host_seq_lens(forward_batch, bs)
        if max(seq_lens, default=0) > self.width * self.cfg.basis_block_tokens:
            return "a request longer than the captured context"
        if pool.store.unreadable:  # only then the batch's pages are read
            ps = pool.page_size
            seq_lens, page_ids = host_batch(forward_batch, req_to_token, bs, ps)
            if not all(readable(pool, page_ids[i, :-(-n // ps)]) for i, n in enumerate(seq_lens)):
                return "a page the kernel cannot read"
        return None

    def prepare(self, forward_batch, req_to_token, rows: int, host: tuple | None = None) -> None:
        """Write this step's tables for the replay of `forward_batch.batch_size` with its first
        `rows` requests real (the pool sealed and mapped the writes already); `host`: their
        `host_batch` when the caller read it already."""
        pool, ps, w = self.pool, self.pool.page_size, self.width
        bk = self.buckets.get(forward_batch.batch_size)
        if bk is None:
            raise RuntimeError(f"MosaicKV: no decode graph tables for batch size "
                               f"{forward_batch.batch_size}")
        seq_lens, all_ids = host or host_batch(forward_batch, req_to_token, rows, ps)
        r, block = bk.rows, self.block_pages
        counts = np.zeros(r, dtype=np.int32)
        id_chunks = []
        # the hot tokens ride on each request's row 0 (rows b * W): only those rows are written
        hot_rows = torch.zeros(bk.bs, self.hot_cap, dtype=torch.long)
        hot_lens = torch.zeros(bk.bs, dtype=torch.int32)
        wholes: list = [None] * r
        req_pages = torch.zeros(bk.bs, dtype=torch.int32)
        total_pages = 0
        for i, seq_len in enumerate(seq_lens):
            page_ids = all_ids[i, :-(-seq_len // ps)]
            n, runs, run_bases, hot = request_reads(pool, page_ids, seq_len)
            if n and not readable(pool, page_ids[:n]):
                raise RuntimeError("MosaicKV: a decode graph step holds a page the kernel "
                                   "cannot read (graph_refusal should have sent it eager)")
            hot = hot_slots(hot, ps, seq_len - n * ps)
            if hot.numel() > self.hot_cap:
                raise RuntimeError(f"MosaicKV: a request has {hot.numel()} hot tokens, over the "
                                   f"decode graph's graph_hot_tokens={self.hot_cap}: raise it in "
                                   f"--mosaickv-config")
            # rows are position blocks: runs of a shared basis must be the block-sized chunks
            sizes = [len(run) for run in runs]
            if sizes != [min(block, n - j) for j in range(0, n, block)]:
                raise RuntimeError("MosaicKV: a request's sealed pages are not in position "
                                   "blocks (the decode graph's row layout)")
            counts[i * w:i * w + len(runs)] = sizes
            id_chunks.append(page_ids.numpy()[:n])
            for j, bases in enumerate(run_bases):
                wholes[i * w + j] = bases.stacked()
            hot_rows[i, :hot.numel()] = hot
            hot_lens[i] = hot.numel()
            req_pages[i] = n * self.pps
            total_pages += n * self.pps
        hot_lens[rows:] = 1  # padded requests: the padding page's token 0 (hot row 0)
        counts = torch.from_numpy(counts)
        indptr = torch.zeros(r + 1, dtype=torch.int32)
        indptr[1:] = counts.cumsum(0)
        ids = np.concatenate(id_chunks) if id_chunks else np.zeros(0, dtype=np.int32)
        bk.seg_indptr.copy_(indptr)
        if len(ids):
            bk.seg_ids[:len(ids)].copy_(torch.from_numpy(ids.astype(np.int32)))
        ptrs, bk.keep = basis_pointers(wholes, pool.device)
        bk.basis_ptrs.copy_(ptrs)
        bk.hot_rows[::w].copy_(hot_rows)
        bk.hot_lens[::w].copy_(hot_lens)
        if bk.selection is not None:  # rows are position blocks: row w starts at w * row_pages
            lo = (torch.arange(r, dtype=torch.int32) % w) * self.row_pages
            bk.selection.req_pages.copy_(req_pages)
            bk.selection.hi.copy_(lo + counts * self.pps)
        self.bucket = bk
        self.steps += 1
        self.request_steps += rows
        layers, h = pool.layer_num, pool.head_num
        self.pages_available += total_pages * h * layers
        if bk.selection is None:
            self.pages_read_unselected += total_pages * h * layers

    # ---- per layer (recorded in the graph) ------------------------------------------------
    def attend(self, q: torch.Tensor, layer, out: torch.Tensor) -> None:
        """q [bs, Hq, D] -> out [bs, Hq, D]: device work only, on the bucket's tables."""
        bk = self.bucket
        local = layer.layer_id - self.pool.start_layer
        self.plan_bucket(bk, q.shape[1], layer.scaling)
        arena = self._arena(bk, local)
        wrapper = bk.wrapper
        q_rows = q[bk.row_req]
        queries = wrapper.queries(q_rows, arena)
        sel = {}
        if bk.selection is not None:
            sel = dict(zip(("page_ids", "page_counts"), wrapper.select(
                q_rows, arena, self.pool.store.meta[local], budget_pages=self.budget_pages,
                sink_pages=self.sink_pages, recent_pages=self.recent_pages,
                rows=bk.selection, queries=queries)))
        o_rows = wrapper.run(q_rows, arena, out_dtype=torch.float32, queries=queries, **sel)
        merge_rows(o_rows, wrapper.lse.view(bk.rows, q.shape[1]), bk.req_rows, bk.reqs, out)

    def _arena(self, bk: _Bucket, local: int) -> PackedArena:
        pool, store, h = self.pool, self.pool.store, self.pool.head_num
        basis = BasisTable(bk.basis_ptrs, local * h, (pool.layer_num + local) * h)
        return PackedArena(store.data[local], store.headers[local], bk.seg_indptr, bk.seg_ids,
                           None, None, pool.k_buffer[local], pool.v_buffer[local], bk.hot_lens,
                           store.plans, segment_tokens=pool.page_size,
                           page_tokens=self.cfg.page_tokens, payload={"codes": 0, "scales": 0},
                           min_group=store.min_group, basis=basis, hot_rows=bk.hot_rows)

    def stats(self) -> dict:
        """Steps replayed and refused, and the selection's pages over replayed steps (one host
        sync per bucket, for stats)."""
        read = self.pages_read_unselected
        for bk in self.buckets.values():
            if bk.wrapper._pages_selected is not None:
                read += int(bk.wrapper._pages_selected)
        return {"graph_steps": self.steps, "graph_request_steps": self.request_steps,
                "graph_eager_steps": self.eager_steps, "buckets": sorted(self.buckets),
                "rows_per_request": self.width,
                "selection": {"pages_available": self.pages_available, "pages_read": read}}
