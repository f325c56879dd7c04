"""The breakable decode CUDA graph (`decode_cuda_graph: breakable`) captured and replayed for
real on a GPU, with the packed Triton decode kernels compiled (tests/test_decode_graph.py drives
the same backend on the CPU without a capture). A toy model step, as SGLang's graph runner
captures it: per layer a captured op feeding the attention, MosaicKV's attention as the graph
break (`eager_on_graph`: it runs eagerly at every replay on the capture-time ForwardBatch, whose
tensors are refreshed in place), a captured op consuming its output. Checked: the replayed step
equals the eager step on the real rows, the padded row is zero, the pools end in the same state
(pages seal inside the replays), and the warm-ups and the capture touch nothing."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import decode_steps, refresh_static, replay_view, repro, write_requests

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PS, H, HQ, D, LAYERS = 128, 2, 4, 64, 2


def _backend(seed: int, lengths, device: str):
    """A MosaicKV pool on `device` with `lengths` requests written and sealed (request rows
    1.., row 0 the padding row as in SGLang), decoded by the packed Triton kernels."""
    from mosaickv_sglang.serving.backend import MosaicAttnBackend
    from mosaickv_sglang.config import MosaicConfig
    from mosaickv_sglang.serving.pool import MosaicKVPool

    cfg = MosaicConfig(hot_tokens=0, basis_block_tokens=256, decode_kernel="triton",
                       sink_candidates=["band:b8=64,b4=0,b2=0,group=32"],
                       select={"budget_tokens": 256, "sink_tokens": 32, "recent_tokens": 64})
    pool = MosaicKVPool(40 * PS, PS, torch.bfloat16, H, D, LAYERS, device, False,
                        mosaic_config=cfg)
    req_to_token = write_requests(pool, lengths, seed, device)
    runner = SimpleNamespace(device=device, token_to_kv_pool=pool,
                             req_to_token_pool=SimpleNamespace(
                                 req_to_token=req_to_token.to(device)))
    return MosaicAttnBackend(runner), pool


def _state(pool):
    return (sorted(pool.sealed), pool.hot_page_of.clone().cpu(), sorted(pool.free_hot_pages))


def test_breakable_graph_replay_matches_eager(seed):
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
        BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph)

    dev = "cuda"
    lengths, bs = (250, 700, 127), 4  # captured size 4: one padded row
    eager, pool_e = _backend(seed, lengths, dev)
    graph, pool_g = _backend(seed, lengths, dev)
    layers = [SimpleNamespace(layer_id=i, tp_q_head_num=HQ, qk_head_dim=D, v_head_dim=D,
                              scaling=D ** -0.5) for i in range(LAYERS)]
    fill = graph.get_cuda_graph_seq_len_fill_value()
    # the capture-time batch: static buffers, padded (request 0, slot 0, seq_len = fill)
    static = SimpleNamespace(
        batch_size=bs, req_pool_indices=torch.zeros(bs, dtype=torch.long, device=dev),
        seq_lens=torch.full((bs,), fill, device=dev), seq_lens_cpu=torch.full((bs,), fill),
        out_cache_loc=torch.zeros(bs, dtype=torch.long, device=dev))
    q_in = torch.zeros(LAYERS, bs, HQ * D, dtype=torch.bfloat16, device=dev)
    k_in = torch.zeros(LAYERS, bs, H, D, dtype=torch.bfloat16, device=dev)
    v_in = torch.zeros_like(k_in)

    def step():  # what the model's layers do around the attention
        outs = []
        for layer in layers:
            q = q_in[layer.layer_id] * 1  # captured
            o = graph.forward_decode(q, k_in[layer.layer_id], v_in[layer.layer_id], layer,
                                     static)  # a graph break: eager at every replay
            outs.append(o * 1)  # captured, reads the break's output buffer
        return torch.stack(outs)

    graph.init_cuda_graph_state(bs, bs)
    graph.init_forward_metadata_out_graph(static, in_capture=True)
    before = _state(pool_g)
    bcg = BreakableCUDAGraph()
    with enable_breakable_cuda_graph():
        for _ in range(2):  # SGLang's two warm-ups before the capture
            assert not step().any(), repro(seed)
        torch.cuda.synchronize()
        with BreakableCUDAGraphCapture(bcg, pool=torch.cuda.graph_pool_handle(),
                                       stream=torch.cuda.Stream()):
            out = step()
        torch.cuda.synchronize()
    assert len(bcg._segments) == LAYERS + 1 and len(bcg._break_fns) == LAYERS, repro(seed)
    after = _state(pool_g)
    assert before[0] == after[0] and torch.equal(before[1], after[1]) and before[2] == after[2]

    gen = torch.Generator().manual_seed(seed + 1)
    # 250 -> 255: the second page of request 1 fills and seals
    for i, live in decode_steps(eager.req_to_token_pool.req_to_token, lengths, dev):
        locs = live.out_cache_loc
        eager.init_forward_metadata(live)
        n, pad = live.batch_size, bs - live.batch_size
        want = []
        for layer in layers:
            q, k, v = (torch.randn(n, *shape, generator=gen).bfloat16().to(dev)
                       for shape in ((HQ * D,), (H, D), (H, D)))
            want.append(eager.forward_decode(q, k, v, layer, live))
            j = layer.layer_id
            q_in[j, :n], k_in[j, :n], v_in[j, :n] = q, k, v
            for buf in (q_in, k_in, v_in):  # padded rows: anything
                buf[j, n:] = torch.randn(pad, *buf.shape[2:], generator=gen).bfloat16().to(dev)
        refresh_static(static, live, fill)
        graph.init_forward_metadata_out_graph(replay_view(static, bs, pad, locs))
        with enable_breakable_cuda_graph():
            bcg.replay()
        torch.cuda.synchronize()
        for j, w in enumerate(want):
            got = out[j, :n].float()
            err = float((got - w.float()).abs().max())
            assert err <= 1e-2 * float(w.float().abs().max()), (i, j, err, repro(seed))
            assert not out[j, n:].any(), (i, j, repro(seed))
        e, g = _state(pool_e), _state(pool_g)
        assert e[0] == g[0] and torch.equal(e[1][1:], g[1][1:]) and e[2] == g[2], (i, repro(seed))
    assert len(pool_g.sealed) > sum(n // PS for n in lengths), repro(seed)  # sealed on the way
