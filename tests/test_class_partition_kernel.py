"""triton_kernels/class_partition.py: a selection's pages grouped by width class vs the torch
reference, on fresh random headers, lists and classes (a page of a class not in the table
among them), and the band decode reading the grouped list (test_band_decode_kernel covers the
decode against its reference both ways)."""
import pytest
import torch

from conftest import repro
from mosaickv_kernels.class_partition import class_partition, class_partition_reference
from mosaickv_kernels.layout import HDR, HEADER_WIDTH

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)


def _headers(gen, segs: int, classes: torch.Tensor, stray: bool) -> torch.Tensor:
    """Segment headers whose six band widths are a random class each (or, for one segment when
    `stray`, widths of no class)."""
    hdr = torch.randint(0, 1000, (segs, HEADER_WIDTH), generator=gen, dtype=torch.int32)
    pick = torch.randint(0, classes.shape[0], (segs,), generator=gen)
    widths = classes[pick].clone()
    if stray:
        widths[segs // 2] = torch.tensor([7, 7, 7, 7, 7, 7], dtype=torch.int32)
    k, v = HDR["k_b8"], HDR["v_b8"]
    hdr[:, k:k + 3], hdr[:, v:v + 3] = widths[:, :3], widths[:, 3:]
    return hdr


@pytest.mark.parametrize("rows,h,k,c,stray", [(3, 2, 20, 4, False), (5, 8, 128, 16, True),
                                              (1, 1, 7, 1, False), (2, 3, 33, 5, True)])
def test_class_partition_matches_reference(rows, h, k, c, stray, seed):
    gen = torch.Generator().manual_seed(seed)
    pps = 4  # 32-token pages per 128-token segment
    classes = torch.unique(torch.randint(0, 65, (c, 6), generator=gen, dtype=torch.int32), dim=0)
    segs_per_row = torch.randint(1, 12, (rows,), generator=gen)
    indptr = torch.zeros(rows + 1, dtype=torch.int32)
    indptr[1:] = segs_per_row.cumsum(0)
    total = int(indptr[-1]) + 3
    seg_ids = torch.randperm(total, generator=gen)[:int(indptr[-1])].to(torch.int32)
    headers = _headers(gen, total, classes, stray)
    ids = torch.zeros(rows, h, k, dtype=torch.int32)
    counts = torch.zeros(rows, h, dtype=torch.int32)
    for r in range(rows):
        pages = int(segs_per_row[r]) * pps
        for j in range(h):
            n = int(torch.randint(0, min(k, pages) + 1, (1,), generator=gen))
            ids[r, j, :n] = torch.randperm(pages, generator=gen)[:n].sort().values.to(torch.int32)
            ids[r, j, n:] = torch.randint(0, 10**6, (k - n,), generator=gen)  # junk past count
            counts[r, j] = n
    args = [t.to(DEVICE) for t in (ids, counts, indptr, seg_ids, headers, classes)] + [pps]
    got_ids, got_offs = class_partition(*args)
    want_ids, want_offs = class_partition_reference(*args)
    assert torch.equal(got_offs.cpu(), want_offs.cpu()), repro(seed)
    for r in range(rows):  # entries past offs[C] are not read: compare the grouped part
        for j in range(h):
            n = int(want_offs[r, j, -1])
            assert torch.equal(got_ids[r, j, :n].cpu(), want_ids[r, j, :n].cpu()), (r, j, repro(seed))
            assert n <= int(counts[r, j]), repro(seed)
            assert stray or n == int(counts[r, j]), repro(seed)  # every page has its class
    # each class's pages keep their order (ascending here) and are the list's pages of it
    offs = want_offs.cpu()
    assert bool((offs[..., 1:] >= offs[..., :-1]).all()), repro(seed)


def test_class_partition_refuses_what_it_cannot_read():
    ids = torch.zeros(1, 1, 4, dtype=torch.int64, device=DEVICE)
    counts = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    z = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    hdr = torch.zeros(1, HEADER_WIDTH, dtype=torch.int32, device=DEVICE)
    cls = torch.zeros(1, 6, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="page_ids must be contiguous int32"):
        class_partition(ids, counts, z, z, hdr, cls, 4)
    with pytest.raises(ValueError, match=r"classes must be int32 \[C, 6\]"):
        class_partition(ids.int(), counts, z, z, hdr, cls[:, :5], 4)
