"""triton_kernels/page_gather.py: one page of every layer's K/V by one launch vs `page_kv` (the
torch stack the pool's slot copy used), on fresh random buffers; bad buffers refused."""
import pytest
import torch

from mosaickv_kernels.page_gather import PageGather
from mosaickv_sglang.codec.seal import page_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)


@pytest.mark.parametrize("layers,heads,head_dim,page_size,pages", [
    (2, 2, 64, 16, 3), (3, 1, 80, 8, 2), (1, 4, 32, 24, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gather_matches_page_kv(layers, heads, head_dim, page_size, pages, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k, v = ([torch.randn(pages * page_size, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
             for _ in range(layers)] for _ in range(2))
    gather = PageGather(k, v, page_size)
    for page in torch.randperm(pages, generator=gen).tolist():
        out = torch.full(gather.shape, float("nan"), dtype=dtype, device=DEVICE)
        got = gather(page, out)  # every element must be written
        assert got is out
        want = page_kv(k, v, page, page_size)
        assert got.shape == want.shape == (layers, 2, heads, page_size, head_dim)
        assert not got.isnan().any(), f"seed {seed}: page {page} not fully written"
        assert torch.equal(got, want), f"seed {seed}: page {page} differs (a copy is exact)"
        assert torch.equal(gather(page), want), f"seed {seed}: page {page} into a new tensor"


def test_gather_refuses_bad_buffers_and_pages():
    k = [torch.zeros(32, 2, 16, device=DEVICE) for _ in range(2)]
    with pytest.raises(ValueError, match="like the first"):
        PageGather(k, [k[0], torch.zeros(32, 2, 8, device=DEVICE)], 8)
    with pytest.raises(ValueError, match="like the first"):
        PageGather(k, [k[0], torch.zeros(2, 32, 16, device=DEVICE).transpose(0, 1)], 8)
    with pytest.raises(ValueError, match="one K and one V"):
        PageGather(k, k[:1], 8)
    with pytest.raises(IndexError, match="outside"):
        PageGather(k, k, 8)(4)
    with pytest.raises(ValueError, match="out must be"):
        PageGather(k, k, 8)(0, torch.empty(2, 2, 2, 16, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_kernel_compiles_for_the_h200(compile_sm90, dtype):
    from mosaickv_kernels.page_gather import _gather_page_kernel
    sig = {"ptrs": "*i64", "out": dtype, **{k: "i32" for k in ("row0", "S", "H", "D",
                                                                 "row_stride")}}
    assert "cubin" in compile_sm90(_gather_page_kernel, sig, {"BLOCK_S": 32, "BLOCK_D": 128})
