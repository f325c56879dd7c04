"""The position rule with a dense window W (docs/determinism.md): the window slides with the
generated tokens and is anchored at the prompt's end for the prompt, so

* `compressed_pages(t, prompt=L)` = min(t // page, max(L - W, 0) // page) for a prompt token
  (t < L), max(t - W, 0) // page for a generated one (t >= L), and `chunk_reads` gives the same
  for every token of a chunk; the first answer token reads the prompt's last W tokens dense
  wherever the prompt ends in a page;
* a prompt's pages before its last W tokens are sealed inline (inside the prefill forward, or
  right after it) and never go to the daemon; the pages of its window and of generated tokens
  do, read dense until the window passes them;
* a request reusing a prefix another request cached reads it as it does alone (the radix tree
  holds a request's last W prompt tokens back from its match: `test_match_stops_before_the_window`);
* the prompt lengths come from SGLang's prepare_for_extend (`wiring._record_prompt_lens`); a
  request without one reads by the sliding window alone, counted.
"""
from types import SimpleNamespace

import pytest
import torch

from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.integration import wiring
from mosaickv_sglang.serving.pool import MosaicKVPool

PS, H, D, LAYERS = 128, 2, 64, 2


def make_pool(pages=40, **cfg) -> MosaicKVPool:
    config = {"hot_buffer_fraction": 0.5, "read_rule": "position", "basis_fit": "first_page",
              "hot_tokens": PS, **cfg}
    return MosaicKVPool(pages * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=MosaicConfig(**config))


@pytest.fixture
def pools():
    made = []

    def factory(**cfg):
        made.append(make_pool(**cfg))
        return made[-1]

    yield factory
    for p in made:
        if p.daemon is not None:
            p.daemon.close()


def _by_definition(t: int, prompt: int | None, window: int) -> int:
    """Pages read compressed by a token at t, page by page: by a prompt token (t < `prompt`)
    every page ending at or before t and at least `window` before the prompt's end, by any
    other token every page ending <= t - window; the set must be a prefix."""
    if prompt is not None and t < prompt:
        read = [(p + 1) * PS <= t and (p + 1) * PS <= prompt - window
                for p in range(t // PS + 1)]
    else:
        read = [(p + 1) * PS <= t - window for p in range(t // PS + 1)]
    n = sum(read)
    assert all(read[:n]) and not any(read[n:]), (t, prompt)
    return n


def test_compressed_pages_by_hand(pools):
    pool = pools()  # hot_tokens 128, daemon off: W = 128
    assert pool.dense_window == PS and pool.prompt_split
    cases = {  # (t, L) -> pages; L None: unknown, the sliding window for every token
        (999, 1000): 6,  # the last prompt token: pages ending <= 872 (1000 - 128)
        (1000, 1000): 6,  # the first generated token: the same
        (1000, None): 6,
        (1023, 1000): 6, (1024, 1000): 7,  # page 6 [768, 896) ends 128 before t = 1024
        (1100, 1000): 7,
        (1152, 1000): 8,  # page 7 ends 128 before
        (1280, 1000): 9,
        (500, 1000): 3,  # a prompt token before the window: every full page before it
        (500, None): 2,
        (127, 1000): 0, (128, 1000): 1, (128, None): 0,
        (900, 1000): 6, (800, 1000): 6, (767, 1000): 5,  # inside the window: anchored
        (8192, 8193): 63, (8193, 8193): 63,  # a prompt one token past a boundary: page 63 dense
        (1023, 1024): 7, (1024, 1024): 7, (1151, 1024): 7, (1152, 1024): 8,  # page aligned
        (2000, 0): 14,  # no prompt pages: the window alone
    }
    for (t, prompt), want in cases.items():
        assert pool.compressed_pages(t, prompt) == want, (t, prompt)
    for prompt in (None, 0, 1, 127, 128, 129, 640, 1000, 1024, 1500):
        prev = 0
        for t in range(0, 2200, 7):
            n = pool.compressed_pages(t, prompt)
            assert n == _by_definition(t, prompt, PS), (t, prompt)
            assert n >= prev, (t, prompt)  # never fewer for a later token: a sealed prefix
            prev = n
    w0 = pools(hot_tokens=0)  # no window: every full page before the token
    assert all(w0.compressed_pages(t, 1000) == t // PS for t in range(0, 2000, 13))


@pytest.mark.parametrize("hot", [0, 64, PS, 300])
@pytest.mark.parametrize("prompt", [None, 0, 100, 640, 1000, 1700])
def test_chunk_reads_match_compressed_pages(pools, hot, prompt):
    pool = pools(hot_tokens=hot)
    for first, end in ((0, 512), (512, 1024), (640, 1301), (1280, 2000)):
        ja = pool.compressed_pages(first, prompt)
        want = [pool.compressed_pages(t, prompt) for t in range(first, end)]
        assert pool.chunk_reads(first, end, ja, prompt).tolist() == want, (first, prompt)


def _write(pool, slots, k, v, layer_id):
    pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots, k, v)


def _chunk(pool, slots, kv, first, end, prompt):
    """One prefill chunk [first, end) of a request (slots[:end] its slots) as the backend runs
    it: write, seal layer by layer what its tokens read compressed, read, install, seal after
    the forward. Returns per layer and token t the keys and values t reads (compressed prefix
    as it reads back, then its dense tokens)."""
    pages = (slots[:end:PS] // PS).tolist()
    cs, seen = None, {}
    for layer_id in range(LAYERS):
        k, v = kv[layer_id]
        _write(pool, slots[first:end], k[first:end], v[first:end], layer_id)
        if layer_id == 0:
            cs = pool.plan_chunk_seal([(pages, end - 1, prompt)])
        fresh = {} if cs is None else pool.seal_chunk_layer(cs, layer_id)
        kc, vc, kd, vd, _, ja = pool.chunk_kv(layer_id, slots[:end], first, fresh, prompt)
        read = pool.chunk_reads(first, end, ja, prompt).tolist()
        for i, t in enumerate(range(first, end)):
            j = read[i]
            dense = slice((j - ja) * PS, t + 1 - ja * PS)
            seen[(layer_id, t)] = (j, torch.cat([kc[:j * PS], kd[dense]]),
                                   torch.cat([vc[:j * PS], vd[dense]]))
    if cs is not None:
        pool.finish_chunk_seal(cs)
    pool.seal_request(slots[:end], end, prompt)
    return seen


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, H, D, generator=g) * (1 + torch.arange(D) % 7),
             torch.randn(n, H, D, generator=g)) for _ in range(LAYERS)]


@pytest.mark.parametrize("known", [True, False])
def test_prompt_pages_before_the_window_are_sealed_inline_the_rest_go_to_the_daemon(pools, known):
    """daemon process, W = daemon_lag_tokens = 128: a 680-token prompt's 4 full pages before
    its last 128 tokens are sealed inside its prefill forward (read compressed by a later
    prompt token); page 4 [512, 640), inside the prompt's window, is read dense by the prompt's
    last tokens and the first generated ones: submitted to the workers after the prefill, read
    dense until a token 128 past its end. The page straddling the prompt's end (page 5,
    [640, 768)): submitted once full, read dense until a token 128 past its end. With the
    prompt length unknown the window slides for every token: the same pages here."""
    a = pools(daemon="process", hot_tokens=0, daemon_workers=1, hot_buffer_fraction=1.0,
              basis_block_tokens=4 * PS)
    assert a.dense_window == PS and a.prompt_split
    L, n = 680, 6 * PS + PS + 1
    prompt = L if known else None
    kv = _kv(n, seed=1)
    slots = torch.arange(PS, PS + n)  # logical pages 1..
    pages = (slots[::PS] // PS).tolist()
    _chunk(a, slots, kv, 0, L, prompt)
    assert a.counters.chunk_sealed_pages == 4 and a.sealed_prefix(pages) == 4
    assert a.daemon.counters.submitted_pages == 1 and a.pending.keys() == {pages[4]}
    # decode: the generated tokens fill page 5
    for layer_id in range(LAYERS):
        _write(a, slots[L:], kv[layer_id][0][L:], kv[layer_id][1][L:], layer_id)
    for t in range(L + 1, n + 1):
        a.seal_request(slots[:t], t, prompt)
        want = max(t - PS, 0) // PS  # generated tokens: the sliding window
        assert a.read_split(pages[:-(-t // PS)], t, prompt) == want, t
        if t == 6 * PS:  # page 5 full: to the daemon
            assert pages[5] in a.pending and a.daemon.counters.submitted_pages == 2
        if t < 5 * PS + PS:
            assert pages[4] not in a.sealed or pages[4] in a.kept_hot, t  # read dense
    # page 6 [768, 896) full at the end: submitted too; pages 4, 5 needed there: sealed here
    assert a.daemon.counters.submitted_pages == 3
    assert pages[4] in a.sealed and pages[5] in a.sealed and pages[6] in a.pending
    assert a.counters.early_sealed_reads == 0


def test_a_cached_prefix_is_read_as_alone(pools, seed):
    """Request B reuses the 4 prompt pages request A cached (its prompt starts with them) and
    is prefilled after them; every token of B reads the same K/V, bit for bit, as B's prompt
    prefilled alone in a fresh pool: the prefix's pages are B's prompt pages, read compressed
    as the cache holds them. W = 128 > 0 here; no read finds a page sealed early."""
    shared, la, lb = 4 * PS, 4 * PS + 60, 4 * PS + 300
    kv_a, kv_b = _kv(la, seed), _kv(lb, seed + 1)
    for layer_id in range(LAYERS):  # B's prompt starts with A's 512 tokens
        for x in range(2):
            kv_b[layer_id][x][:shared] = kv_a[layer_id][x][:shared]
    loaded = pools()
    slots_a = torch.arange(PS, PS + la)  # pages 1..5
    _chunk(loaded, slots_a, kv_a, 0, la, la)
    loaded.seal_finished(slots_a)
    slots_b = torch.cat([slots_a[:shared], torch.arange(10 * PS, 10 * PS + lb - shared)])
    got = _chunk(loaded, slots_b, kv_b, shared, lb, lb)
    alone = pools()
    want = _chunk(alone, torch.arange(PS, PS + lb), kv_b, 0, lb, lb)
    for key, (j, k, v) in got.items():
        wj, wk, wv = want[key]
        assert j == wj and torch.equal(k, wk) and torch.equal(v, wv), (key, seed)
    assert loaded.counters.early_sealed_reads == alone.counters.early_sealed_reads == 0


def test_prompt_lens_are_looked_up_only_where_they_matter(pools, caplog):
    pool = pools()
    pool.set_prompt_len(3, 700)
    with caplog.at_level("WARNING"):
        assert pool.prompt_lens_of([3, 5, 3, 7]) == [700, None, 700, None]
        assert pool.prompt_lens_of([5]) == [None]
    assert pool.counters.prompt_len_unknown == 3
    assert sum("prompt length" in r.message for r in caplog.records) == 1  # logged once
    pool.set_prompt_len(3, 20)  # the index reused by another request
    assert pool.prompt_lens_of([3]) == [20]
    pool.clear()
    assert not pool.prompt_lens
    for cfg in ({"hot_tokens": 0}, {"read_rule": "chunk", "basis_fit": "group"}):
        other = pools(**cfg)
        assert not other.prompt_split
        other.set_prompt_len(3, 700)
        assert other.prompt_lens_of([3, 5]) == [None, None]
        assert other.counters.prompt_len_unknown == 0


def test_prepare_for_extend_hook_records_prompt_lens(pools):
    pool = pools()
    reqs = [SimpleNamespace(req_pool_idx=4, origin_input_ids=[1] * 900),
            SimpleNamespace(req_pool_idx=None, origin_input_ids=[1] * 5),
            SimpleNamespace(req_pool_idx=9, origin_input_ids=[2] * 130)]
    batch = SimpleNamespace(reqs=reqs, token_to_kv_pool_allocator=SimpleNamespace(
        get_kvcache=lambda: pool))
    assert wiring._record_prompt_lens("result", batch) == "result"
    assert pool.prompt_lens == {4: 900, 9: 130}
    plain = SimpleNamespace(reqs=reqs, token_to_kv_pool_allocator=SimpleNamespace(
        get_kvcache=lambda: object()))
    assert wiring._record_prompt_lens(None, plain) is None  # another pool: nothing to do
