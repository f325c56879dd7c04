"""Helpers of the pool-level sealing tests (test_decode_seal_slices, test_batched_seals): random
K/V written through the pool, and two pools compared page by page."""
from types import SimpleNamespace

import torch

from conftest import repro


def write_random(pool, slots, gen) -> None:
    """Random K (uneven channel scales) and V at `slots`, every layer of `pool`."""
    h, d = pool.head_num, pool.head_dim
    for layer_id in range(pool.layer_num):
        k = torch.randn(len(slots), h, d, generator=gen) * (1 + torch.arange(d) % 7)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots, k,
                           torch.randn(len(slots), h, d, generator=gen))


def assert_same_pages(a, b, slots_of, seed, where=None, ordered: bool = False) -> None:
    """Pools `a` and `b` hold the same sealed pages (`ordered`: entered in the same order) with
    the same bytes: bases, strategies and sizes per page, and every request's K/V (`slots_of`)
    as it reads back, exactly."""
    if ordered:
        assert list(a.sealed) == list(b.sealed), (where, repro(seed))
    else:
        assert sorted(a.sealed) == sorted(b.sealed), (where, repro(seed))
    for page, sa in a.sealed.items():
        sb = b.sealed[page]
        assert sa.position == sb.position and sa.nbytes == sb.nbytes, (page, repro(seed))
        assert sa.kinds() == sb.kinds(), (page, repro(seed))
        assert torch.equal(sa.bases.stacked(), sb.bases.stacked()), (page, repro(seed))
    for slots in slots_of:
        for layer_id in range(a.layer_num):
            for x, y in zip(a.dense_kv(layer_id, slots), b.dense_kv(layer_id, slots)):
                assert torch.equal(x, y), (where, layer_id, repro(seed))
