"""Radix-cache backend ``mosaickv``: SGLang's radix tree over MosaicKV's logical pages.

A node's value is a run of logical slot ids, page aligned (``page_size == segment_tokens``), and
each logical page has exactly one physical form in the pool: hot (dense rows) or sealed (one
immutable compressed segment per layer, with its strategy and bases). So a prefix matched by N
requests is read from the same sealed pages: compressed once, stored once. Splits happen at page
boundaries (asserted), so both halves keep exactly their pages' policies; eviction returns pages
to the allocator, which tells the pool to drop their packed bytes; locked nodes are never evicted
(SGLang's own lock_ref logic is unchanged).
"""
from __future__ import annotations

import dataclasses

import torch

from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from .pool import MosaicKVPool


class MosaicRadixCache(RadixCache):
    def __init__(self, params):
        super().__init__(params)
        pool = params.token_to_kv_pool_allocator.get_kvcache()
        if not isinstance(pool, MosaicKVPool):
            raise RuntimeError("radix-cache backend 'mosaickv' needs the MosaicKV pool")
        self.pool = pool

    def match_prefix(self, params):
        """SGLang's match, plus a count of the sealed pages a request gets from the tree. Under
        the position read rule with a dense window W (`pool.dense_window`: hot_tokens, + the
        daemon's lag) the prompt's last tokens and the generated ones read dense the pages
        ending less than W before the prompt's end (`pool.compressed_pages`), and a cached page
        keeps no dense copy: a request's match (the scheduler's, with the request) stops W
        tokens before its prompt's end, so it prefills those pages itself, as it would alone
        (`window_cap`)."""
        req = getattr(params, "req", None)
        cap = self.window_cap(req)
        if cap is not None:
            key = params.key
            limit = cap if key.limit is None else min(key.limit, cap)
            params = dataclasses.replace(params, key=RadixKey(
                key.token_ids, key.extra_key, is_bigram=key.is_bigram, limit=limit))
        result = super().match_prefix(params)
        first_match = req is not None and not getattr(req, "_mosaickv_matched", False)
        if req is not None:
            req._mosaickv_matched = True  # chunked prefill re-matches its own pages: count once
        if first_match:
            self.pool.count_reuse(result.device_indices[:: self.page_size].tolist())
        return result

    def window_cap(self, req) -> int | None:
        """The most tokens `req`'s match may take from the tree: its prompt length less the
        window (a retracted request's re-prefill too: its generated tokens read the same
        window), or None (no cap: the chunk rule, no window, or no request)."""
        if req is None or not self.pool.prompt_split:
            return None
        return max(0, len(req.origin_input_ids) - self.pool.dense_window)

    def cache_unfinished_req(self, req, chunked=False):
        """SGLang's insert of a running request's computed tokens (after a prefill chunk), but
        only up to its window cap (`window_cap`): inserting the window's pages would let
        SGLang swap the request's own copies for identical cached ones (its insert keeps the
        older copy and rewrites the request's slots to it), whose dense form may be gone, and
        another request could match them. The tokens past the cap stay the request's own, as
        SGLang keeps an unaligned tail (`req.prefix_indices` covers every computed token;
        `cache_protected_len` the inserted ones), and enter the tree at its finish."""
        cap = None if self.disable else self.window_cap(req)
        if cap is None:  # (no window: SGLang's insert, without another copy of the fill ids)
            return super().cache_unfinished_req(req, chunked=chunked)
        fill = req.get_fill_ids()
        if len(fill) <= cap:
            return super().cache_unfinished_req(req, chunked=chunked)
        own_attr = vars(req).get("get_fill_ids")  # (SGLang's Req: none, the method)
        req.get_fill_ids = lambda: fill[:cap]  # the insert's view (an instance attribute)
        try:
            super().cache_unfinished_req(req, chunked=chunked)
        finally:
            if own_attr is None:
                del req.get_fill_ids
            else:
                req.get_fill_ids = own_attr
        done = len(req.prefix_indices)
        if done < len(fill):  # the window's tokens: the request's own slots, not in the tree
            own = self.req_to_token_pool.req_to_token[req.req_pool_idx, done:len(fill)]
            req.prefix_indices = torch.cat([req.prefix_indices, own.to(req.prefix_indices)])

    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
        """SGLang's insert of a finished request, after its full pages are sealed: it reads
        nothing more, so pages it kept dense for its read rule's window (hot_tokens, the daemon's
        slack) are sealed now and give their hot page back instead of holding it in the tree."""
        if not self.disable:
            slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv_len_to_handle]
            self.pool.seal_finished(slots)
        return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)

    def _split_node(self, key, child, split_len: int):
        if split_len % self.page_size:
            raise RuntimeError(f"MosaicKV: radix split at {split_len}, not a page boundary "
                               f"(page_size {self.page_size})")
        return super()._split_node(key, child, split_len)

    def node_policy(self, node) -> list[dict]:
        """Per page of a node: where it lives and, if sealed, each layer's K/V strategy."""
        out = []
        for slot in node.value[:: self.page_size].tolist():
            page = slot // self.page_size
            sealed = self.pool.sealed.get(page)
            if sealed is None:
                out.append({"page": page, "state": "hot"})
            else:
                out.append({"page": page, "state": "sealed", "position": sealed.position,
                            "bytes": sealed.nbytes,
                            "k": [s.k.strategy.spec for s in sealed.segments],
                            "v": [s.v.strategy.spec for s in sealed.segments]})
        return out


def radix_cache_factory(ctx) -> MosaicRadixCache:
    if ctx.disable_radix_cache:
        raise RuntimeError("--kv-backend mosaickv needs the radix cache (drop --disable-radix-cache)")
    return MosaicRadixCache(ctx.params)
