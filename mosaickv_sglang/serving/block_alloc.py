"""Blocks of one layer's packed arena (`SegmentStore`): which bytes a sealed page's block takes.

Sealed pages take blocks of the size their layout needs (a few sizes, one per layout). A block
comes from a free block of exactly its size, else from the bump pointer, else from the smallest
larger free extent (split); a freed block merges with free neighbours and gives the top back, so
bytes one layout freed can hold another (exact-size free lists alone stranded them: a sink page
found no room beside three free smaller blocks, tests/test_sizing.py).

`fits`: how many blocks of `unit` bytes (the largest layout a page can take) the free bytes
certainly hold, counting each free extent and the room above the top by itself, kept as blocks
come and go. Placing any block of at most `unit` bytes lowers it by at most one, which is what
lets the pool's byte gate promise every admitted page a block (serving/sizing.py).
"""
from __future__ import annotations

from itertools import accumulate


class BlockAllocator:
    def __init__(self, capacity: int, unit: int):
        self.capacity, self.unit = capacity, max(unit, 1)
        self.clear()

    def clear(self) -> None:
        self.top = 0
        self._by_size: dict[int, set[int]] = {}  # size -> starts of free extents
        self._start: dict[int, int] = {}  # start -> size
        self._end: dict[int, int] = {}  # end -> start
        self._fits = 0  # sum over free extents of size // unit

    def fits(self) -> int:
        """Blocks of `unit` bytes the free bytes hold for sure (see module doc)."""
        return self._fits + (self.capacity - self.top) // self.unit

    def free_bytes(self) -> int:
        return self.capacity - self.top + sum(self._start.values())

    def alloc(self, size: int) -> int | None:
        starts = self._by_size.get(size)
        if starts:
            start = next(iter(starts))
            self._remove(start, size)
            return start
        if self.top + size <= self.capacity:
            self.top += size
            return self.top - size
        larger = [s for s, starts in self._by_size.items() if s > size and starts]
        if not larger:
            return None
        extent = min(larger)
        start = next(iter(self._by_size[extent]))
        self._remove(start, extent)
        self._insert(start + size, extent - size)  # its neighbours are not free: no merge
        return start

    def alloc_many(self, sizes: list[int]) -> list[int | None]:
        """`alloc` of each of `sizes` in order (None where one finds no room). With no free
        extent and room for all of them above the top, that is consecutive blocks from the top:
        one running sum instead of a call per block (what `alloc` would give, in order)."""
        total = sum(sizes)
        if not self._start and self.top + total <= self.capacity:
            bases = list(accumulate(sizes[:-1], initial=self.top)) if sizes else []
            self.top += total
            return bases
        return [self.alloc(size) for size in sizes]

    def free(self, base: int, size: int) -> None:
        prev = self._end.get(base)
        if prev is not None:  # merge with the free extent just below
            psize = self._start[prev]
            self._remove(prev, psize)
            base, size = prev, size + psize
        nsize = self._start.get(base + size)
        if nsize is not None:  # and the one just above
            self._remove(base + size, nsize)
            size += nsize
        if base + size == self.top:
            self.top = base
        else:
            self._insert(base, size)

    def _insert(self, start: int, size: int) -> None:
        self._by_size.setdefault(size, set()).add(start)
        self._start[start] = size
        self._end[start + size] = start
        self._fits += size // self.unit

    def _remove(self, start: int, size: int) -> None:
        starts = self._by_size[size]
        starts.discard(start)
        if not starts:
            del self._by_size[size]
        del self._start[start], self._end[start + size]
        self._fits -= size // self.unit
