"""mosaickv_kernels.decode_tables (the decode graph's per-step tables in one launch) against its
torch reference `GraphDecode.device_tables`, on fresh random batches: random lengths (padded
rows, requests owning no page, a partial last page), random sealed prefixes and bases addresses,
random hot pages. Without CUDA the kernel runs in Triton's interpreter. The graph test
(tests/test_graph_decode.py) checks the same tables against the host plan on a real pool."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from conftest import repro
from mosaickv_sglang.serving.graph_decode import DevicePageTable, GraphDecode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PS, W, BLOCK, PPS, CAP = 128, 3, 4, 4, 320


def _case(gen, bs: int, rows: int):
    most = W * BLOCK
    reqs, width = 2 * bs + 1, most * PS + 64
    n_pages = reqs * most + 1
    # every request row: its own distinct logical pages (in random order), slots page-major
    perm = torch.randperm(n_pages - 1, generator=gen)[:reqs * most].view(reqs, most) + 1
    tok = torch.arange(width)
    cols = (tok // PS).clamp(max=most - 1)
    req_to_token = (perm[:, cols] * PS + tok % PS).to(torch.int32)
    rpi = torch.randperm(reqs, generator=gen)[:bs].to(torch.int64)
    lens = torch.randint(1, most * PS, (bs,), generator=gen)
    if bs > 1:
        lens[0] = 1  # one token: no page sealed
    sealed = torch.zeros(n_pages, dtype=torch.bool)
    for b in range(bs):  # a sealed prefix of whole pages, sometimes all of them
        own = (int(lens[b]) + PS - 1) // PS
        k = int(torch.randint(0, own + 1, (), generator=gen))
        sealed[perm[rpi[b], :k]] = True
    addr = torch.randint(1, 2**40, (n_pages,), generator=gen)
    hot = torch.randint(0, 4096, (n_pages,), generator=gen)
    table = DevicePageTable(sealed.to(DEVICE), addr.to(DEVICE), hot.to(DEVICE))
    return req_to_token.to(DEVICE), rpi.to(DEVICE), lens.to(DEVICE), table


def test_tables_match_the_torch_reference(seed):
    from mosaickv_kernels.decode_tables import build_decode_tables

    gen = torch.Generator().manual_seed(seed)
    fake = SimpleNamespace(pool=SimpleNamespace(position_rule=False, page_size=PS), width=W,
                           block_pages=BLOCK, hot_cap=CAP, pps=PPS)
    ends = []
    for bs, rows in ((1, 1), (4, 3), (5, 5)):  # rows < bs: padded requests
        req_to_token, rpi, lens, table = _case(gen, bs, rows)
        # the hot tail must fit the table's width: shorten what does not
        want = GraphDecode.device_tables(fake, SimpleNamespace(bs=bs), rpi, lens, req_to_token,
                                         rows, table)
        over = want["hot_lens"].cpu() > CAP
        if over.any():
            lens = torch.where(over.to(DEVICE), lens - (want["hot_lens"] - CAP).to(lens), lens)
            want = GraphDecode.device_tables(fake, SimpleNamespace(bs=bs), rpi, lens,
                                             req_to_token, rows, table)
        out = {"seg_indptr": torch.full((bs * W + 1,), -7, dtype=torch.int32),
               "seg_ids": torch.full((bs * W * BLOCK,), -7, dtype=torch.int32),
               "hot_lens": torch.full((bs,), -7, dtype=torch.int32),
               "req_pages": torch.full((bs,), -7, dtype=torch.int32),
               "basis_ptrs": torch.full((bs * W,), -7, dtype=torch.int64),
               "hot_rows": torch.full((bs, CAP), -7, dtype=torch.int64)}
        out = {k: v.to(DEVICE) for k, v in out.items()}
        available = torch.full((1,), 5, dtype=torch.int64, device=DEVICE)
        build_decode_tables(req_to_token, rpi, lens, rows, table.sealed, table.basis_addr,
                            table.hot_page, out, page_size=PS, width=W, block_pages=BLOCK,
                            pages_per_seg=PPS, available=available, count_scale=3)
        why = (bs, rows, repro(seed))
        end = int(want["seg_indptr"][-1])
        ends.append(end)
        for name in ("seg_indptr", "hot_lens", "req_pages", "basis_ptrs", "hot_rows"):
            assert torch.equal(out[name].cpu(), want[name].cpu()), (name, why)
        assert torch.equal(out["seg_ids"][:end].cpu(), want["seg_ids"][:end].cpu()), why
        assert (out["seg_ids"][end:].cpu() == -7).all(), why  # past the last offset: untouched
        assert int(available) == 5 + int(want["req_pages"].sum()) * 3, why
    assert sum(ends) > 0, repro(seed)  # some page sealed: the CSR was exercised
