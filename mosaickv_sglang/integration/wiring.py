"""Hooks that put the MosaicKV pool, allocator notifications, backend and stats into SGLang.

Every hook is inert unless the server was started with ``--kv-backend mosaickv`` (the parsed
MosaicConfig rides on ``ServerArgs._mosaickv_config``); ``plugin.register`` installs them.
"""
from __future__ import annotations

import logging

from sglang.srt.plugins.hook_registry import HookType

logger = logging.getLogger(__name__)

CONFIG_ATTR = "_mosaickv_config"
_BCG = ("sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend."
        "BreakableCudaGraphBackend")


def _config_of(server_args):
    return getattr(server_args, CONFIG_ATTR, None)


def _build_token_to_kv_pool(original, self, *, sizes, **kwargs):
    """AROUND KVCacheConfigurator._build_token_to_kv_pool: the MosaicKV pool when enabled."""
    cfg = _config_of(self.server_args)
    if cfg is None:
        return original(self, sizes=sizes, **kwargs)
    from sglang.srt.runtime_context import get_parallel

    from ..serving.pool import MosaicKVPool, hot_buffer_requests
    from ..serving.sizing import (PageBytes, auto_hot_tokens, hot_buffer_bytes, slot_memory,
                                  window_tokens)

    heads = self.model_config.get_num_kv_heads(get_parallel().attn_tp_size)
    head_dim, page = self.model_config.head_dim, self.pool_page_size
    slots, layers = sizes.max_total_num_tokens, self.layer_info.num_effective_layers
    pb = PageBytes.of(cfg, heads, head_dim, self.kv_cache_dtype.itemsize)
    window = window_tokens(cfg)  # the read rule's dense window keeps pages hot (either rule)
    if cfg.hot_buffer_fraction > 0:
        hot = MosaicKVPool.hot_pages_for(slots, page, cfg.hot_buffer_fraction) * page
    else:  # what is in flight, never more than every slot
        hot = min(auto_hot_tokens(cfg, page, self.server_args.chunked_prefill_size,
                                  self.model_config.context_len, window), slots // page * page)
    fit = hot_buffer_requests(hot, page, self.server_args.chunked_prefill_size,
                              self.model_config.context_len, cfg.hot_buffer_fraction, window)
    # the memory SGLang sized these slots with (_compute_cell_size), split by the pool; with
    # --max-total-tokens the slots are the user's and an auto hot buffer comes on top of them
    memory = slot_memory(cfg, pb, slots, layers, page)
    if self.server_args.max_total_tokens and cfg.hot_buffer_fraction == 0:
        memory += hot_buffer_bytes(pb, hot, layers, page)
    pool = MosaicKVPool(
        slots,
        page_size=page,
        dtype=self.kv_cache_dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device=self.device,
        enable_memory_saver=False,
        start_layer=self.layer_info.start_layer,
        end_layer=self.layer_info.end_layer,
        mosaic_config=cfg,
        hot_tokens=hot,
        memory_bytes=memory,
    )
    pool.running_requests_fit = fit  # applied to the scheduler by _cap_running_requests
    return pool


def _cap_running_requests(result, self, *args, **kwargs):
    """AFTER KVCacheConfigurator.configure: a MosaicKV pool's scheduler runs at most as many
    requests as its hot buffer carries beside a prefill chunk (`cap_running_requests`); the
    same on every TP rank (same sizes, same arguments)."""
    from ..serving.pool import MosaicKVPool, cap_running_requests

    pool = result.token_to_kv_pool
    if not isinstance(pool, MosaicKVPool):
        return result
    cap = cap_running_requests(pool.running_requests_fit, result.max_running_requests,
                               self.server_args.max_running_requests, pool.page_size,
                               pool.cfg.hot_buffer_fraction)
    if cap == result.max_running_requests:
        return result
    import msgspec

    result.memory_pool_config.max_running_requests = cap
    return msgspec.structs.replace(result, max_running_requests=cap)


def _compute_cell_size(result, self, kvc, num_layers):
    """AFTER DefaultPoolConfigurator._compute_cell_size: bytes per *logical* token at the
    compressed size, so the same free memory yields more token slots than a dense cache."""
    cfg = _config_of(kvc.server_args)
    if cfg is None or not result:
        return result
    from sglang.srt.runtime_context import get_parallel

    from ..serving.sizing import PageBytes, slot_fraction

    heads = kvc.model_config.get_num_kv_heads(get_parallel().attn_tp_size)
    head_dim = kvc.model_config.head_dim
    dtype_bytes = result // (num_layers * 2 * heads * head_dim) or 2
    frac = slot_fraction(cfg, PageBytes.of(cfg, heads, head_dim, dtype_bytes))
    logger.info("MosaicKV sizing: a token slot costs %.3f of the dense bytes at the smallest "
                "layout (%.2fx the dense slots); the packed bytes each page really takes decide "
                "how many tokens fit (docs/serving.md, capacity)", frac, 1 / frac)
    return int(result * frac)


def _release_page_ids(original, self, *page_ids):
    """AROUND PagedTokenToKVPoolAllocator._release_page_ids: the pool drops freed pages."""
    from ..serving.pool import MosaicKVPool

    pool = self.get_kvcache()
    if isinstance(pool, MosaicKVPool):
        for ids in page_ids:
            pool.release_pages(ids.tolist())
    return original(self, *page_ids)


def _allocator_clear(result, self):
    """AFTER PagedTokenToKVPoolAllocator.clear (e.g. /flush_cache): every page is free again."""
    from ..serving.pool import MosaicKVPool

    pool = self.get_kvcache()
    if isinstance(pool, MosaicKVPool):
        pool.clear()
    return result


def _fused_set_kv_buffer(original, forward_batch) -> bool:
    """AROUND models.utils.enable_fused_set_kv_buffer: off for MosaicKV. The fused RoPE+store
    kernels write K/V straight into get_key_buffer() rows by logical slot id, which would bypass
    the pool's logical -> hot-buffer translation."""
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    from ..serving.pool import MosaicKVPool

    if isinstance(get_token_to_kv_pool(), MosaicKVPool):
        return False
    return original(forward_batch)


def _graph_output_fields(output):
    """The tensor fields of a causal LM's step output (a LogitsProcessorOutput), else None."""
    import dataclasses

    import torch

    if not dataclasses.is_dataclass(output) or type(output).__name__ != "LogitsProcessorOutput":
        return None
    return {f.name: getattr(output, f.name) for f in dataclasses.fields(output)
            if torch.is_tensor(getattr(output, f.name))}


def _mosaickv_graph(self) -> bool:
    runner = getattr(self, "_model_runner", None)
    return _config_of(getattr(runner, "server_args", None)) is not None


def _graph_per_field(original, self, output, rows):
    """AROUND BreakableCudaGraphBackend._alloc_full_buffer and ._slice_output (and `_graph_copy`
    for ._copy_output_to_buffer): SGLang 0.5.17's breakable backend handles tensors, tuples and
    lists but not the LogitsProcessorOutput a causal LM's decode step returns (TypeError at
    capture), so with MosaicKV its tensor fields go through the original one by one and the other
    fields stay as they are. Other outputs, and servers without MosaicKV, are left to the
    original."""
    tensors = _graph_output_fields(output) if _mosaickv_graph(self) else None
    if tensors is None:
        return original(self, output, rows)
    import dataclasses

    return dataclasses.replace(output, **{k: original(self, t, rows) for k, t in tensors.items()})


def _graph_copy(original, self, output, output_buffer, num_tokens):
    tensors = _graph_output_fields(output) if _mosaickv_graph(self) else None
    buffers = _graph_output_fields(output_buffer) if tensors is not None else None
    if tensors is None or buffers is None:
        return original(self, output, output_buffer, num_tokens)
    if tensors.keys() != buffers.keys():
        raise ValueError(f"MosaicKV decode graph: the step output's tensor fields changed between "
                         f"capture sizes: {sorted(tensors)} vs {sorted(buffers)}")
    for name, t in tensors.items():
        original(self, t, buffers[name], num_tokens)
    return None


def _support_triton(original, backend: str) -> bool:
    """AROUND sglang's support_triton(backend): the CPU path of 'mosaickv' is pure torch."""
    if backend == "mosaickv":
        import torch

        return torch.cuda.is_available()
    return original(backend)


def _internal_state(result, self, recv_req):
    """AFTER Scheduler.get_internal_state: MosaicKV stats in /get_server_info."""
    from ..serving.pool import MosaicKVPool

    pool = self.token_to_kv_pool_allocator.get_kvcache()
    if isinstance(pool, MosaicKVPool):
        result.internal_state["mosaickv"] = pool.stats()
    return result


def _record_prompt_lens(result, self, *args, **kwargs):
    """AFTER ScheduleBatch.prepare_for_extend (its requests have their req_pool_idx, before
    their prefill forward): each request's prompt length recorded in a MosaicKV pool whose read
    rule splits prompt pages from the window (`pool.prompt_split`). A re-prefill after a
    retraction records the same length, so its generated tokens read as when decoded."""
    from ..serving.pool import MosaicKVPool

    allocator = self.token_to_kv_pool_allocator
    pool = allocator.get_kvcache() if allocator is not None else None
    if isinstance(pool, MosaicKVPool) and pool.prompt_split:
        for req in self.reqs:
            if req.req_pool_idx is not None:
                pool.set_prompt_len(req.req_pool_idx, len(req.origin_input_ids))
    return result


def _free_slots(allocator) -> int:
    """The allocator's free token slots (its own available_size, before the byte gate)."""
    return (len(allocator.free_pages) + len(allocator.release_pages)) * allocator.page_size


def _step_boundary(self, *args, **kwargs):
    """BEFORE Scheduler.get_next_batch_to_run (once per loop iteration, no forward in
    progress): the daemon's adoption point, then the byte gate's refresh; both agreed across TP
    ranks on the CPU group."""
    from ..serving.pool import MosaicKVPool

    allocator = self.token_to_kv_pool_allocator
    pool = allocator.get_kvcache()
    if not isinstance(pool, MosaicKVPool):
        return None
    group = self.tp_cpu_group if self.server_args.tp_size > 1 else None
    if pool.daemon is not None:
        pool.step_boundary(group)
    if pool.cold_waiting():  # (the warm set costs a device -> host copy: only when needed)
        pool.recompress_cold(_warm_pages(self, pool.page_size, pool.cfg.cold.after_tokens))
    pool.refresh_byte_gate(_free_slots(allocator), group)
    return None


def _warm_pages(scheduler, page_size: int, after_tokens: int) -> set[int]:
    """Logical pages some running (or just prefilled, or chunked) request has within its last
    `after_tokens` tokens: not cold. One gather from req_to_token and one copy to the host."""
    import torch

    reqs = list(scheduler.running_batch.reqs)
    if scheduler.last_batch is not None:
        reqs += scheduler.last_batch.reqs
    if scheduler.chunked_req is not None:
        reqs.append(scheduler.chunked_req)
    rows, cols = [], []
    for req in reqs:
        if req.req_pool_idx is None or not req.kv_committed_len:
            continue
        end = req.kv_committed_len
        start = max(0, end - after_tokens) // page_size * page_size
        cols += range(start, end, page_size)
        rows += [req.req_pool_idx] * len(range(start, end, page_size))
    if not rows:
        return set()
    table = scheduler.req_to_token_pool.req_to_token
    slots = table[torch.tensor(rows, device=table.device), torch.tensor(cols, device=table.device)]
    return set((slots // page_size).tolist())


def _worker_info(result, self):
    """AFTER TpModelWorker.get_worker_info: a MosaicKV server's longest request (and input) is
    what its empty arena holds at the largest layout, not the slot count (an upper bound): a
    longer prompt is refused by SGLang's own length check instead of waiting for bytes that
    never come."""
    from ..serving.pool import MosaicKVPool

    pool = getattr(self.model_runner, "token_to_kv_pool", None)
    if not isinstance(pool, MosaicKVPool):
        return result
    longest = pool.longest_request()
    if result[4] <= longest:
        return result
    logger.info("MosaicKV: longest request %d tokens (what the arena holds at the largest "
                "layout; %d slots)", longest, result[0])
    return (*result[:4], longest, longest - 5, *result[6:])


def _available_size(original, self):
    """AROUND PagedTokenToKVPoolAllocator.available_size: a MosaicKV pool's free slots less
    those its arena's free bytes cannot back (`pool.byte_deficit`, refreshed between steps).
    SGLang's admission, prefix eviction and decode retraction read this, so they wait, evict
    or retract when the bytes run out, as they do when slots run out."""
    free = original(self)
    deficit = getattr(self.get_kvcache(), "byte_deficit", 0)
    return max(0, free - deficit) if deficit else free


def _token_info(result, self):
    """AFTER SchedulerPoolStatsObserver._get_token_info: the idle leak check and the usage
    metrics count slots; the byte gate's deficit is not a leak (MosaicKV's stats, capacity)."""
    deficit = getattr(self.token_to_kv_pool_allocator.get_kvcache(), "byte_deficit", 0)
    if not deficit:
        return result
    import dataclasses

    available = result.full_available_size + deficit
    used = self.max_total_num_tokens - (available + result.full_evictable_size)
    return dataclasses.replace(result, full_available_size=available, full_num_used=used,
                               full_token_usage=used / self.max_total_num_tokens)


def _decode_graph_can_run(original, self, forward_batch):
    """AROUND DecodeCudaGraphRunner.can_run_graph: under decode_cuda_graph "full", a batch the
    recorded MosaicKV step cannot decode (a page the kernel cannot read) runs eagerly instead
    (the backend counts and logs it); every other backend is untouched."""
    ok = original(self, forward_batch)
    refusal = getattr(getattr(self, "attn_backend", None), "graph_refusal", None)
    if not ok or refusal is None:
        return ok
    return refusal(forward_batch) is None


def register_backends() -> None:
    """Attention backend + radix-cache backend names (idempotent: processes re-run plugins)."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from ..serving.radix import radix_cache_factory

    @register_attention_backend("mosaickv")  # SGLang's registry decorator (re-registers: same)
    def create_mosaickv_backend(runner):
        from ..serving.backend import MosaicAttnBackend

        return MosaicAttnBackend(runner)

    if get_radix_cache_factory("mosaickv") is None:
        register_radix_cache_backend("mosaickv", radix_cache_factory)


HOOKS = {
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size":
        (_compute_cell_size, HookType.AFTER),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool":
        (_build_token_to_kv_pool, HookType.AROUND),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure":
        (_cap_running_requests, HookType.AFTER),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids":
        (_release_page_ids, HookType.AROUND),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.clear":
        (_allocator_clear, HookType.AFTER),
    "sglang.srt.models.utils.enable_fused_set_kv_buffer": (_fused_set_kv_buffer, HookType.AROUND),
    "sglang.srt.utils.common.support_triton": (_support_triton, HookType.AROUND),
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state":
        (_internal_state, HookType.AFTER),
    "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run":
        (_step_boundary, HookType.BEFORE),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend":
        (_record_prompt_lens, HookType.AFTER),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.available_size":
        (_available_size, HookType.AROUND),
    "sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info": (_worker_info, HookType.AFTER),
    "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver."
    "_get_token_info": (_token_info, HookType.AFTER),
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner."
    "can_run_graph": (_decode_graph_can_run, HookType.AROUND),
    **{f"{_BCG}.{name}": (hook, HookType.AROUND) for name, hook in (
        ("_alloc_full_buffer", _graph_per_field), ("_slice_output", _graph_per_field),
        ("_copy_output_to_buffer", _graph_copy))},
}
