"""codec/transfer.to_device_async: numpy arrays and host tensors arrive with their values and
dtype; on a CPU target (and for a tensor already on a device) it is a plain `.to`."""
import numpy as np
import pytest
import torch

from mosaickv_sglang.codec.transfer import to_device_async

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_values_and_dtype_arrive(device):
    a = np.arange(7, dtype=np.int64)[::2]  # not contiguous
    got = to_device_async(a, device)
    assert got.device.type == device and got.dtype == torch.int64
    assert got.cpu().tolist() == [0, 2, 4, 6]
    t = torch.tensor([3, 1, 2], dtype=torch.int32)
    got = to_device_async(t, device)
    if device == "cuda":
        torch.cuda.synchronize()
    assert got.dtype == torch.int32 and got.cpu().tolist() == [3, 1, 2]
    again = to_device_async(got, device)  # already there: moved as `.to` moves it (no copy)
    assert again.data_ptr() == got.data_ptr()
