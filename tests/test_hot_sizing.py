"""The auto hot buffer holds what is in flight under either read rule (serving/sizing.py
`window_tokens`, `auto_hot_tokens`; pool.py `hot_buffer_requests`): the scheduler's capped
running requests, each holding its last page and the pages of its dense window, beside one
prefill chunk, never exhaust it.

On an H100 (2026-12-07, RULER on SmolLM2, default config) the chunk rule was sized with no
window: 65 running requests, many holding two hot pages (a page ending < hot_tokens before the
next token stays dense), exhausted a 16,384-token buffer and stopped the scheduler.
"""
from types import SimpleNamespace

import pytest
import torch

from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.pool import MosaicKVPool, hot_buffer_requests
from mosaickv_sglang.serving.sizing import auto_hot_tokens, window_tokens

PS, H, D, LAYERS = 128, 2, 64, 2
CHUNK, CONTEXT = 512, 4096


def _pool(cfg: MosaicConfig, window: int) -> tuple[MosaicKVPool, int]:
    hot = auto_hot_tokens(cfg, PS, CHUNK, CONTEXT, window)
    fit = hot_buffer_requests(hot, PS, CHUNK, CONTEXT, cfg.hot_buffer_fraction, window)
    return MosaicKVPool(64 * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=cfg, hot_tokens=hot), fit


def _in_use(pool) -> int:
    return pool.num_hot_pages - len(pool.free_hot_pages)


def _forward(pool, slots: torch.Tensor, seed: int) -> None:
    """One forward's writes, mapped before it as the backend's forward-metadata hook does."""
    pool.prepare_writes(slots)
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), slots,
                           torch.randn(len(slots), H, D, generator=g),
                           torch.randn(len(slots), H, D, generator=g))


def _serve_the_worst_case(pool: MosaicKVPool, fit: int) -> int:
    """fit - 1 requests prefilled to 10 tokens past a page boundary (the page before ends 10
    tokens before the next token: inside any window >= 11, so two hot pages each), then a
    full prefill chunk beside them, then decode steps of all of them. Returns the most hot
    pages in use."""
    pages = iter(range(1, pool.logical_size // PS + 1))
    rows, most = [], 0
    for r in range(fit - 1):
        n = 3 * PS + 10
        row = torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in
                         [next(pages) for _ in range(4)]])[:n]
        _forward(pool, row, seed=r)
        pool.seal_request(row, n)  # after the prefill forward (backend._maybe_seal)
        rows.append(row)
        most = max(most, _in_use(pool))
    chunk = torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in
                       [next(pages) for _ in range(CHUNK // PS)]])
    _forward(pool, chunk, seed=99)  # one full chunk of a new request beside them
    most = max(most, _in_use(pool))
    pool.seal_request(chunk, CHUNK)
    rows.append(chunk)
    for step in range(3):  # decode steps: seal what became sealable, then this step's writes
        new = []
        for i, row in enumerate(rows):
            n = len(row)
            if n % PS == 0:  # the next token opens a new page
                row = torch.cat([row, torch.tensor([next(pages) * PS])])
            else:
                row = torch.cat([row, row[-1:] + 1])
            with pool.batched_seals():
                pool.seal_request_pages((row[::PS] // PS).numpy(), len(row) - 1, decode_step=True)
            rows[i] = row
            new.append(row[-1:])
        _forward(pool, torch.cat(new), seed=100 + step)
        most = max(most, _in_use(pool))
    return most


@pytest.mark.parametrize("rule", ["chunk", "position"])
def test_the_auto_hot_buffer_holds_the_capped_requests_and_a_chunk(rule):
    cfg = MosaicConfig(read_rule=rule, basis_fit="first_page" if rule == "position" else "group",
                       hot_tokens=64, hot_buffer_requests=6, select={"enabled": False})
    assert window_tokens(cfg) == 64
    pool, fit = _pool(cfg, window_tokens(cfg))
    assert fit == 7  # 6 others beside the prefilling request, two pages each
    most = _serve_the_worst_case(pool, fit)
    assert most <= pool.num_hot_pages
    assert most > pool.num_hot_pages - 2  # the worst case really fills it


def test_sizing_the_chunk_rule_without_its_window_exhausts_the_buffer():
    """What start-up did for the chunk rule before (window 0): more requests admitted than
    the buffer carries, and the chunk beside them finds it full."""
    cfg = MosaicConfig(read_rule="chunk", hot_tokens=64, hot_buffer_requests=6,
                       select={"enabled": False})
    pool, fit = _pool(cfg, 0)
    with pytest.raises(RuntimeError, match="hot buffer exhausted"):
        _serve_the_worst_case(pool, fit)


def test_the_window_start_up_sees_is_the_pools():
    """`window_tokens` is the window the pool reads by (`dense_window`): hot_tokens under either
    rule, plus the daemon's lag under the position rule only. The default (the position rule,
    hot_tokens 0 since 2026-12-07) has no window; the `chunk_rule` preset's is 64."""
    position = {"read_rule": "position", "basis_fit": "first_page"}
    chunk = {"read_rule": "chunk", "basis_fit": "group"}
    lag = MosaicConfig().daemon_lag_tokens
    for cfg, want in ((MosaicConfig(), 0),
                      (MosaicConfig.from_dict({"preset": "chunk_rule"}), 64),
                      (MosaicConfig(**position, hot_tokens=0), 0),
                      (MosaicConfig(**position, hot_tokens=64, daemon="process"), 64 + lag),
                      (MosaicConfig(**chunk, hot_tokens=32, daemon="process"), 32)):
        assert window_tokens(cfg) == want
        if cfg.daemon == "off":  # (a pool with the daemon would start its workers)
            pool = MosaicKVPool(8 * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                                mosaic_config=cfg)
            assert pool.dense_window == want
