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

from mosaickv_sglang import wiring
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


def test_logits_output_goes_through_the_breakable_buffers_field_by_field():
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    bcg, orig = _bcg(mosaickv=True)
    out = LogitsProcessorOutput(next_token_logits=torch.randn(3, 11),
                                hidden_states=torch.randn(3, 5))
    buf = wiring._graph_alloc(orig["_alloc_full_buffer"], bcg, out, 4)
    assert isinstance(buf, LogitsProcessorOutput) and buf.next_token_logits.shape == (4, 11)
    assert buf.hidden_states.shape == (4, 5) and buf.next_token_logprobs is None
    wiring._graph_copy(orig["_copy_output_to_buffer"], bcg, out, buf, 3)
    got = wiring._graph_slice(orig["_slice_output"], bcg, buf, 3)
    assert torch.equal(got.next_token_logits, out.next_token_logits)
    assert torch.equal(got.hidden_states, out.hidden_states)
    assert got.next_token_logits.data_ptr() == buf.next_token_logits.data_ptr()  # views
    # tensors and tuples still go to SGLang's own code; without MosaicKV nothing changes
    t = wiring._graph_alloc(orig["_alloc_full_buffer"], bcg, torch.zeros(3, 2), 4)
    assert t.shape == (4, 2)
    plain, orig = _bcg(mosaickv=False)
    with pytest.raises(TypeError, match="Unsupported BCG output type"):
        wiring._graph_alloc(orig["_alloc_full_buffer"], plain, out, 4)
    with pytest.raises(ValueError, match="changed between capture sizes"):
        wiring._graph_copy(orig["_copy_output_to_buffer"], bcg,
                           LogitsProcessorOutput(next_token_logits=torch.randn(3, 11)), buf, 3)
