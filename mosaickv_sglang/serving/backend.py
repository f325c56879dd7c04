"""Attention backend ``mosaickv``: decode on the packed pages, prefill through a workspace.

* decode: the sealed pages (packed) plus the dense hot buffer, merged with log-sum-exp, with
  query-aware page selection: on CUDA (``decode_kernel: auto``) one Triton launch per layer over
  the whole batch, reading the pool's packed arena in place (`packed_decode.py`); elsewhere the
  codec's torch reference per request;
* extend/prefill: sealed prefix pages are decompressed into a workspace and a chunk's queries
  attend over (workspace + hot rows) through torch SDPA or FlashInfer's prefill kernel
  (`prefill_attention`, `prefill_attention.py`);
* sealing: full pages ``hot_tokens`` behind their request's last token are sealed (compressed;
  ``daemon: off``: synchronously, else sent to the daemon) after a prefill's last layer, and for
  decode between steps: in the forward-metadata hook, before the step's write mapping and plan
  (``_prepare_decode``), so the decode forward itself does no host planning or sealing. With
  ``decode_seal_layers`` a page decode makes sealable is sealed that many layers a step there
  (read dense until its last layer is sealed and it is installed).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import eager_on_graph

from ..codec.attention import decode_attention
from .graph_decode import GraphDecode, band_pairs
from .packed_decode import PackedDecode, host_batch, host_prompts
from .pool import MosaicKVPool
from .prefill_attention import ChunkAttention, chunk_attention, gather_chunks, \
    prefill_attention_kernel

logger = logging.getLogger(__name__)
LOG_EVERY_PAGES = 16  # a stats line in the server log each time this many more pages seal


def _compile_ahead(what: str, compile_fn, later: str) -> None:
    """Run `compile_fn` (start-up compiles; it returns how many variants it compiled, 0 where
    none are needed) and log it; a failure only moves the compiles to first use (`later`
    says when): logged, not raised (performance only: the launch compiles anyway)."""
    t0 = time.perf_counter()
    try:
        n = compile_fn()
    except Exception as exc:  # noqa: BLE001
        logger.warning("MosaicKV: compiling the %s at start-up failed (%r): %s", what, exc, later)
        return
    if n:
        logger.info("MosaicKV: compiled %d %s in %.1f s", n, what, time.perf_counter() - t0)


class MosaicAttnBackend(TorchNativeAttnBackend):
    def __init__(self, model_runner):
        super().__init__(model_runner)
        pool = self.token_to_kv_pool
        if not isinstance(pool, MosaicKVPool):
            raise RuntimeError(f"attention backend 'mosaickv' needs the MosaicKV pool, got "
                               f"{type(pool).__name__}: start with --kv-backend mosaickv")
        self.pool: MosaicKVPool = pool
        self.cfg = pool.cfg
        self.last_layer = pool.start_layer + pool.layer_num - 1
        on_cuda = torch.device(pool.device).type == "cuda"
        kernel = self.cfg.decode_kernel
        if kernel == "auto":
            kernel = "triton" if on_cuda else "reference"
        # Decode over sealed pages: the packed Triton kernels, or the torch codec per request.
        self.packed = PackedDecode(pool) if kernel == "triton" else None
        pool.decode_path = self.packed
        # decode_cuda_graph "full": the decode step recorded in SGLang's full decode graph
        self.graph: GraphDecode | None = None
        if self.cfg.decode_cuda_graph == "full":
            if self.packed is None:
                raise ValueError("mosaickv decode_cuda_graph 'full' records the Triton decode "
                                 "path: it needs decode_kernel 'triton' (or 'auto' on CUDA)")
            pool.store.freeze_layouts(band_pairs(self.cfg), pool.page_size)
            self.packed.always_select = True  # a refused step decodes by the graph's rule
            self.graph = GraphDecode(pool, model_runner.model_config.context_len,
                                     self.packed.timer)
            self.packed.graph = self.graph
        # Kernel variants a live step would otherwise compile on first use (seconds each),
        # compiled now: every band-pack variant a seal may launch, the errors-first chooser's
        # `band_errors` per candidate width, the prefill's read of a compressed prefix, the
        # decode graph's device-built tables.
        pairs = band_pairs(self.cfg)
        _compile_ahead("band-pack kernel variants (every candidate layout's K and V)",
                       lambda: pool.store.compile_pack_kernels(pairs, pool.page_size),
                       "each compiles when a page first needs it")
        _compile_ahead("band-errors (and band-encode) kernel variants (the chooser's candidates)",
                       lambda: pool.store.compile_chooser_kernels(pairs, pool.page_size,
                                                                  self.cfg.chooser,
                                                                  self.cfg.encode_kernel),
                       "each compiles when a candidate is first tried")
        # A prefill forward's chunk attention (ChunkAttention: one plan per forward, one launch
        # per layer): its kernel, compiled now (FlashInfer JIT-builds its batch prefill module at
        # first use: a minute on a fresh machine).
        self.prefill_dtype = getattr(model_runner, "dtype", pool.dtype)  # the queries' dtype
        self.prefill_kernel = prefill_attention_kernel(self.cfg.prefill_attention, pool.device,
                                                       self.prefill_dtype)
        pool.prefill_attention = {"kernel": self.prefill_kernel, "calls": 0}
        self.chunk_attention = ChunkAttention(self.prefill_kernel)
        if self.prefill_kernel == "flashinfer":
            _compile_ahead("FlashInfer prefill attention module",
                           lambda: self._compile_prefill(model_runner),
                           "it compiles at the first prefill")
        if on_cuda and self.packed is not None:
            _compile_ahead("prefix-unpack kernel variant", self.packed.compile_unpack,
                           "it compiles at the first chunk after a compressed prefix")
            if self.graph is not None:  # (the graph runs on the packed path)
                _compile_ahead("decode-table kernel variant", self.graph.compile_tables,
                               "it compiles at the first decode step planned on the device")
        # Real rows of the batch under a breakable decode graph (None: an eager step); see
        # init_forward_metadata_out_graph.
        self.graph_rows: int | None = None
        self.chunk_seal = None  # the prefill forward's layer-by-layer sealing (pool.ChunkSeal)
        self._prepared = None  # the batch whose decode step init_forward_metadata prepared
        # the prompt lengths of the requests of the forward in progress (`host_prompts`: None
        # where the read rule does not use them), read once per forward
        self.extend_prompts: list | None = None
        self.decode_prompts: list | None = None
        logger.info("MosaicKV decode path: %s", kernel)

    def _compile_prefill(self, model_runner) -> int:
        """One tiny chunk through a throw-away ChunkAttention at the model's dtype and head
        shape (what FlashInfer keys its JIT module on) -> 1."""
        mc, hk, d = model_runner.model_config, self.pool.head_num, self.pool.head_dim
        group = max(1, mc.num_attention_heads // max(1, mc.num_key_value_heads))
        ps = self.pool.page_size
        q = torch.zeros(hk * group, 16, d, dtype=self.prefill_dtype, device=self.pool.device)
        kv = torch.zeros(hk, ps + 16, d, dtype=self.prefill_dtype, device=self.pool.device)
        chunk_attention(q, kv[:, :ps], kv[:, :ps], kv[:, ps:], kv[:, ps:], ps,
                        torch.ones(16, dtype=torch.long), 1, ps, d ** -0.5, True,
                        self.prefill_kernel)
        torch.cuda.synchronize(self.pool.device)
        return 1

    # ---- extend -------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if save_kv_cache and k is not None:
            self.pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        q_ = q.view(-1, hq, d)
        o = q.new_empty((q_.shape[0], hq * layer.v_head_dim))
        o_ = o.view(-1, hq, layer.v_head_dim)
        req_to_token = self.req_to_token_pool.req_to_token
        pool, timer, ps = self.pool, self.pool.prefill_timer, self.pool.page_size
        local = layer.layer_id - pool.start_layer
        reqs = [(int(forward_batch.req_pool_indices[i]), int(forward_batch.seq_lens[i]),
                 int(forward_batch.extend_seq_lens[i])) for i in range(forward_batch.batch_size)]
        if layer.layer_id == pool.start_layer:
            timer.step()
            self.extend_prompts = pool.prompt_lens_of([rid for rid, _, _ in reqs])
            if pool.position_rule:
                # The position rule (pool.compressed_pages): pages the chunk's own later tokens
                # read compressed are sealed layer by layer in this forward, installed after
                # its last. Under the chunk rule a chunk reads what was sealed before it.
                self.chunk_seal = pool.plan_chunk_seal(
                    [((req_to_token[rid, :seq_len:ps] // ps).tolist(), seq_len - 1, prompt)
                     for (rid, seq_len, _), prompt in zip(reqs, self.extend_prompts)])
                timer.lap("plan_chunk_seal")
        else:
            timer.lap("between_layers")
        fresh = {}
        if self.chunk_seal is not None:
            fresh = pool.seal_chunk_layer(self.chunk_seal, local)
            timer.lap("chunk_seal")
        # every request's chunk: what it reads (compressed pages, dense tokens), then one
        # launch for the whole forward's runs (planned at the first layer, the same after)
        specs, key, kcs, vcs, kds, vds = [], [], [], [], [], []
        for (rid, seq_len, n_new), prompt in zip(reqs, self.extend_prompts):
            first = seq_len - n_new
            kc, vc, kd, vd, jc, ja = pool.chunk_kv(local, req_to_token[rid, :seq_len], first, fresh,
                                                   prompt)
            specs.append((first, n_new, pool.chunk_reads(first, seq_len, ja, prompt), ja, jc))
            key.append((first, n_new, ja, jc, prompt))
            for acc, x in zip((kcs, vcs, kds, vds), (kc, vc, kd, vd)):
                acc.append(x.to(q.dtype))
        timer.lap("read_prefix")
        runner = self.chunk_attention
        plan = runner.plan(specs, ps, pool.position_rule, (hq, self.pool.head_num, d), q.dtype,
                           layer.scaling, q.device, key=tuple(key))
        k_buf, v_buf = gather_chunks(plan, kcs, kds), gather_chunks(plan, vcs, vds)
        del kcs, vcs, kds, vds
        timer.lap("gather")
        runner.run(plan, q_, k_buf, v_buf, layer.scaling, out=o_)
        pool.prefill_attention["calls"] += 1
        timer.lap("attention")
        if layer.layer_id == self.last_layer and self.chunk_seal is not None:
            pool.finish_chunk_seal(self.chunk_seal)
            self.chunk_seal = None
            timer.lap("chunk_install")
        if self._maybe_seal(layer, forward_batch):
            timer.lap("seal")
            timer.end()
        return o

    # ---- before each forward: the step's host work -----------------------------------------
    # Everything a decode step decides on the host runs here, between steps, before the model
    # forward: sealing what the previous step made sealable, hot pages for this step's writes
    # (and the device table they map through), and the plan every layer shares. The forward
    # itself only writes through the prepared mapping and launches attention.
    def init_forward_metadata(self, forward_batch) -> None:
        self.graph_rows = None  # an eager step
        super().init_forward_metadata(forward_batch)
        mode = forward_batch.forward_mode
        if mode.is_decode():
            self._prepare_decode(forward_batch, forward_batch.batch_size, forward_batch.out_cache_loc)
        elif not mode.is_idle() and forward_batch.out_cache_loc is not None:
            self.pool.prepare_writes(forward_batch.out_cache_loc)  # extend: hot pages up front

    def _prepare_decode(self, forward_batch, rows: int, loc) -> None:
        """The decode step's host work for the batch's first `rows` requests (the real ones
        under a graph): seal (each request's tokens before this step's, as sealing after the
        previous step's last layer did), map this step's writes (`loc`), plan."""
        pool, req_to_token = self.pool, self.req_to_token_pool.req_to_token
        timer = self.packed.timer if self.packed is not None else None
        graph = self.graph is not None and self.graph_rows is not None
        skip = graph and self.graph.can_skip_host(forward_batch, rows)
        if timer is not None:  # a graph step with host work is timed whatever its number
            timer.step(forced=graph and not skip)
        self.decode_prompts = None
        if skip:
            # nothing to seal or map at this step: the replay's tables built on the device
            self.graph.prepare_on_device(forward_batch, req_to_token, rows)
            if timer is not None:
                timer.lap("device_plan")
            self._prepared = forward_batch
            return
        # read once for the sealing and the plan: lengths, and every request's logical pages
        host = lens, page_ids = host_batch(forward_batch, req_to_token, rows, pool.page_size)
        # and their prompt lengths, where the read rule uses them (one copy of their indices)
        prompts = self.decode_prompts = host_prompts(pool, forward_batch, rows)
        before = pool.counters.sealed_pages
        with pool.batched_seals():  # every request's new pages sealed in one batch
            for i, seq_len in enumerate(lens):
                pool.seal_request_pages(page_ids[i], seq_len - 1, decode_step=True,
                                        prompt=None if prompts is None else prompts[i])
        if pool.decode_sealing:  # decode_seal_layers: the next layers of the pages in flight
            pool.advance_decode_seals()
        if graph and pool.daemon is not None:  # the daemon's pages in flight are read hot:
            # seal those a request needs to fit the graph's hot table (counted, logged)
            for i, seq_len in enumerate(lens):
                pool.bound_hot_reads(page_ids[i], seq_len,
                                     None if prompts is None else prompts[i], self.graph.hot_cap)
        if pool.counters.sealed_pages // LOG_EVERY_PAGES > before // LOG_EVERY_PAGES:
            logger.info(pool.summary())
        if timer is not None:
            timer.lap("seal")
        if graph:  # writes map through the device table: the pages they write, from the host
            # (req_to_token[req, seq_len - 1] is this step's slot: SGLang's alloc_for_decode);
            # padded rows write slot 0, page 0 (SGLang's buffer registry zeroes their
            # out_cache_loc on every replay: cuda_graph_buffer_registry.py, policy ZERO)
            at = (np.asarray(lens, dtype=np.int64) - 1) // pool.page_size
            pages = page_ids.numpy()[np.arange(len(lens)), at].astype(np.int64)
            if rows < forward_batch.batch_size:
                pages = np.append(pages, 0)
            pool.map_write_pages(pages)
        else:
            pool.prepare_writes(loc)
        if timer is not None:
            timer.lap("writes")
        if graph:
            self.graph.prepare(forward_batch, req_to_token, rows, host, prompts)  # its tables
            if timer is not None:
                timer.lap("host_plan")
        elif self.packed is not None:
            self.packed.begin(forward_batch, req_to_token, rows, host, prompts)  # laps host_plan
        self._prepared = forward_batch

    # ---- decode under a breakable CUDA graph ---------------------------------------------
    # The graph replays the model's layers; each layer's forward_decode runs eagerly between
    # its segments (`_decode_between_segments`), on the capture-time ForwardBatch: its tensors
    # are refreshed in place before each replay, but it is padded to the captured batch size.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Nothing static to allocate: the attention runs outside the graph's segments."""
        self.graph_rows = None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Before each warm-up/capture (every row a dummy: decode nothing) and each replay (the
        first batch_size - num_padding rows are real; padded rows point at request 0, slot 0):
        the replay's host work (`_prepare_decode`) on SGLang's replay view of the batch (its
        padded static buffers, and the live `out_cache_loc`)."""
        self.graph_rows = 0 if in_capture else (
            forward_batch.batch_size - getattr(forward_batch, "num_padding", 0))
        if self.graph is not None:
            self.graph.bucket_for(forward_batch.batch_size)
            if in_capture:  # every row padded: the tables of a step that reads padding only
                self.graph.prepare(forward_batch, self.req_to_token_pool.req_to_token, 0)
                return
        if self.graph_rows:
            self._prepare_decode(forward_batch, self.graph_rows, forward_batch.out_cache_loc)

    def graph_refusal(self, forward_batch) -> str | None:
        """Under decode_cuda_graph "full" (SGLang's can_run_graph asks, wiring): why this
        decode batch must run eagerly (counted, logged the first time), or None."""
        if self.graph is None:
            return None
        why = self.graph.graph_refusal(forward_batch, self.req_to_token_pool.req_to_token)
        if why is not None:
            if not self.graph.eager_steps:
                logger.warning("MosaicKV: a decode step runs eagerly instead of replaying the "
                               "graph (%s); counted in stats as graph_eager_steps", why)
            self.graph.eager_steps += 1
        return why

    # ---- decode -------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return _decode_between_segments(self, q, k, v, layer, forward_batch, save_kv_cache)

    def _decode(self, q, k, v, layer, forward_batch, save_kv_cache):
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        q_ = q.reshape(-1, hq, d)
        if self.graph is not None and self.graph_rows is not None:
            # recorded in the full decode graph (its warm-ups run it, the capture records it,
            # replays run the recording): device work on the tables prepared before the replay
            if save_kv_cache and k is not None:
                self.pool.write_by_table(layer, forward_batch.out_cache_loc, k, v)
            o_ = q_.new_empty((q_.shape[0], hq, layer.v_head_dim))
            self.graph.attend(q_, layer, o_)
            return o_.reshape(q_.shape[0], hq * layer.v_head_dim)
        rows = forward_batch.batch_size if self.graph_rows is None else self.graph_rows
        if rows == 0:  # a graph warm-up or capture: dummy rows, nothing to write or read
            return q_.new_zeros((q_.shape[0], hq * layer.v_head_dim))
        if self.graph_rows is None and self._prepared is not forward_batch:
            raise RuntimeError("MosaicKV: forward_decode on a batch init_forward_metadata did "
                               "not prepare (the step's sealing, writes and plan run there)")
        if save_kv_cache and k is not None:
            if self.graph_rows is None:
                self.pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
            else:  # the capture-time slots (padded rows: slot 0, the padding page)
                self.pool.write_by_table(layer, forward_batch.out_cache_loc, k, v)
        o_ = (q_.new_empty if rows == q_.shape[0] else q_.new_zeros)(
            (q_.shape[0], hq, layer.v_head_dim))
        req_to_token = self.req_to_token_pool.req_to_token
        if self.packed is not None:
            self.packed.attend(q_, layer, o_)
            return o_.reshape(q_.shape[0], hq * layer.v_head_dim)
        prompts = self.decode_prompts
        for i in range(rows):
            rid = int(forward_batch.req_pool_indices[i])
            seq_len = int(forward_batch.seq_lens[i])
            view = self.pool.layer_view(layer.layer_id, req_to_token[rid, :seq_len],
                                        None if prompts is None else prompts[i])
            out, info = decode_attention(q_[i:i + 1].float(), view,
                                         torch.tensor([seq_len - 1]), self.cfg.select,
                                         self.cfg.page_tokens, sm_scale=layer.scaling)
            self.pool.reference_reads.add(info)
            o_[i] = out[0].to(o_.dtype)
        return o_.reshape(q_.shape[0], hq * layer.v_head_dim)

    # ---- sealing ------------------------------------------------------------------------
    def _maybe_seal(self, layer, forward_batch) -> bool:
        """After a prefill's last layer: compress what became sealable (daemon: off,
        synchronous; else submit it to the daemon). Returns whether this was the last layer."""
        if layer.layer_id != self.last_layer:
            return False
        req_to_token = self.req_to_token_pool.req_to_token
        before = self.pool.counters.sealed_pages
        prompts = self.extend_prompts
        with self.pool.batched_seals():  # the batch's pages sealed together
            for i in range(forward_batch.batch_size):
                rid = int(forward_batch.req_pool_indices[i])
                seq_len = int(forward_batch.seq_lens[i])
                self.pool.seal_request(req_to_token[rid, :seq_len], seq_len, prompts[i])
        after = self.pool.counters.sealed_pages
        if after // LOG_EVERY_PAGES > before // LOG_EVERY_PAGES:
            logger.info(self.pool.summary())
        return True


# Under a breakable decode graph, a graph break: the segment before it ends, this runs eagerly
# (at capture once, at every replay again with the capture-time arguments), the next segment
# starts. Outside a capture it is a plain call.
_decode_between_segments = eager_on_graph(True)(MosaicAttnBackend._decode)
