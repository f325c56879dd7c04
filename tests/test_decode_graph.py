"""The breakable decode CUDA graph (`decode_cuda_graph: breakable`), on the CPU: what can be
checked without a GPU. The graph capture itself is SGLang's and needs CUDA; here: the step
output of a causal LM (LogitsProcessorOutput) goes through the breakable backend's buffers field
by field (SGLang 0.5.17 raises on it), and the attention backend, driven the way the decode graph
runner drives it (dummy warm-up/capture batches, a padded batch at replay whose real size comes
from `init_forward_metadata_out_graph`), decodes exactly what the eager path decodes."""
import inspect
from types import SimpleNamespace

import pytest
import torch

from conftest import write_requests
from mosaickv_sglang.integration import wiring
from mosaickv_sglang.config import MosaicConfig


def _bcg(mosaickv: bool):
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import (
        BreakableCudaGraphBackend)

    bcg = object.__new__(BreakableCudaGraphBackend)
    args = SimpleNamespace(**({wiring.CONFIG_ATTR: MosaicConfig()} if mosaickv else {}))
    bcg._model_runner = SimpleNamespace(server_args=args)
    originals = {name: inspect.unwrap(getattr(BreakableCudaGraphBackend, name))
                 for name in ("_alloc_full_buffer", "_slice_output", "_copy_output_to_buffer")}
    return bcg, originals


def test_logits_output_goes_through_the_breakable_buffers_field_by_field(seed):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    bcg, orig = _bcg(mosaickv=True)
    out = LogitsProcessorOutput(next_token_logits=torch.randn(3, 11),
                                hidden_states=torch.randn(3, 5))
    buf = wiring._graph_per_field(orig["_alloc_full_buffer"], bcg, out, 4)
    assert isinstance(buf, LogitsProcessorOutput) and buf.next_token_logits.shape == (4, 11)
    assert buf.hidden_states.shape == (4, 5) and buf.next_token_logprobs is None
    wiring._graph_copy(orig["_copy_output_to_buffer"], bcg, out, buf, 3)
    got = wiring._graph_per_field(orig["_slice_output"], bcg, buf, 3)
    assert torch.equal(got.next_token_logits, out.next_token_logits)
    assert torch.equal(got.hidden_states, out.hidden_states)
    assert got.next_token_logits.data_ptr() == buf.next_token_logits.data_ptr()  # views
    # tensors and tuples still go to SGLang's own code; without MosaicKV nothing changes
    t = wiring._graph_per_field(orig["_alloc_full_buffer"], bcg, torch.zeros(3, 2), 4)
    assert t.shape == (4, 2)
    plain, orig = _bcg(mosaickv=False)
    with pytest.raises(TypeError, match="Unsupported BCG output type"):
        wiring._graph_per_field(orig["_alloc_full_buffer"], plain, out, 4)
    with pytest.raises(ValueError, match="changed between capture sizes"):
        wiring._graph_copy(orig["_copy_output_to_buffer"], bcg,
                           LogitsProcessorOutput(next_token_logits=torch.randn(3, 11)), buf, 3)


PS, H, HQ, D, LAYERS = 128, 2, 4, 64, 2


def _backend(decode_kernel, seed, lengths):
    """A MosaicKV pool with `lengths` requests written and sealed (request rows 1.., row 0 is
    the padding row as in SGLang), and its attention backend."""
    from mosaickv_sglang.serving.backend import MosaicAttnBackend
    from mosaickv_sglang.serving.pool import MosaicKVPool

    cfg = MosaicConfig(hot_tokens=0, basis_block_tokens=256, decode_kernel=decode_kernel,
                       sink_candidates=["band:b8=64,b4=0,b2=0,group=32"],
                       select={"budget_tokens": 256, "sink_tokens": 32, "recent_tokens": 64})
    pool = MosaicKVPool(40 * PS, PS, torch.bfloat16, H, D, LAYERS, "cpu", False,
                        mosaic_config=cfg)
    req_to_token = write_requests(pool, lengths, seed)
    runner = SimpleNamespace(device="cpu", token_to_kv_pool=pool,
                             req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    return MosaicAttnBackend(runner), pool


def _state(pool):
    return (sorted(pool.sealed), pool.hot_page_of.clone(), sorted(pool.free_hot_pages))


@pytest.mark.parametrize("decode_kernel", ["reference", "triton"])
def test_decode_driven_like_the_breakable_graph_runner_matches_eager(decode_kernel, seed):
    """Backend E decodes eagerly; backend G is driven as SGLang's decode graph runner drives it
    (state init, dummy warm-up/capture forwards on a padded capture batch, then every step the
    static buffers refreshed in place, the real size from init_forward_metadata_out_graph, the
    attention called with the padded batch). Same outputs on the real rows (pages seal on the
    way), zero on the padded row, same pool state; the dummy forwards touch nothing."""
    from conftest import decode_steps, refresh_static, replay_view, repro

    lengths, bs = (250, 700, 127), 4  # captured size 4: one padded row
    eager, pool_e = _backend(decode_kernel, seed, lengths)
    graph, pool_g = _backend(decode_kernel, seed, lengths)
    layers = [SimpleNamespace(layer_id=i, tp_q_head_num=HQ, qk_head_dim=D, v_head_dim=D,
                              scaling=D ** -0.5) for i in range(LAYERS)]
    # the capture-time batch: static buffers, padded (request 0, slot 0, seq_len = fill)
    fill = graph.get_cuda_graph_seq_len_fill_value()
    static = SimpleNamespace(batch_size=bs, req_pool_indices=torch.zeros(bs, dtype=torch.long),
                             seq_lens=torch.full((bs,), fill), seq_lens_cpu=torch.full((bs,), fill),
                             out_cache_loc=torch.zeros(bs, dtype=torch.long))
    graph.init_cuda_graph_state(bs, bs)
    graph.init_forward_metadata_out_graph(static, in_capture=True)
    before = _state(pool_g)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(3):  # two warm-ups and the capture run
        for layer in layers:
            o = graph.forward_decode(torch.randn(bs, HQ * D).bfloat16(),
                                     torch.randn(bs, H, D).bfloat16(),
                                     torch.randn(bs, H, D).bfloat16(), layer, static)
            assert o.shape == (bs, HQ * D) and not o.any(), repro(seed)
    after = _state(pool_g)
    assert before[0] == after[0] and torch.equal(before[1], after[1]) and before[2] == after[2]

    # 250 -> 255: the second page of request 1 fills and seals
    for step, live in decode_steps(eager.req_to_token_pool.req_to_token, lengths):
        locs = live.out_cache_loc
        eager.init_forward_metadata(live)
        n, pad = live.batch_size, bs - live.batch_size
        refresh_static(static, live, fill)
        graph.init_forward_metadata_out_graph(replay_view(static, bs, pad, locs))
        for layer in layers:
            q = torch.randn(n, HQ * D, generator=gen).bfloat16()
            k = torch.randn(n, H, D, generator=gen).bfloat16()
            v = torch.randn(n, H, D, generator=gen).bfloat16()
            want = eager.forward_decode(q, k, v, layer, live)
            pad_rows = lambda x: torch.cat([x, torch.randn(pad, *x.shape[1:]).bfloat16()])  # noqa: E731
            got = graph.forward_decode(pad_rows(q), pad_rows(k), pad_rows(v), layer, static)
            assert torch.equal(got[:n], want), (step, layer.layer_id, repro(seed))
            assert not got[n:].any(), repro(seed)
        e, g = _state(pool_e), _state(pool_g)
        assert e[0] == g[0] and torch.equal(e[1][1:], g[1][1:]) and e[2] == g[2], (step, repro(seed))
    assert len(pool_g.sealed) > sum(n // PS for n in lengths), repro(seed)  # a page sealed on the way
