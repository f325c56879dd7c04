"""The top-pages kernel (`page_select._select_top_pages`) at the sizes the server launches, on
the GPU: one request of 32K / 128K / 512K / 1M tokens is 1024 / 4096 / 16384 / 32768 pages of
32 tokens, one program a (request, KV head) with 4 / 4 / 16 / 32 warps, against the torch
top-k. tests/test_page_select_kernel.py checks up to 300 pages (also on the CPU interpreter)."""
from __future__ import annotations

import pytest
import torch

from conftest import repro

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("pages", [1024, 4096, 16384, 32768])
def test_top_pages_at_server_sizes(pages, seed):
    from mosaickv_kernels.page_select import select_page_list, select_page_list_reference

    gen = torch.Generator().manual_seed(seed)
    bsz, h = 3, 8
    budget, sink, recent = 128, 2, 8  # SelectionConfig's defaults in 32-token pages
    num = torch.tensor([pages, pages // 2 + 3, 100])  # the last one: under the budget
    # distinct bounds (a permutation): no ties, so the kernel and topk agree exactly
    bounds = torch.stack([torch.randperm(pages, generator=gen) for _ in range(bsz * h)])
    bounds = bounds.float().view(bsz, h, pages)
    bounds = bounds.masked_fill(torch.arange(pages) >= num[:, None, None], float("-inf"))
    ids, counts = select_page_list(bounds.cuda(), num, budget, sink, recent)
    ref_ids, ref_counts = select_page_list_reference(bounds, num, budget, sink, recent)
    assert torch.equal(counts.cpu(), ref_counts), repro(seed)
    assert torch.equal(ids.cpu(), ref_ids), repro(seed)
    assert int(counts[0, 0]) == budget and int(counts[2, 0]) == 100, repro(seed)
