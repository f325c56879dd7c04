"""Counting the torch ops that launch work (a kernel or a copy on a GPU; views and metadata ops
excluded), by name: what a host-bound step is made of, measurable on a CPU. Used by
benchmarks/seal_bench.py and scripts/decode_seal_probe.py."""
from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class LaunchCount(TorchDispatchMode):
    """Aten ops that compute or copy (views and metadata ops excluded), by name, into `ops` (a
    new Counter unless one is given to add to)."""
    VIEWS = {"view", "_unsafe_view", "select", "slice", "transpose", "t", "permute", "expand",
             "unsqueeze", "squeeze", "detach", "alias", "as_strided", "lift_fresh", "unbind",
             "split", "split_with_sizes", "tensor_split", "reshape", "flatten", "diagonal",
             "unflatten", "_reshape_alias", "view_as_real", "view_as_complex", "is_nonzero",
             "_local_scalar_dense", "item", "sym_size", "sym_stride", "sym_numel", "dim",
             "numel", "stride", "size", "is_contiguous", "t_", "set_", "_to_copy_cpu"}

    def __init__(self, ops: Counter | None = None):
        super().__init__()
        self.ops = Counter() if ops is None else ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))
