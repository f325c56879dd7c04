"""mosaickv_kernels.decode_tables (the decode graph's per-step tables in one launch) against its
torch reference `GraphDecode.device_tables`, on fresh random batches: random lengths (padded
rows, requests owning no page, a partial last page), random sealed prefixes and bases addresses,
random hot pages. Without CUDA the kernel runs in Triton's interpreter. The graph test
(tests/test_graph_decode.py) checks the same tables against the host plan on a real pool."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
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
    ends = []
    # rows < bs: padded requests; window > 0: the position rule's dense window cuts the prefix
    for bs, rows, window in ((1, 1, 0), (4, 3, 0), (5, 5, 0), (5, 4, 128), (3, 3, 200)):
        fake = SimpleNamespace(pool=SimpleNamespace(position_rule=False, page_size=PS), width=W,
                               block_pages=BLOCK, hot_cap=CAP, pps=PPS, window=window)
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
                            pages_per_seg=PPS, available=available, count_scale=3,
                            window=window)
        why = (bs, rows, window, repro(seed))
        end = int(want["seg_indptr"][-1])
        ends.append(end)
        for name in ("seg_indptr", "hot_lens", "req_pages", "basis_ptrs", "hot_rows"):
            assert torch.equal(out[name].cpu(), want[name].cpu()), (name, why)
        assert torch.equal(out["seg_ids"][:end].cpu(), want["seg_ids"][:end].cpu()), why
        assert (out["seg_ids"][end:].cpu() == -7).all(), why  # past the last offset: untouched
        assert int(available) == 5 + int(want["req_pages"].sum()) * 3, why
    assert sum(ends) > 0, repro(seed)  # some page sealed: the CSR was exercised


def _launch_on_views(dt, gen, bs: int, rows: int) -> None:
    """`build_decode_tables` on a random batch, its int32 tables views of one flat buffer at
    offsets that depend on `bs` (as the graph's buckets hold them)."""
    req_to_token, rpi, lens, table = _case(gen, bs, rows)
    flat32 = torch.zeros(bs * W + 1 + bs * W * BLOCK + 2 * bs + 3, dtype=torch.int32,
                         device=DEVICE)
    out = {"seg_indptr": flat32[:bs * W + 1], "seg_ids": flat32[bs * W + 1:][:bs * W * BLOCK],
           "hot_lens": flat32[-2 * bs:][:bs], "req_pages": flat32[-bs:],
           "basis_ptrs": torch.zeros(bs * W, dtype=torch.int64, device=DEVICE),
           "hot_rows": torch.zeros(bs, CAP, dtype=torch.int64, device=DEVICE)}
    dt.build_decode_tables(req_to_token, rpi, lens, rows, table.sealed, table.basis_addr,
                           table.hot_page, out, page_size=PS, width=W, block_pages=BLOCK,
                           pages_per_seg=PPS, count_scale=3,
                           available=torch.zeros(1, dtype=torch.int64, device=DEVICE))


def test_one_compiled_variant_serves_every_batch(monkeypatch):
    """Every launch `build_decode_tables` makes, whatever the batch size and real rows (1 and
    multiples of 16 included: Triton's default gives each its own variant) and wherever the
    bucket's tables sit in their flat buffers, is the variant `compile_variant` compiles at
    start-up: no value of the kernel is specialized, so the compile key is the argument dtypes
    and the block sizes. (The first multi-request device-planned step compiled in a live step
    before: a ~0.7 s stall at 17 x 32K on an H100.)"""
    from conftest import LaunchRecorder
    from mosaickv_kernels import decode_tables as dt

    # the key model below holds only if nothing is specialized: every argument but the
    # constexprs is named in the decorator (a JITFunction, or the interpreter's wrapper)
    kernel = dt._decode_tables
    opts = getattr(kernel, "kwargs", None) or {
        "do_not_specialize": kernel.do_not_specialize,
        "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment}
    fn = getattr(kernel, "fn", kernel)
    fn = getattr(fn, "fn", fn)
    params = inspect.signature(fn).parameters.values()
    runtime = {p.name for p in params if "constexpr" not in str(p.annotation)}
    assert set(opts["do_not_specialize"]) | set(opts["do_not_specialize_on_alignment"]) \
        == runtime

    class Recorder(LaunchRecorder):
        @staticmethod
        def _key(args, kwargs):  # Triton's key without value specialization: dtypes, int width
            return (tuple(a.dtype if isinstance(a, torch.Tensor) else
                          a if isinstance(a, torch.dtype) else  # a warm-up's tensor
                          ("i64" if abs(a) >= 2**31 else "i32") for a in args),
                    tuple(sorted(kwargs.items())))

    rec = Recorder()
    monkeypatch.setattr(dt, "_decode_tables", rec)
    gen = torch.Generator().manual_seed(0)
    for bs, rows in ((1, 1), (2, 1), (16, 16), (24, 17), (24, 16)):
        _launch_on_views(dt, gen, bs, rows)
    assert len(rec.launched) == 1, rec.launched
    dt.compile_variant(width=W, block_pages=BLOCK, hot_cap=CAP)
    assert rec.launched <= rec.warmed
    # a server whose table sizes differ compiles its own (the block sizes are constexprs)
    rec.warmed.clear()
    dt.compile_variant(width=W + 4, block_pages=BLOCK, hot_cap=CAP)
    assert not rec.launched <= rec.warmed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's compile cache: CUDA only")
def test_the_start_up_compile_is_what_every_batch_launches():
    """On the GPU: after `compile_variant`, launches at batch sizes 1, 16 and 24 (17 real rows),
    the tables at the offsets each size puts them, add nothing to the kernel's compile cache."""
    from mosaickv_kernels import decode_tables as dt

    dt.compile_variant(width=W, block_pages=BLOCK, hot_cap=CAP)
    dev = torch.cuda.current_device()
    cache = dt._decode_tables.device_caches[dev][0]
    before = len(cache)
    gen = torch.Generator().manual_seed(1)
    for bs, rows in ((1, 1), (16, 16), (24, 17)):
        _launch_on_views(dt, gen, bs, rows)
    torch.cuda.synchronize()
    assert len(cache) == before
