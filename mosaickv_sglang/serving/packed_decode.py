"""Batched decode attention through the packed Triton kernels, over the pool's SegmentStore.

Once per decode step, before the forward (the backend's forward-metadata hook, after the step's
sealing), the batch's structure is read on the host from one
device->host copy of the page table: each request's sealed pages (a prefix of its pages), split
into *rows* by basis block (the kernel rotates q once per row), plus its hot tokens, attached to
its last row. Per layer the kernel runs over every row of the batch in one launch, reading the
arena in place; rows of one request are merged with their log-sum-exps. Page selection runs on
the device from the store's page metadata (`page_select`: bounds, then the top pages per request
across its rows; with `select.rescore_factor` the bound's candidates re-ranked on their
compressed K, `page_rescore`), the same rule as the reference selector. A request whose sealed pages include a
segment the kernel cannot read (dense fallback, non-band sink) goes through the reference path,
counted and logged once. Per layer nothing waits on the device: the bases are the stored read
transforms (no inverse, see codec/basis.py), read in place by address (a table of each row's
block, `basis_rotate`, built once per step like every index tensor), never stacked per layer.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from mosaickv_kernels.band_decode import BandDecodeWrapper
from mosaickv_kernels.band_unpack import compile_variant as compile_unpack_variant, unpack_segments
from mosaickv_kernels.basis_rotate import BasisTable, basis_pointers
from mosaickv_kernels.page_select import RowSelection
from mosaickv_kernels.row_merge import merge_rows

from ..codec.arena import PackedArena
from ..codec.attention import PageReads, decode_attention
from ..codec.basis import kernel_transform
from ..codec.timing import StepProfiler

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """Host-side structure of one decode batch, shared by every layer of the step."""
    kernel_reqs: torch.Tensor  # int64 [K] (device): batch indices decoded by the kernel
    # batch index -> (its slots, its prompt length or None), for the torch reference
    reference_slots: dict[int, tuple[torch.Tensor, int | None]]
    row_req: torch.Tensor  # int64 [R] (device): batch index of each row
    row_bases: list  # each row's BasisPair (None: the identity, a row without sealed pages)
    seg_indptr: torch.Tensor  # int32 [R+1]
    seg_ids: torch.Tensor  # int32 [sum pages]
    hot_index: torch.Tensor  # int64 [R, T_max]: hot-buffer rows (padding -> row 0)
    hot_lens: torch.Tensor  # int32 [R]
    rows: RowSelection | None  # the selector's row layout, when some request needs selection
    merge: bool  # some request spans several rows
    req_rows: torch.Tensor  # int64 [K, max rows] (device): each kernel request's rows (pad: R)
    basis_ptrs: torch.Tensor  # int64 [R] (device): each row's BasisPair.whole address (0: identity)
    basis_keep: list  # the tensors those addresses point into, alive for the step


def host_seq_lens(forward_batch, rows: int) -> list[int]:
    """The first `rows` requests' lengths, from the CPU copy SGLang keeps (else one copy)."""
    lens = getattr(forward_batch, "seq_lens_cpu", None)
    return (forward_batch.seq_lens.cpu() if lens is None else lens)[:rows].tolist()


def host_batch(forward_batch, req_to_token, rows: int, page_size: int):
    """(seq_lens, page_ids) of the batch's first `rows` requests on the host: their lengths and,
    in one device->host copy, the logical page of every page ([rows, pages], position order):
    what a decode step's sealing and plan read."""
    seq_lens = host_seq_lens(forward_batch, rows)
    page_ids = req_to_token[forward_batch.req_pool_indices[:rows],
                            :max(seq_lens, default=0):page_size].cpu() // page_size
    return seq_lens, page_ids


def host_prompts(pool, forward_batch, rows: int) -> list | None:
    """The batch's first `rows` requests' prompt lengths (`pool.prompt_lens_of`) where the read
    rule uses them (`pool.prompt_split`: one device->host copy of their request indices), else
    None (no host work)."""
    if not pool.prompt_split:
        return None
    return pool.prompt_lens_of(forward_batch.req_pool_indices[:rows].tolist())


def _sealed_runs(pool, pages: np.ndarray, seq_len: int, prompt: int | None = None):
    """(n, runs, run_bases): the first n of a request's `pages` (numpy, position order) that its
    token at seq_len - 1 reads compressed (`pool.read_split_np`; `prompt` its prompt length),
    split into runs of pages sharing a basis block, and each run's BasisPair. Vectorized over
    the pool's page table; one dict lookup per run."""
    n = pool.read_split_np(pages, seq_len - 1, prompt)
    read = pages[:n]
    if not n:
        return 0, [], []
    keys = pool.page_basis[read]
    change = np.empty(n, dtype=bool)
    change[0] = True
    np.not_equal(keys[1:], keys[:-1], out=change[1:])
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], n)
    return n, [read[a:b] for a, b in zip(starts, ends)], \
        [pool.sealed[int(read[a])].bases for a in starts]


def request_reads(pool, page_ids: torch.Tensor, seq_len: int, prompt: int | None = None):
    """What one request's decode token (position seq_len - 1) reads, from its page ids (host,
    position order) and its prompt length (`prompt`, None: unknown or not needed): (n, the
    first n pages read compressed by the read rule, their runs of pages sharing a basis block
    (numpy arrays), each run's BasisPair, the hot pages of the rest). A sealed set that is not
    a prefix is repaired first (`pool.seal_prefix_now`), and so are runs that are not the
    position blocks (`pool.rebase_blocks`: the decode graph's rows are those blocks)."""
    pages = page_ids.numpy()
    # the host hot-page map, read in place as numpy (~10x cheaper than torch indexing here);
    # a view, so it sees the repair's updates below
    hot_of = pool.hot_page_of.numpy()
    n, runs, run_bases = _sealed_runs(pool, pages, seq_len, prompt)
    if (hot_of[pages[n:]] < 0).any() and pool.seal_prefix_now(pages.tolist()):  # not a prefix
        n, runs, run_bases = _sealed_runs(pool, pages, seq_len, prompt)
    if not position_blocks(pool, n, runs) and pool.rebase_blocks(pages, n):
        n, runs, run_bases = _sealed_runs(pool, pages, seq_len, prompt)
    return n, runs, run_bases, torch.from_numpy(hot_of[pages[n:]])


def position_blocks(pool, n: int, runs: list) -> bool:
    """Whether a request's runs of its `n` compressed pages sharing a basis (`_sealed_runs`) are
    its position blocks (`basis_block_tokens` each, the last one shorter or whole): what sealing
    makes, and the decode graph's rows."""
    block = pool.cfg.basis_block_tokens // pool.page_size
    return len(runs) == -(-n // block) and all(len(r) == block for r in runs[:-1])


def readable(pool, pages: torch.Tensor) -> bool:
    """Whether the kernel can read every layer of these sealed pages (the store tracks the few
    it cannot: `SegmentStore.unreadable`)."""
    return not pool.store.unreadable or pool.store.unreadable.isdisjoint(pages.tolist())


def hot_slots(hot_pages: torch.Tensor, page_size: int, count: int) -> torch.Tensor:
    """The hot-buffer rows of a request's first `count` hot tokens, from its hot pages."""
    hot = hot_pages.numpy()
    if (hot < 0).any():
        raise RuntimeError("MosaicKV: read of a logical page that is neither hot nor sealed")
    return torch.from_numpy((hot[:, None] * page_size + np.arange(page_size)).ravel()[:count])


def rescore_plan(sel, head_dim: int) -> tuple[int, int, str] | None:
    """The decode kernels' second selection stage (`page_rescore`) for SelectionConfig `sel`:
    (candidate factor, leading channels scored, kernel layout) or None; what they cannot do is
    refused."""
    if not (sel.enabled and sel.rescore_factor):
        return None
    if sel.rescore_meta_only:
        raise ValueError("mosaickv select.rescore_meta_only is read by the torch reference "
                         "decode only (the kernels' second stage scores leading channels, "
                         "`select.rescore_channels`): set decode_kernel 'reference' or drop "
                         "rescore_meta_only in --mosaickv-config")
    r = sel.rescore_channels or head_dim
    if r < 16 or r > head_dim or r & (r - 1):
        raise ValueError(f"mosaickv select.rescore_channels={sel.rescore_channels}: the decode "
                         f"kernels score a power of two of leading channels in [16, "
                         f"head_dim={head_dim}] (0: every channel)")
    return sel.rescore_factor, r, sel.rescore_layout


class PackedDecode:
    def __init__(self, pool):
        if pool.dtype != torch.bfloat16:
            raise ValueError(f"mosaickv decode_kernel 'triton' reads a bf16 hot buffer, but the KV "
                             f"cache is {pool.dtype}: serve with --dtype bfloat16 or set "
                             f"decode_kernel 'reference' in --mosaickv-config")
        self.rescore = rescore_plan(pool.cfg.select, pool.head_dim)
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
        self.prefill_unpacked_segments = 0  # (page, layer)s decompressed by the unpack kernel
        self.timer = StepProfiler(self.cfg.decode_profile_every, pool.device)
        # Selection on every step, within the budget too (keeping all pages): what the decode
        # graph's static plan runs, so a step it refuses decodes by the same rule.
        self.always_select = False
        self.graph = None  # the GraphDecode under decode_cuda_graph "full"

    # ---- per step ----------------------------------------------------------------------
    def begin(self, forward_batch, req_to_token, rows: int | None = None,
              host: tuple | None = None, prompts: list | None = None) -> None:
        """Plan the step for the batch's first `rows` requests (all by default; under a decode
        graph the rest are padding). `host`: their `host_batch`, `prompts`: their
        `host_prompts`, when the caller read them already. The caller starts the profiled
        step."""
        pool, ps = self.pool, self.pool.page_size
        bsz = forward_batch.batch_size if rows is None else rows
        seq_lens, all_ids = host or host_batch(forward_batch, req_to_token, bsz, ps)
        if prompts is None:
            prompts = host_prompts(pool, forward_batch, bsz)
        kernel_reqs, reference_slots = [], {}
        row_req, row_pages, row_bases, hot_rows, needs_select = [], [], [], [], False
        sealed_ids = []  # each kernel request's sealed pages (tensor): the rows' pages in order
        for i, seq_len in enumerate(seq_lens):
            page_ids = all_ids[i, :-(-seq_len // ps)]
            prompt = None if prompts is None else prompts[i]
            n, runs, run_bases, hot = request_reads(pool, page_ids, seq_len, prompt)
            if n and not readable(pool, page_ids[:n]):
                rid = int(forward_batch.req_pool_indices[i])
                reference_slots[i] = (req_to_token[rid, :seq_len], prompt)
                continue
            kernel_reqs.append(i)
            sealed_ids.append(page_ids[:n])
            needs_select |= self.cfg.select.enabled and (
                self.always_select or n * ps > self.cfg.select.budget_tokens)
            hot = hot_slots(hot, ps, seq_len - n * ps)
            for r, run in enumerate(runs or [[]]):  # a row without pages reads the identity
                row_req.append(i)
                row_pages.append(run)
                row_bases.append(run_bases[r] if runs else None)
                hot_rows.append(hot if r == max(len(runs) - 1, 0) else hot[:0])
        dev = pool.device
        t_max = max([h.numel() for h in hot_rows] + [1])
        hot_index = torch.zeros(len(hot_rows), t_max, dtype=torch.long)
        for r, h in enumerate(hot_rows):
            hot_index[r, :h.numel()] = h
        indptr = torch.zeros(len(row_pages) + 1, dtype=torch.int32)
        indptr[1:] = torch.tensor([len(p) for p in row_pages], dtype=torch.int32).cumsum(0)
        req_rows = [[] for _ in kernel_reqs]  # rows are appended request by request
        slot_of = {b: k for k, b in enumerate(kernel_reqs)}
        for r, b in enumerate(row_req):
            req_rows[slot_of[b]].append(r)
        width = max([len(x) for x in req_rows] + [1])
        req_rows = [x + [len(row_req)] * (width - len(x)) for x in req_rows]
        rows = None
        if needs_select:
            pps = ps // self.cfg.page_tokens
            rows = RowSelection(row_req, [len(p) * pps for p in row_pages], dev)
        self.step = StepPlan(
            torch.tensor(kernel_reqs, dtype=torch.long).to(dev), reference_slots,
            torch.tensor(row_req, dtype=torch.long).to(dev), row_bases,
            indptr.to(dev),
            (torch.cat(sealed_ids) if sealed_ids else torch.zeros(0)).to(dev, torch.int32),
            hot_index.to(dev), torch.tensor([h.numel() for h in hot_rows], dtype=torch.int32).to(dev),
            rows, len(row_req) > len(kernel_reqs),
            torch.tensor(req_rows, dtype=torch.long).reshape(len(kernel_reqs), width).to(dev),
            *basis_pointers([None if b is None else b.stacked() for b in row_bases], dev))
        self.kernel_requests += len(kernel_reqs)
        if reference_slots:
            if not self.reference_requests:
                logger.warning("MosaicKV: %d request(s) hold segments the packed kernel cannot read "
                               "(dense fallback or non-band sink): decoded by the torch reference; "
                               "counted in stats as reference_decode_requests", len(reference_slots))
            self.reference_requests += len(reference_slots)
        self.timer.lap("host_plan")

    # ---- per layer ---------------------------------------------------------------------
    def attend(self, q: torch.Tensor, layer, out: torch.Tensor) -> None:
        """q [B, Hq, D] -> writes out [B, Hq, D] for every request of the step."""
        st, pool, timer = self.step, self.pool, self.timer
        timer.lap("between_layers")  # since the previous layer's attention
        for i, (slots, prompt) in st.reference_slots.items():
            view = pool.layer_view(layer.layer_id, slots, prompt)
            o, info = decode_attention(q[i:i + 1].float(), view, torch.tensor([len(slots) - 1]),
                                       self.cfg.select, self.cfg.page_tokens,
                                       sm_scale=layer.scaling)
            pool.reference_reads.add(info)
            out[i] = o[0].to(out.dtype)
        if st.reference_slots:
            timer.lap("reference")
        if not st.kernel_reqs.numel():
            return
        arena = self._arena(layer.layer_id - pool.start_layer)
        if layer.layer_id == pool.start_layer:
            self.wrapper.plan(arena, q.shape[1], sm_scale=layer.scaling,
                              width_classes=pool.store.width_classes)
        timer.lap("arena")
        q_rows = q[st.row_req]
        queries = self.wrapper.queries(q_rows, arena)  # shared by the selector and the kernels
        sel = {}
        if st.rows is not None:  # some request exceeds the budget: the GPU selector
            sel = dict(zip(("page_ids", "page_counts"), self.wrapper.select(
                q_rows, arena, pool.store.meta[layer.layer_id - pool.start_layer],
                budget_pages=self.budget_pages, sink_pages=self.sink_pages,
                recent_pages=self.recent_pages, rows=st.rows, queries=queries,
                rescore=self.rescore)))
        timer.lap("select")
        o_rows = self.wrapper.run(q_rows, arena, out_dtype=torch.float32, queries=queries, **sel)
        timer.lap("kernels")
        if not st.merge:
            out[st.row_req] = o_rows.to(out.dtype)
            timer.lap("merge")
            return
        # Rows of one request: softmax(lse) over its rows through the step's padded row table,
        # written into `out` by one launch (every request has a non-empty row).
        merge_rows(o_rows, self.wrapper.lse.view(len(st.row_req), q.shape[1]), st.req_rows,
                   st.kernel_reqs, out)
        timer.lap("merge")

    def _arena(self, local: int) -> PackedArena:
        st, pool = self.step, self.pool
        # The kernels read q R^T and o_rot R, R the stored read transform of each row's block,
        # in place by address (one table per step).
        h = pool.head_num
        basis = BasisTable(st.basis_ptrs, local * h, (pool.layer_num + local) * h,
                           st.basis_keep)
        self.timer.lap("bases")
        # the hot tokens are read in place through the step's row table (no gathered copy)
        hot_k, hot_v = pool.k_buffer[local], pool.v_buffer[local]
        store = pool.store
        return PackedArena(store.data[local], store.headers[local], st.seg_indptr, st.seg_ids,
                           None, None, hot_k, hot_v, st.hot_lens, store.plans,
                           segment_tokens=pool.page_size, page_tokens=self.cfg.page_tokens,
                           payload={"codes": 0, "scales": 0}, min_group=store.min_group,
                           basis=basis, hot_rows=st.hot_index)

    # ---- prefill over a compressed prefix -------------------------------------------------
    def compile_unpack(self) -> int:
        """Compile the `band_unpack` variant `unpack` launches (start-up, CUDA). Returns
        variants compiled."""
        pool = self.pool
        compile_unpack_variant(pool.head_num, pool.page_size, pool.head_dim, pool.dtype)
        return 1

    def unpack(self, local: int, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [len(pages) * page_size, H, D] (cache dtype, raw basis) of packed sealed pages,
        token-major in `pages` order: one `band_unpack` launch reading the arena in place."""
        pool, dev = self.pool, self.pool.device
        blocks, seg_req = pool.basis_blocks(pages)
        h, d, n = pool.head_num, pool.head_dim, len(blocks)
        store = pool.store
        arena = PackedArena(
            store.data[local], store.headers[local],
            torch.zeros(n + 1, dtype=torch.int32, device=dev),  # no segment lists: only bases
            torch.zeros(0, dtype=torch.int32, device=dev),
            kernel_transform(torch.stack([b.k[local] for b in blocks])),
            kernel_transform(torch.stack([b.v[local] for b in blocks])),
            *(torch.zeros(n, h, 1, d, dtype=pool.dtype, device=dev),) * 2,
            torch.zeros(n, dtype=torch.int32, device=dev), store.plans,
            segment_tokens=pool.page_size, page_tokens=self.cfg.page_tokens,
            payload={"codes": 0, "scales": 0}, min_group=store.min_group)
        k = torch.empty(len(pages) * pool.page_size, h, d, dtype=pool.dtype, device=dev)
        v = torch.empty_like(k)
        unpack_segments(arena, torch.tensor(pages, dtype=torch.int32).to(dev),
                        torch.tensor(seg_req, dtype=torch.int32).to(dev), k, v)
        self.prefill_unpacked_segments += len(pages)
        return k, v

    def stats(self) -> dict:
        """`selection`: (page, KV head) pairs of the compressed pages the kernels decoded over
        (`pages_available`, summed over layers and steps) and those they read (`pages_read`: the
        GPU selector's picks in steps where it ran, else all). Requests sent to the reference
        path are counted apart, in the pool's `selection_reference`. One host sync, here."""
        return {"kernel_request_steps": self.kernel_requests,
                "reference_decode_requests": self.reference_requests,
                "prefill_unpacked_segments": self.prefill_unpacked_segments,
                "selection": PageReads(*self.wrapper.page_reads()).stats(),
                "profile": self.timer.report(),
                **({} if self.graph is None else {"graph": self.graph.stats()})}
