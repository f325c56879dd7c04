"""Host-to-device copies of small host tensors (index lists, table rows) that do not make the
host wait. A copy from pageable memory makes CUDA first wait for the stream's queued work, so
the host stops launching until the GPU has caught up; from pinned memory it is queued like a
kernel (the caching host allocator keeps the pinned block until the copy is done). The sealing
path makes a few such copies per chooser try and per install group, between launches."""
from __future__ import annotations

import numpy as np
import torch


def to_device_async(t: torch.Tensor | np.ndarray, device) -> torch.Tensor:
    """A small host tensor (or numpy array) onto `device` without waiting for the stream (a
    tensor already on a device is moved as `.to` moves it)."""
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
