"""Shared memory between one scheduler rank and its recompression workers.

One POSIX shared-memory block, created by the scheduler side and mapped by every worker, so page
data never goes through a pipe (a pipe read could make the scheduler wait on a busy worker):

    heartbeats: float64 per worker (time.monotonic() of its last sign of life)
    per slot:   page K/V [layers, 2, heads, tokens, head_dim] in the cache dtype (scheduler -> worker)
                bases    [layers, 2, heads, head_dim, head_dim] bf16 (scheduler -> worker, reuse jobs)
                result   bytes: the sealed page, tensors laid out raw + a pickled skeleton

Results are written with a pickler whose tensors go into the slot's result region (no copy through
the pipe; only offsets travel); `load` rebuilds them as views of the slot (the scheduler's install
then reads them in place) or copies them onto a device. On CUDA the block is registered as
pinned, mapped host memory: copies from it are asynchronous, and a kernel can read it by address
over PCIe (what the pool's zero-copy install does, once `SegmentStore.reads_host` checked it).
"""
from __future__ import annotations

import io
import json
import logging
import mmap
import os
import pickle
import shutil
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory

import torch

logger = logging.getLogger(__name__)
ALIGN = 4096
TENSOR_ALIGN = 64


def _up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


class ResultTooLarge(RuntimeError):
    """A sealed page did not fit its slot's result region (the size bound was wrong)."""


@dataclass
class ChannelSpec:
    layers: int
    heads: int
    head_dim: int
    tokens: int  # per page
    dtype: str  # the hot buffer's dtype, e.g. "bfloat16"
    slots: int
    workers: int
    result_bytes: int  # per slot
    name: str = ""

    def kv_shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.heads, self.tokens, self.head_dim)

    def bases_shape(self) -> tuple[int, ...]:
        """[2 (K, V), layers, H, D, D]: every layer's K bases then V bases, so a BasisPair goes
        in with one stack (one concatenation of its 2L tensors) and one copy."""
        return (2, self.layers, self.heads, self.head_dim, self.head_dim)

    def kv_bytes(self) -> int:
        return _numel(self.kv_shape()) * _dtype(self.dtype).itemsize

    def bases_bytes(self) -> int:
        return _numel(self.bases_shape()) * 2

    def slot_bytes(self) -> int:
        return _up(self.kv_bytes(), ALIGN) + _up(self.bases_bytes(), ALIGN) + \
            _up(self.result_bytes, ALIGN)

    def total_bytes(self) -> int:
        return _up(8 * self.workers, ALIGN) + self.slots * self.slot_bytes()

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


class Channel:
    """Typed views into the shared block (see module doc)."""

    def __init__(self, spec: ChannelSpec, buf, owner: shared_memory.SharedMemory | None = None):
        self.spec = spec
        self._owner = owner
        self._buf = buf
        self.raw = torch.frombuffer(buf, dtype=torch.uint8, count=spec.total_bytes())
        self.heartbeats = self.raw[: 8 * spec.workers].view(torch.float64)
        self._base = _up(8 * spec.workers, ALIGN)
        self.pinned = False

    @classmethod
    def create(cls, spec: ChannelSpec) -> "Channel":
        free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
        if free is not None and free < spec.total_bytes():
            raise RuntimeError(
                f"MosaicKV daemon: {spec.slots} slots need {spec.total_bytes() / 1e9:.2f} GB of "
                f"shared memory, /dev/shm has {free / 1e9:.2f} GB free: lower "
                f"daemon_queue_segments or enlarge /dev/shm (docker --shm-size)")
        shm = shared_memory.SharedMemory(create=True, size=spec.total_bytes())
        spec.name = shm.name
        return cls(spec, shm.buf, shm)

    @classmethod
    def attach(cls, spec: ChannelSpec) -> "Channel":
        """Worker side: map the block by name (no resource tracker: the creator owns it)."""
        with open(f"/dev/shm/{spec.name.lstrip('/')}", "r+b") as fh:
            buf = mmap.mmap(fh.fileno(), spec.total_bytes())
        return cls(spec, buf)

    def _region(self, slot: int, which: int) -> tuple[int, int]:
        if not 0 <= slot < self.spec.slots:
            raise IndexError(f"slot {slot} out of range ({self.spec.slots} slots)")
        kv, bases = _up(self.spec.kv_bytes(), ALIGN), _up(self.spec.bases_bytes(), ALIGN)
        start = self._base + slot * self.spec.slot_bytes()
        return [(start, self.spec.kv_bytes()), (start + kv, self.spec.bases_bytes()),
                (start + kv + bases, self.spec.result_bytes)][which]

    def kv(self, slot: int) -> torch.Tensor:
        off, n = self._region(slot, 0)
        return self.raw[off:off + n].view(_dtype(self.spec.dtype)).view(self.spec.kv_shape())

    def bases(self, slot: int) -> torch.Tensor:
        off, n = self._region(slot, 1)
        return self.raw[off:off + n].view(torch.bfloat16).view(self.spec.bases_shape())

    def result(self, slot: int) -> torch.Tensor:
        off, n = self._region(slot, 2)
        return self.raw[off:off + n]

    def pin(self) -> bool:
        """Register the block as pinned host memory (CUDA only), so device copies are async, and
        mapped into the device's address space (with unified addressing at the same address)."""
        if not torch.cuda.is_available() or self.pinned:
            return self.pinned
        rc = int(torch.cuda.cudart().cudaHostRegister(self.raw.data_ptr(), self.raw.numel(), 3))
        self.pinned = rc == 0  # flags 1 | 2: cudaHostRegisterPortable | cudaHostRegisterMapped
        if not self.pinned:
            logger.warning("MosaicKV daemon: cudaHostRegister of %d MB failed (%s): device copies "
                           "of the daemon's slots are synchronous", self.raw.numel() >> 20, rc)
        return self.pinned

    def close(self, unlink: bool = False) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.raw.data_ptr())
            self.pinned = False
        self.raw = self.heartbeats = None
        if self._owner is not None:
            try:
                self._owner.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes at exit
                pass
            if unlink:
                self._owner.unlink()


# ---- results: tensors raw in the slot, the rest pickled -----------------------------------

class _Dumper(pickle.Pickler):
    def __init__(self, file, region: torch.Tensor, refs: dict[int, str]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.region, self.refs, self.offset = region, refs, 0

    def persistent_id(self, obj):
        ref = self.refs.get(id(obj))
        if ref is not None:
            return ("ref", ref)
        if not isinstance(obj, torch.Tensor):
            return None
        t = obj.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        off = _up(self.offset, TENSOR_ALIGN)
        if off + n > self.region.numel():
            raise ResultTooLarge(f"result needs more than the {self.region.numel()} bytes of a slot")
        if n:
            self.region[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
        self.offset = off + n
        return ("t", off, str(t.dtype), tuple(t.shape))


def dump(obj, region: torch.Tensor, refs: dict[int, str] | None = None) -> tuple[int, int]:
    """Write obj into region; objects whose id is in `refs` travel as their name only.
    Returns (offset, length) of the pickled skeleton, which follows the tensor bytes."""
    file = io.BytesIO()
    dumper = _Dumper(file, region, refs or {})
    dumper.dump(obj)
    skeleton = file.getvalue()
    off = dumper.offset
    if off + len(skeleton) > region.numel():
        raise ResultTooLarge(f"result needs more than the {region.numel()} bytes of a slot")
    region[off:off + len(skeleton)].copy_(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8))
    return off, len(skeleton)


class _Loader(pickle.Unpickler):
    """Tensors come back as views of one blob: one `as_strided` per tensor on a view of the
    blob per dtype (a page holds ~400 tensors; slicing, a dtype view and a shape view each
    cost ~3x that on CUDA, which made a page's unpickle ~10 ms on the H200 host)."""

    def __init__(self, file, blob: torch.Tensor, refs: dict[str, object]):
        super().__init__(file)
        self.blob, self.refs = blob, refs
        self.by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def persistent_load(self, pid):
        if pid[0] == "ref":
            return self.refs[pid[1]]
        _, off, dtype, shape = pid
        dtype = _dtype(dtype)
        typed = self.by_dtype.get(dtype)
        if typed is None:
            whole = self.blob.numel() // dtype.itemsize * dtype.itemsize
            flat = self.blob[:whole].view(dtype)
            # as_strided counts from the storage's start: where the blob starts in it (a slot's
            # offset in the shared block when read in place, 0 for a copy)
            typed = self.by_dtype[dtype] = (flat, flat.storage_offset())
        flat, start = typed
        return flat.as_strided(shape, _contiguous_strides(shape), start + off // dtype.itemsize)


def load(region: torch.Tensor, offset: int, length: int, refs: dict[str, object] | None = None,
         device="cpu"):
    """Rebuild what `dump` wrote, every tensor a view of one blob (one copy per page, not one per
    tensor: 4x faster). device=None: the blob is the region itself (no copy; the slot must not
    be reused while the tensors are read); else the tensor bytes leave the slot in one copy onto
    `device` (on CUDA asynchronously: the slot may be reused only after the current stream
    passes here)."""
    skeleton = region[offset:offset + length].numpy().tobytes()
    data = region[:offset]
    if device is None:
        blob = data
    else:
        device = torch.device(device)
        blob = data.clone() if device.type == "cpu" else data.to(device, non_blocking=True)
    return _Loader(io.BytesIO(skeleton), blob, refs or {}).load()
