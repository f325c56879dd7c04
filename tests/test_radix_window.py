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
