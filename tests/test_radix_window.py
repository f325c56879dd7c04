"""The radix tree holds a request's last W prompt tokens back from its match (position rule
with a dense window W, `MosaicRadixCache.window_cap`): the pages some token of the request reads
dense (the prompt's window, `pool.compressed_pages`) are always ones it computes itself, so a
cached copy (sealed, no dense form kept) never stands in for them. Without a window, or under
the chunk rule, matches are SGLang's own. Real SGLang RadixCache over a MosaicKV pool."""
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.pool import MosaicKVPool
from mosaickv_sglang.serving.radix import MosaicRadixCache

PS = 128


def _tree(**cfg):
    config = MosaicConfig(**{"hot_buffer_fraction": 0.5, "read_rule": "position",
                             "basis_fit": "first_page", **cfg})
    pool = MosaicKVPool(40 * PS, PS, torch.float32, 2, 64, 1, "cpu", False,
                        mosaic_config=config)
    allocator = SimpleNamespace(get_kvcache=lambda: pool, device="cpu")
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=allocator, page_size=PS)
    return MosaicRadixCache(params), pool


def _insert(tree, tokens: list[int]) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    tree.insert(InsertParams(key=RadixKey(tokens), value=torch.arange(PS, PS + len(tokens))))


@pytest.mark.parametrize("cfg,cap", [({"hot_tokens": 128}, 128), ({"hot_tokens": 200}, 200),
                                     ({"hot_tokens": 0}, None),
                                     ({"read_rule": "chunk", "basis_fit": "group",
                                       "hot_tokens": 128}, None)])
def test_match_stops_before_the_window(cfg, cap):
    tree, pool = _tree(**cfg)
    cached = list(range(1000, 1000 + 6 * PS))  # 6 pages in the tree
    _insert(tree, cached)
    for prompt_len in (6 * PS, 6 * PS + 1, 5 * PS + 70, 4 * PS + 127, 7 * PS):
        prompt = (cached + list(range(9, 9 + PS)))[:prompt_len]
        req = SimpleNamespace(origin_input_ids=prompt)
        got = tree.match_prefix(MatchPrefixParams(key=RadixKey(prompt), req=req))
        plain = tree.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))  # no request: no cap
        n, full = len(got.device_indices), len(plain.device_indices)
        assert full == min(prompt_len, 6 * PS) // PS * PS, prompt_len
        if cap is None:
            assert n == full, (cfg, prompt_len)
        else:  # the pages holding the prompt's last `cap` tokens are computed, not matched
            assert n == min(full, max(prompt_len - cap, 0) // PS * PS), (cfg, prompt_len)
            assert n // PS <= pool.compressed_pages(prompt_len, prompt_len), prompt_len
            assert tree.window_cap(req) == prompt_len - cap


class _Slots:
    """SGLang's ReqToTokenPool as the radix cache uses it (`req_to_token`, `write`)."""

    def __init__(self, rows: int, width: int):
        self.req_to_token = torch.zeros(rows, width, dtype=torch.int32)

    def write(self, indices, values):
        self.req_to_token[indices] = values


def _tree_with_slots(hot_tokens: int):
    config = MosaicConfig(hot_buffer_fraction=0.5, read_rule="position", basis_fit="first_page",
                          hot_tokens=hot_tokens)
    pool = MosaicKVPool(40 * PS, PS, torch.float32, 2, 64, 1, "cpu", False,
                        mosaic_config=config)
    freed = []
    allocator = SimpleNamespace(get_kvcache=lambda: pool, device="cpu",
                                free_segment=lambda idx, start_pos=0: freed.append(idx.clone()))
    slots = _Slots(4, 16 * PS)
    tree = MosaicRadixCache(CacheInitParams(disable=False, req_to_token_pool=slots,
                                            token_to_kv_pool_allocator=allocator, page_size=PS))
    return tree, slots, freed


@pytest.mark.parametrize("hot_tokens", [0, 128])
def test_a_running_request_inserts_only_up_to_its_window(hot_tokens):
    """After a prefill, SGLang inserts a running request's computed pages and rewrites the
    request's slots to any identical pages the tree held (keeping the older copy). With a
    window, the pages of the request's prompt window must stay its own (their dense form is
    read; a cached twin may be sealed): they are not inserted, `prefix_indices` still covers
    every computed token, and the slots past the cap are left as they were."""
    tree, slots, freed = _tree_with_slots(hot_tokens)
    prompt = list(range(100, 100 + 5 * PS + 40))  # 680 tokens
    _insert(tree, prompt[:5 * PS])  # an identical earlier copy of its first 5 pages
    req = SimpleNamespace(req_pool_idx=1, origin_input_ids=prompt, extra_key=None,
                          cache_protected_len=0, last_node=tree.root_node,
                          prefix_indices=torch.empty(0, dtype=torch.int64),
                          get_fill_ids=lambda: prompt)
    own = torch.arange(20 * PS, 20 * PS + len(prompt), dtype=torch.int32)  # its own slots
    slots.req_to_token[1, :len(prompt)] = own
    tree.cache_unfinished_req(req)
    assert len(req.prefix_indices) == len(prompt)  # every computed token
    swapped = (slots.req_to_token[1, :len(prompt)] != own).nonzero().flatten()
    shared = 5 * PS if not hot_tokens else (len(prompt) - hot_tokens) // PS * PS
    # the pages before the cap are the tree's (older) copies; the window's stay its own
    assert swapped.tolist() == list(range(shared)), hot_tokens
    assert torch.equal(req.prefix_indices[shared:].to(torch.int32), own[shared:])
    assert sum(len(f) for f in freed) == shared  # its duplicates before the cap freed
    assert req.cache_protected_len == shared
    assert req.get_fill_ids() == prompt  # its own view restored
