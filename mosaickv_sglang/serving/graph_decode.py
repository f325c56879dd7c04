"""The decode step as static-shaped device work, for SGLang's full decode CUDA graph.

Under ``decode_cuda_graph: "full"`` each layer's MosaicKV attention is recorded in the graph
SGLang captures per batch size, so a replay launches nothing from Python. What that takes:

* **A fixed row layout.** Request b's w-th basis block is row ``b * W + w`` (W: the blocks a
  request of the model's context length can have). Rows are position blocks, so row w holds the
  request's pages [w * row_pages, (w + 1) * row_pages): a request's pages are one list in
  position order whatever its rows, and a page's row is its index over row_pages.
* **Per-step tables written in place, before the replay** (`prepare`, host side, from the same
  sealed/hot state and the same per-request reads as the eager plan, `packed_decode.request_reads`):
  each row's segments (a CSR list into a fixed-size buffer), its bases' address, each request's
  hot-buffer rows and its compressed page count.
* **Five launches per layer with grids fixed per batch size** (`request_decode`): q into every
  reached row's K basis; the page bounds over the rows, written request-major, and the top pages
  per request (the selection always on: a request within the budget keeps all its pages; with
  `select.rescore_factor` the bound's candidates re-ranked on their compressed K, two more
  launches and a second top-k, `page_rescore`); one
  stage-1 launch over each request's selected pages, every layout in one compiled variant (the
  per-channel plan, no width classes), rows' V accumulators rotated back as the row changes, the
  hot tokens as one more split; one merge writing the layer's output.
* Padded requests have no pages and read the padding page's token 0 (slot 0, which their row
  wrote), so their output is finite.

A batch holding a page the kernel cannot read runs eagerly (`graph_refusal`, counted in stats).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from mosaickv_kernels.basis_rotate import check_bases
from mosaickv_kernels.common import interpreting
from mosaickv_kernels.decode_tables import build_decode_tables
from mosaickv_kernels.decode_tables import compile_variant as compile_tables_variant
from mosaickv_kernels.page_rescore import page_rescore
from mosaickv_kernels.page_select import page_bounds, select_page_list
from mosaickv_kernels.request_decode import DecodeTables, RequestDecode

from ..codec.attention import PageReads
from .packed_decode import (host_batch, host_prompts, host_seq_lens, hot_slots, position_blocks,
                            readable, request_reads, rescore_plan)
from .pool import upload_changed_span

logger = logging.getLogger(__name__)


def device_plannable(pool) -> bool:
    """Whether the pages a decode token reads compressed are its request's sealed prefix, cut
    at its window, so the device can build a step's tables from the page table alone: the
    chunk read rule (it reads whatever is sealed; its window only delays sealing), or the
    position rule without the daemon, where a page is sealed at the step its request first
    reads it compressed, and a page of a request's window (W = `hot_tokens`) that another
    request sealed first (its prefill read it compressed) keeps its hot copy (`kept_hot`)
    until then.
    Not once a read found a page sealed inside a window with no hot copy (counted,
    `early_sealed_reads`: the host plan reads it compressed, which the device plan cannot see)."""
    if not pool.position_rule:
        return True
    return pool.daemon is None and pool.counters.early_sealed_reads == 0


@dataclass
class _Bucket:
    """The static tables and the kernels' plan of one captured batch size. The tables are views
    of two flat device buffers (int32, int64), each written by one copy per step from a host
    staging buffer of the same layout (pinned on CUDA: the copy does not block)."""
    bs: int
    rows: int  # bs * W
    seg_indptr: torch.Tensor  # int32 [R + 1]
    seg_ids: torch.Tensor  # int32 [R * block_pages]
    hot_lens: torch.Tensor  # int32 [bs]
    req_pages: torch.Tensor  # int32 [bs]: compressed 32-token pages of each request
    basis_ptrs: torch.Tensor  # int64 [R]
    hot_rows: torch.Tensor  # int64 [bs, hot_cap]
    flat: tuple  # (int32 device buffer, int64 device buffer): the tables above are views
    staging: tuple  # the same two layouts on the host
    decoder: RequestDecode
    keep: list  # the bases tensors this step's addresses point into
    bounds: torch.Tensor | None = None  # fp32 [bs, H, W * row_pages] (selection)


def _views_np(flat: np.ndarray, sizes: list) -> list:
    """Consecutive 1-D views of a flat numpy array, one per size."""
    out, at = [], 0
    for n in sizes:
        out.append(flat[at:at + n])
        at += n
    return out


def _views(flat: torch.Tensor, shapes: list) -> list:
    """Consecutive views of a flat tensor, one per shape."""
    out, at = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        out.append(flat[at:at + n].view(*shape))
        at += n
    return out


def band_pairs(cfg) -> list[tuple[str, str]]:
    """Every (K, V) band-spec pair the chooser can store under `cfg`: its K and V candidates
    with the sink, rescue and (when on) cold candidates (band strategies only: others are never
    packed)."""
    extra = list(dict.fromkeys(cfg.sink_candidates + cfg.rescue_candidates))
    cold_k, cold_v = (cfg.cold.k_candidates, cfg.cold.v_candidates) if cfg.cold.enabled \
        else ([], [])
    ks = [k for k in dict.fromkeys(cfg.k_candidates + extra + cold_k) if k.startswith("band:")]
    vs = [v for v in dict.fromkeys(cfg.v_candidates + extra + cold_v) if v.startswith("band:")]
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
        # hot tokens a request may have at a step: the read rule's window (with the daemon
        # under the position rule: + daemon_lag_tokens), the page being filled and the one
        # before it; the daemon's pages in flight past that are sealed before the step
        # (`pool.bound_hot_reads`)
        self.hot_cap = cfg.graph_hot_tokens
        # the device plan's cut of the sealed prefix: the position rule's window (under the
        # chunk rule a token reads whatever is sealed: none)
        self.window = pool.dense_window if pool.position_rule else 0
        if pool.dense_window + 2 * ps > self.hot_cap:
            raise ValueError(f"mosaickv config: graph_hot_tokens={self.hot_cap} is below the "
                             f"read rule's dense window ({pool.dense_window} tokens: hot_tokens"
                             f"{' + daemon_lag_tokens' if pool.dense_window > cfg.hot_tokens else ''}"
                             f") + 2 pages ({2 * ps}): raise it to at least "
                             f"{pool.dense_window + 2 * ps} in --mosaickv-config")
        sel, pt = cfg.select, cfg.page_tokens
        self.budget_pages = sel.budget_tokens // pt
        self.sink_pages, self.recent_pages = -(-sel.sink_tokens // pt), -(-sel.recent_tokens // pt)
        self.rescore = rescore_plan(sel, pool.head_dim)  # (factor, channels, layout) or None
        self.buckets: dict[int, _Bucket] = {}
        # the kernels' float32 workspace, shared by every bucket (one graph replays at a time):
        # the largest bucket's size, not the sum over buckets
        self.workspace: dict[str, torch.Tensor] = {}
        self.bucket: _Bucket | None = None  # of the step being replayed (or captured)
        self.steps = 0  # replayed steps
        self.eager_steps = 0  # decode steps the graph refused (graph_refusal)
        self.request_steps = 0
        self.pages_available = 0  # (32-token page, KV head, layer) triples, counted in prepare
        # steps whose tables were built on the device (no host read: `can_skip_host`), their
        # pages available counted there too, and the pool's page table version the last host
        # step saw (None: none yet)
        self.device_steps = 0
        self.pages_available_dev = None
        self._host_version = None
        self._table: DevicePageTable | None = None
        self._uploaded: tuple | None = None  # host copies of what the device table holds
        self.pages_read_unselected = 0
        # bases tensors whose address was checked (address -> tensor, weakly: a freed tensor
        # leaves, and another at its address is checked again)
        self._checked = weakref.WeakValueDictionary()

    # ---- capture ----------------------------------------------------------------------
    def bucket_for(self, bs: int) -> _Bucket:
        """The tables of batch size `bs`, made once (before its capture): every address the
        graph holds."""
        if bs in self.buckets:
            return self.buckets[bs]
        dev, w = torch.device(self.pool.device), self.width
        r = bs * w
        s32 = [(r + 1,), (max(r * self.block_pages, 1),), (bs,), (bs,)]
        s64 = [(r,), (bs, self.hot_cap)]
        flat, staging = [], []
        for dtype, shapes in ((torch.int32, s32), (torch.int64, s64)):
            n = sum(int(np.prod(x)) for x in shapes)
            flat.append(torch.zeros(n, dtype=dtype, device=dev))
            staging.append(torch.zeros(n, dtype=dtype, pin_memory=dev.type == "cuda"))
        bk = _Bucket(bs, r, *_views(flat[0], s32), *_views(flat[1], s64), tuple(flat),
                     tuple(staging), RequestDecode(), [])
        self.buckets[bs] = bk
        return bk

    def plan_bucket(self, bk: _Bucket, num_qo_heads: int, sm_scale: float) -> None:
        """The kernels' plan of a bucket (splits, workspace), once: at its first forward, which
        SGLang runs as a warm-up before the capture."""
        if bk.decoder._planned:
            return
        pool, w = self.pool, self.width
        selected = None
        if self.cfg.select.enabled:
            selected = min(w * self.row_pages,
                           self.budget_pages + self.sink_pages + self.recent_pages)
            # in the shared workspace too (one graph replays at a time)
            shape = (bk.bs, pool.head_num, w * self.row_pages)
            n = shape[0] * shape[1] * shape[2]
            have = self.workspace.get("bounds")
            if have is None or have.numel() < n:
                have = self.workspace["bounds"] = torch.empty(n, dtype=torch.float32,
                                                              device=pool.device)
            bk.bounds = have[:n].view(shape)
        bk.decoder.plan(batch=bk.bs, rows_per_request=w, row_pages=self.row_pages,
                        pages_per_seg=self.pps, num_kv_heads=pool.head_num,
                        num_qo_heads=num_qo_heads, head_dim=pool.head_dim,
                        max_selected=selected, sm_scale=sm_scale, device=pool.device,
                        hot_tokens=self.hot_cap, workspace=self.workspace,
                        products=self.cfg.graph_products)

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

    def prepare(self, forward_batch, req_to_token, rows: int, host: tuple | None = None,
                prompts: list | None = None) -> None:
        """Write this step's tables for the replay of `forward_batch.batch_size` with its first
        `rows` requests real (the pool sealed and mapped the writes already); `host`: their
        `host_batch`, `prompts`: their `host_prompts`, when the caller read them already."""
        pool, ps, w = self.pool, self.pool.page_size, self.width
        bk = self.buckets.get(forward_batch.batch_size)
        if bk is None:
            raise RuntimeError(f"MosaicKV: no decode graph tables for batch size "
                               f"{forward_batch.batch_size}")
        seq_lens, all_ids = host or host_batch(forward_batch, req_to_token, rows, ps)
        if prompts is None:
            prompts = host_prompts(pool, forward_batch, rows)
        r, block = bk.rows, self.block_pages
        # the host staging buffers, as numpy views in the device tables' layout
        s32, s64 = (t.numpy() for t in bk.staging)
        indptr, seg_ids, hot_lens, req_pages = _views_np(s32, [r + 1, max(r * block, 1),
                                                                bk.bs, bk.bs])
        ptrs, hot_rows = _views_np(s64, [r, bk.bs * self.hot_cap])
        hot_rows = hot_rows.reshape(bk.bs, self.hot_cap)
        counts = np.zeros(r, dtype=np.int64)
        hot_lens[:] = 1  # padded requests: the padding page's token 0 (hot row 0)
        hot_rows[rows:, 0] = 0
        req_pages[:] = 0
        ptrs[:] = 0
        keep, at = [], 0
        total_pages = 0
        for i, seq_len in enumerate(seq_lens):
            page_ids = all_ids[i, :-(-seq_len // ps)]
            n, runs, run_bases, hot = request_reads(pool, page_ids, seq_len,
                                                    None if prompts is None else prompts[i])
            if n and not readable(pool, page_ids[:n]):
                raise RuntimeError("MosaicKV: a decode graph step holds a page the kernel "
                                   "cannot read (graph_refusal should have sent it eager)")
            hot = hot_slots(hot, ps, seq_len - n * ps).numpy()
            if hot.size > self.hot_cap:
                raise RuntimeError(f"MosaicKV: a request has {hot.size} hot tokens, over the "
                                   f"decode graph's graph_hot_tokens={self.hot_cap}: raise it in "
                                   f"--mosaickv-config")
            # rows are position blocks: runs of a shared basis must be the block-sized chunks
            sizes = [len(run) for run in runs]
            if not position_blocks(pool, n, runs):
                raise RuntimeError("MosaicKV: a request's sealed pages are not in position "
                                   "blocks (the decode graph's row layout)")
            counts[i * w:i * w + len(runs)] = sizes
            seg_ids[at:at + n] = page_ids.numpy()[:n]
            at += n
            for j, bases in enumerate(run_bases):
                whole = bases.stacked()
                ptrs[i * w + j] = self._address(whole)
                keep.append(whole)
            hot_rows[i, :hot.size] = hot
            hot_lens[i] = hot.size
            req_pages[i] = n * self.pps
            total_pages += n * self.pps
        indptr[0] = 0
        np.cumsum(counts, out=counts)
        indptr[1:] = counts
        bk.keep = keep
        for dev_flat, host_flat in zip(bk.flat, bk.staging):  # two copies, not six
            dev_flat.copy_(host_flat, non_blocking=True)
        # the next step may skip the host only from a page table known to match this version
        self._host_version = pool.version if self._sync_table() else None
        self.bucket = bk
        self.steps += 1
        self.request_steps += rows
        layers, h = pool.layer_num, pool.head_num
        self.pages_available += total_pages * h * layers
        if not self.cfg.select.enabled:
            self.pages_read_unselected += total_pages * h * layers

    # ---- the same tables built on the device, on steps with nothing for the host to do -----
    def can_skip_host(self, forward_batch, rows: int) -> bool:
        """Whether this step's host work (sealing, hot pages for the writes, the tables) has
        nothing to do but the tables, which the device then builds (`prepare_on_device`): the
        pool's page table has not changed since the last step that did the host work (nothing
        sealed, adopted, freed or mapped since: `pool.version`), and no real request starts a
        new page (its write needs a hot page) or crosses a sealing boundary (the chunk read
        rule seals a page once `hot_tokens` behind it) at this step, and no page is sealing in
        slices (`decode_seal_layers`: the host seals its next layers; installing it bumps
        `pool.version`, so the step after the last slice rebuilds the tables too). From the
        host's lengths alone: no device read. Where `device_plannable` holds."""
        pool = self.pool
        if not device_plannable(pool) or not pool.basis_addr_ok or self._table is None or \
                self._host_version != pool.version or pool.decode_sealing:
            return False
        ps, window = pool.page_size, pool.dense_window
        for seq_len in host_seq_lens(forward_batch, rows):
            pos = seq_len - 1
            if pos % ps == 0 or (pos > window and (pos - window) % ps == 0):
                return False
        return True

    def compile_tables(self) -> int:
        """Compile the `decode_tables` variant `prepare_on_device` launches (start-up, CUDA:
        SGLang's int32 `req_to_token`, its decode graph's int64 request rows and lengths), so
        that the first step planned on the device does not stall on a compile. Returns variants
        compiled."""
        compile_tables_variant(width=self.width, block_pages=self.block_pages,
                               hot_cap=self.hot_cap)
        return 1

    def prepare_on_device(self, forward_batch, req_to_token, rows: int) -> None:
        """`prepare` for a step `can_skip_host` allows: the bucket's tables written on the
        device, ordered after the previous replay on the stream; no host sync. On CUDA (and
        under the Triton interpreter) one launch (`decode_tables.build_decode_tables`), else
        `device_tables`' torch ops (its reference)."""
        bk = self.buckets.get(forward_batch.batch_size)
        if bk is None:
            raise RuntimeError(f"MosaicKV: no decode graph tables for batch size "
                               f"{forward_batch.batch_size}")
        pool, table = self.pool, self._table
        if self.pages_available_dev is None:
            self.pages_available_dev = torch.zeros(1, dtype=torch.int64, device=pool.device)
        if torch.device(pool.device).type == "cuda" or interpreting():
            build_decode_tables(
                req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, rows,
                table.sealed, table.basis_addr, table.hot_page,
                {name: getattr(bk, name) for name in ("seg_indptr", "seg_ids", "hot_lens",
                                                      "req_pages", "basis_ptrs", "hot_rows")},
                page_size=pool.page_size, width=self.width, block_pages=self.block_pages,
                pages_per_seg=self.pps, available=self.pages_available_dev,
                count_scale=pool.head_num * pool.layer_num, window=self.window)
        else:
            built = self.device_tables(bk, forward_batch.req_pool_indices,
                                       forward_batch.seq_lens, req_to_token, rows, table)
            for name, value in built.items():
                getattr(bk, name).copy_(value)
            self.pages_available_dev += built["req_pages"].sum().to(torch.int64) * (
                pool.head_num * pool.layer_num)
        self.bucket = bk
        self.steps += 1
        self.device_steps += 1
        self.request_steps += rows

    def _sync_table(self) -> bool:
        """The device page table up to date with the pool's host arrays: one copy per array of
        the span that changed since the last sync (none on most steps). False where it cannot
        be (bases without one tensor; inside a CUDA graph capture)."""
        pool = self.pool
        if not pool.basis_addr_ok or (torch.cuda.is_available()
                                      and torch.cuda.is_current_stream_capturing()):
            return False  # (a pageable copy cannot be recorded; a later host step syncs)
        host = (pool.page_sealed, pool.page_basis_addr)
        if self._table is None:
            dev = pool.device
            self._table = DevicePageTable(torch.zeros(host[0].size, dtype=torch.bool, device=dev),
                                          torch.zeros(host[1].size, dtype=torch.int64, device=dev),
                                          pool.hot_page_dev)
            self._uploaded = tuple(np.zeros_like(h) for h in host)
        for now, up, dev in zip(host, self._uploaded, (self._table.sealed,
                                                        self._table.basis_addr)):
            upload_changed_span(now, up, dev)
        # the hot pages too: a prefill maps its writes on the host table only, and a step that
        # maps no write of its own (the capture's) would leave the device copy behind the
        # version recorded here (seen on the H200: a device-planned step read stale hot rows)
        pool.sync_hot_page_dev()
        return True

    def device_tables(self, bk: _Bucket, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                      req_to_token: torch.Tensor, rows: int, table: "DevicePageTable") -> dict:
        """`prepare`'s tables for bucket `bk` as static-shaped device ops (no host read, no
        Python loop over requests or pages: what the decode graph can record), from the batch's
        `req_pool_indices` and `seq_lens` (device, bucket-sized; the first `rows` real) and the
        pool's page table on the device (`table`). Returns new tensors named as the bucket's
        fields; the parts `prepare` writes are equal (tests/test_graph_decode.py). Where
        `device_plannable` holds (a window's early-sealed reads are decided on the host)."""
        if not device_plannable(self.pool):
            raise NotImplementedError("device_tables: the chunk read rule, or the position rule "
                                      "without the daemon or an early-sealed read")
        dev, ps, w, block = req_to_token.device, self.pool.page_size, self.width, \
            self.block_pages
        bs, cap, most = bk.bs, self.hot_cap, w * self.block_pages  # pages a request may have
        live = torch.arange(bs, device=dev) < rows
        lens = torch.where(live, seq_lens.to(torch.int64), 0)
        # (no host->device copy anywhere here: a blocking one would wait for the last replay)
        cols = (torch.arange(most, device=dev) * ps).clamp(max=req_to_token.shape[1] - 1)
        pages = req_to_token[req_pool_indices.to(torch.int64)[:, None], cols[None, :]] \
            .to(torch.int64) // ps
        owned = torch.arange(most, device=dev)[None, :] < (lens[:, None] + ps - 1) // ps
        pages = torch.where(owned, pages, 0)
        sealed = table.sealed[pages] & owned
        n = torch.cumprod(sealed.to(torch.int32), dim=1).sum(1)  # the sealed prefix (chunk rule)
        # the position rule's window: pages ending less than W before the token stay dense
        n = torch.minimum(n, (lens - 1 - self.window).clamp(min=0) // ps)
        starts = torch.arange(w, device=dev) * block
        counts = (n[:, None] - starts[None, :]).clamp(0, block)  # [bs, W]
        indptr = torch.zeros(bs * w + 1, dtype=torch.int64, device=dev)
        indptr[1:] = torch.cumsum(counts.reshape(-1), 0)
        # seg_ids: request b's pages 0..n-1 from indptr[b * W] on (rows are position blocks)
        first = indptr[:-1].view(bs, w)[:, 0].contiguous()
        k = torch.arange(max(bs * w * block, 1), device=dev)
        b = (torch.searchsorted(first, k, right=True) - 1).clamp(0, bs - 1)
        j = (k - first[b]).clamp(0, most - 1)
        seg_ids = torch.where(k < indptr[-1], pages[b, j], 0)
        row_first = pages[:, starts]  # [bs, W]: each row's first page
        ptrs = torch.where(counts > 0, table.basis_addr[row_first], 0).reshape(-1)
        hot_len = torch.where(live, lens - n * ps, 1)  # padded: the padding page's token 0
        t = torch.arange(cap, device=dev)
        at = (n[:, None] + t[None, :] // ps).clamp(max=most - 1)
        hot_rows = table.hot_page[pages.gather(1, at)] * ps + t[None, :] % ps
        hot_rows = torch.where((t[None, :] < hot_len[:, None]) & live[:, None], hot_rows, 0)
        return {"seg_indptr": indptr.to(torch.int32), "seg_ids": seg_ids.to(torch.int32),
                "hot_lens": hot_len.to(torch.int32), "req_pages": (n * self.pps).to(torch.int32),
                "basis_ptrs": ptrs, "hot_rows": hot_rows}

    def _address(self, whole: torch.Tensor) -> int:
        """A bases tensor's device address, checked once per tensor (`check_bases`: bf16,
        contiguous, on the pool's device), on the host: no device copy per new basis block."""
        key = whole.data_ptr()
        if self._checked.get(key) is not whole:
            check_bases([whole], self.pool.device)
            self._checked[key] = whole
        return key

    # ---- per layer (recorded in the graph) ------------------------------------------------
    def attend(self, q: torch.Tensor, layer, out: torch.Tensor) -> None:
        """q [bs, Hq, D] -> out [bs, Hq, D]: device work only, on the bucket's tables."""
        bk, pool = self.bucket, self.pool
        local, h = layer.layer_id - pool.start_layer, pool.head_num
        self.plan_bucket(bk, q.shape[1], layer.scaling)
        dec = bk.decoder
        q_rot, q_s = dec.queries(q, bk.basis_ptrs, local * h, bk.req_pages)
        sel = {}
        if bk.bounds is not None:
            bounds = page_bounds(q_rot, pool.store.meta[local], bk.seg_indptr, bk.seg_ids,
                                 self.row_pages, out=bk.bounds, rows_per_out=self.width)
            rescore = self.rescore
            ids, counts = select_page_list(
                bounds, bk.req_pages, self.budget_pages * (rescore[0] if rescore else 1),
                self.sink_pages, self.recent_pages)
            if rescore:  # the candidates re-ranked on their compressed K (bounds overwritten)
                store = pool.store
                scores = page_rescore(q_rot, store.data[local], store.headers[local],
                                      store.plans, bk.seg_indptr, bk.seg_ids, ids, counts,
                                      rows_per_owner=self.width, row_pages=self.row_pages,
                                      pages_per_seg=self.pps, channels=rescore[1],
                                      out=bk.bounds, layout=rescore[2])
                ids, counts = select_page_list(scores, bk.req_pages, self.budget_pages,
                                               self.sink_pages, self.recent_pages)
            sel = {"page_ids": ids, "page_counts": counts}
        dec.run(q_rot, q_s, self.tables(bk, local), bk.basis_ptrs, (pool.layer_num + local) * h,
                out, **sel)

    def tables(self, bk: _Bucket, local: int) -> DecodeTables:
        pool, store = self.pool, self.pool.store
        return DecodeTables(store.data[local], store.headers[local], store.plans, bk.seg_indptr,
                            bk.seg_ids, bk.req_pages, pool.k_buffer[local], pool.v_buffer[local],
                            bk.hot_rows, bk.hot_lens)

    def stats(self) -> dict:
        """Steps replayed and refused, and the selection's (page, KV head) pairs over replayed
        steps: `pages_available` counted where each step's tables are made (`prepare` on the
        host, `prepare_on_device` into a device counter), `pages_read` summed by the decode's
        stage 2 into a device counter per bucket, `read_fraction` their ratio. The device
        counters are read here only (one host sync per counter, for stats)."""
        read = self.pages_read_unselected
        for bk in self.buckets.values():
            if bk.decoder.read is not None:
                read += int(bk.decoder.read.sum())
        available = self.pages_available
        if self.pages_available_dev is not None:
            available += int(self.pages_available_dev)
            if not self.cfg.select.enabled:
                read += int(self.pages_available_dev)
        return {"graph_steps": self.steps, "graph_request_steps": self.request_steps,
                "graph_eager_steps": self.eager_steps, "buckets": sorted(self.buckets),
                "rows_per_request": self.width, "device_planned_steps": self.device_steps,
                "selection": PageReads(available, read).stats()}


@dataclass
class DevicePageTable:
    """The pool's page table as the device-built tables read it: per logical page whether it is
    sealed, the address of its block's bases (0: none) and its hot page (-1: none). The
    addresses point into the sealed pages' bases, alive while the pages are."""
    sealed: torch.Tensor  # bool [P]
    basis_addr: torch.Tensor  # int64 [P]
    hot_page: torch.Tensor  # int64 [P]

    @classmethod
    def of(cls, pool) -> "DevicePageTable":
        """A whole copy of the pool's host arrays (tests; `GraphDecode` keeps its own copy up to
        date by changed spans instead)."""
        n = pool.num_logical_pages + 1
        dev = pool.device
        return cls(torch.from_numpy(pool.page_sealed[:n].copy()).to(dev),
                   torch.from_numpy(pool.page_basis_addr[:n].copy()).to(dev),
                   pool.hot_page_of[:n].to(dev))
