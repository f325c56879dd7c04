"""Helpers of the pool-level sealing tests (test_decode_seal_slices, test_batched_seals,
test_write_transform_cache, test_seal_batch): random K/V written through the pool, two pools
compared page by page, and a counter of matrix inversions."""
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import repro


class Inversions(TorchDispatchMode):
    """Counts the matrix inversions run inside it (every linalg_inv* op): `calls`, and
    `matrices` inverted (a batched call counts each matrix)."""

    def __init__(self):
        super().__init__()
        self.calls = self.matrices = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__.startswith("linalg_inv"):
            self.calls += 1
            self.matrices += args[0].numel() // (args[0].shape[-1] * args[0].shape[-2])
        return func(*args, **(kwargs or {}))


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
