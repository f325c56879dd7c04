"""Out-of-tree SGLang platform that runs the real server on a CPU (development and CI only).

SGLang 0.5.17 has no usable CPU path without an unpublished CPU build of sgl-kernel
(``SGLANG_USE_CPU_ENGINE=1``: never set it). This platform instead declares itself
*out of tree*, so every fused op takes its ``forward_native`` (pure torch) path, attention
defaults to ``torch_native`` and the KV pool / paged allocator come from here.

Opt in (nothing changes unless the variable is set)::

    MOSAICKV_CPU_PLATFORM=1 python -m sglang.launch_server --model-path ... \
        --max-total-tokens 4096 ...

Add ``SGLANG_PLATFORM=mosaickv_cpu`` when another platform plugin is installed (SGLang refuses
to pick among several activated plugins). With ``SGLANG_PLATFORM=mosaickv_cpu`` but without
``MOSAICKV_CPU_PLATFORM=1`` SGLang stops with "activate() returned None". The platform refuses
(returns None and logs why) when CUDA is available: on a GPU host use SGLang's own platform.

What the platform changes, in 0.5.17:

* ``_enum = OOT`` (``is_out_of_tree()``): dispatch key "native", device "cpu", gloo.
* ``apply_server_args_defaults``: SGLang's own CPU handler has already picked ``intel_amx``
  (needs sgl-kernel's CPU ops) when the device is "cpu" and no backend was given; it is turned
  into ``torch_native``; sampling "pytorch"; CUDA graphs disabled (no OOT graph runner).
  With ``--tp N`` (gloo; `tp_cpu_defaults`): custom all-reduce off, SGLang's pynccl
  communicator off (it would find torch's bundled libnccl and open a CUDA device) and one share
  of this process's cores per rank in ``SGLANG_CPU_OMP_THREADS_BIND`` (SGLang otherwise wants
  one NUMA node per rank), each unless already set.
* ``get_mha_kv_pool_cls``: the stock ``MHATokenToKVPool`` (its writes are plain indexing on CPU).
* ``get_paged_allocator_cls``: ``torch_paged_allocator_cls()``, the stock paged
  allocator with its two Triton kernels (``alloc_extend_kernel``, ``alloc_decode_kernel``)
  replaced by vectorized torch (the stock ones fail on a CPU unless ``TRITON_INTERPRET=1``).
  0.5.17 uses the paged allocator for every OOT platform, also with ``--page-size 1``.
* ``init_backend`` (each model worker): batch-invariant linear layers (`batch_invariant_linears`):
  a token's hidden states, K/V and logits are the same bits in a decode batch of 1 or of 12, as
  a greedy request's output must not depend on its neighbours (docs/determinism.md).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

# Imported by sglang.srt.platforms itself before it resolves the platform, so safe here. The
# allocator module is not (sglang.srt.utils does `from sglang.srt.platforms import
# current_platform`, which would resolve the platform while it is being resolved): built lazily.
from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import SRTPlatform

logger = logging.getLogger(__name__)

ENV_OPT_IN = "MOSAICKV_CPU_PLATFORM"
PLATFORM_CLASS = "mosaickv_sglang.integration.platform_cpu.MosaicCpuPlatform"


def activate() -> str | None:
    """``sglang.srt.platforms`` entry point: the platform class path, or None (not opted in)."""
    if os.environ.get(ENV_OPT_IN, "0") != "1":
        return None
    if torch.cuda.is_available():
        logger.warning("%s=1 ignored: CUDA is available, use SGLang's CUDA platform "
                       "(the MosaicKV CPU platform is for CPU-only development and CI)", ENV_OPT_IN)
        return None
    return PLATFORM_CLASS


# A library name that cannot load: SGLang's PyNcclCommunicator then disables itself (its
# "missing NCCL library, e.g. in a non-GPU environment" path) and all-reduces go through gloo.
NO_NCCL = "mosaickv-cpu-platform-no-nccl.so"


def tp_cpu_defaults(server_args, env) -> None:
    """What ``--tp N`` needs on this platform (SGLang 0.5.17), set in `env` for the scheduler
    processes the launcher spawns; explicit settings win. Logged."""
    tp = server_args.tp_size
    server_args.disable_custom_all_reduce = True  # CUDA IPC buffers
    env.setdefault("SGLANG_NCCL_SO_PATH", NO_NCCL)
    if "SGLANG_CPU_OMP_THREADS_BIND" not in env:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tp:
            raise ValueError(f"--tp {tp} on the MosaicKV CPU platform needs a core per rank; "
                             f"this process may use {len(cores)}")
        share = len(cores) // tp
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cores[r * share:(r + 1) * share])) for r in range(tp))
    logger.info("MosaicKV CPU platform, --tp %d: gloo all-reduce (no pynccl, no custom "
                "all-reduce), SGLANG_CPU_OMP_THREADS_BIND=%s", tp,
                env["SGLANG_CPU_OMP_THREADS_BIND"])


def _ceil_div(x: torch.Tensor, d: int) -> torch.Tensor:
    return (x + d - 1) // d


def extend_slots(pre: torch.Tensor, seq: torch.Tensor, last_loc: torch.Tensor,
                 pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV slots of the new positions ``pre[i] .. seq[i]-1`` of every request (CPU int64).

    Same contract as SGLang's ``alloc_extend_kernel``: a request first fills the partial page
    after ``last_loc[i]``, then takes ``ceil(seq/ps) - ceil(pre/ps)`` fresh pages from ``pages``
    in request order.
    """
    ps = page_size
    ext = seq - pre
    req = torch.repeat_interleave(torch.arange(len(ext)), ext)
    starts = torch.cumsum(ext, 0) - ext
    pos = torch.arange(int(ext.sum())) - starts[req] + pre[req]  # position in the sequence
    first_fresh_page = _ceil_div(pre, ps)
    in_old_page = pos < first_fresh_page[req] * ps
    out = last_loc[req] + 1 + (pos - pre[req])
    if len(pages):
        new_pages = _ceil_div(seq, ps) - first_fresh_page
        page_base = torch.cumsum(new_pages, 0) - new_pages
        idx = page_base[req] + pos // ps - first_fresh_page[req]
        fresh = pages[torch.where(in_old_page, 0, idx)] * ps + pos % ps
        out = torch.where(in_old_page, out, fresh)
    return out


def decode_slots(seq: torch.Tensor, last_loc: torch.Tensor, pages: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """KV slot of the one new token (position ``seq[i]-1``) per request (CPU int64)."""
    needs_page = (seq - 1) % page_size == 0
    out = last_loc + 1
    out[needs_page] = pages * page_size
    return out


@functools.cache
def torch_paged_allocator_cls() -> type:
    """``PagedTokenToKVPoolAllocator`` with its two Triton kernels replaced by torch."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    class TorchPagedTokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
        def _take_pages(self, n: int):
            if self.need_sort and n > len(self.free_pages):
                self.merge_and_sort_free()
            if n > len(self.free_pages):
                return None
            pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
            return pages.cpu()

        def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                         extend_num_tokens: int, num_new_pages: int | None = None):
            pre, seq = prefix_lens_cpu.long(), seq_lens_cpu.long()
            ps = self.page_size
            pages = self._take_pages(int((_ceil_div(seq, ps) - _ceil_div(pre, ps)).sum()))
            if pages is None:
                return None
            out = extend_slots(pre, seq, last_loc.cpu().long(), pages, ps)
            assert out.numel() == extend_num_tokens, (out.numel(), extend_num_tokens)
            return out.to(self.device)

        def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
            seq = seq_lens_cpu.long()
            pages = self._take_pages(int(((seq - 1) % self.page_size == 0).sum()))
            if pages is None:
                return None
            return decode_slots(seq, last_loc.cpu().long(), pages, self.page_size).to(self.device)

    return TorchPagedTokenToKVPoolAllocator


# MKL (2024.2, AVX2) computes a row of x @ W.T with other bits when x has 1, 2, 3, 5, 6, 7, 9, 10
# or 11 rows than the same row in a larger x; from 12 rows on (and at 4 and 8) a row's bits do not
# depend on how many rows came with it or on their values (measured on the shapes of the tiny
# Llama and SmolLM2-135M, 1 and 2 threads, 1 to 512 rows at several offsets).
MIN_GEMM_ROWS = 16


def pad_rows(fn, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """fn(x, ...) for a row-wise function of x (a linear layer: each output row depends on its
    input row only), computed on x's rows padded with zeros to at least MIN_GEMM_ROWS, so a
    row's bits do not depend on how many rows came with it."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if rows == 0 or rows >= MIN_GEMM_ROWS or x.device.type != "cpu":
        return fn(x, *args, **kwargs)
    padded = x.new_zeros(MIN_GEMM_ROWS, x.shape[-1])
    padded[:rows] = x.reshape(rows, x.shape[-1])
    out = fn(padded, *args, **kwargs)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


@functools.cache
def batch_invariant_linears() -> None:
    """Linear layers (``UnquantizedLinearMethod.apply``: QKV, O, MLP) and the LM head
    (``LogitsProcessor._compute_lm_head``) through `pad_rows`: a decode batch of 1 then gives
    the same bits per request as a batch of 12. Without it a request's decode K/V differ in the
    last bits with its batch's size, a compressed cache can turn that into a different greedy
    token (docs/determinism.md), and so can a near-tie in the logits. Installed once per
    process, logged."""
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    apply, lm_head = UnquantizedLinearMethod.apply, LogitsProcessor._compute_lm_head

    def linear_apply(self, layer, x, bias=None):
        return pad_rows(lambda rows: apply(self, layer, rows, bias), x)

    def compute_lm_head(self, hidden_states, lm_head_layer, embedding_bias=None):
        return pad_rows(lambda rows: lm_head(self, rows, lm_head_layer, embedding_bias),
                        hidden_states)

    UnquantizedLinearMethod.apply = linear_apply
    LogitsProcessor._compute_lm_head = compute_lm_head
    logger.info("MosaicKV CPU platform: batch-invariant linear layers (rows padded to %d)",
                MIN_GEMM_ROWS)


class MosaicCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """SGLang on CPU through the out-of-tree platform path (torch-native ops everywhere)."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"

    def get_device(self, device_id: int = 0) -> str:
        # ServerArgs resolves an unset --device through this and then calls .split(":") on it.
        return "cpu"

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def apply_server_args_defaults(self, server_args) -> None:
        if server_args.attention_backend in (None, "intel_amx"):
            server_args.attention_backend = "torch_native"
        for name in ("prefill_attention_backend", "decode_attention_backend"):
            if getattr(server_args, name, None) == "intel_amx":
                setattr(server_args, name, "torch_native")
        server_args.sampling_backend = "pytorch"
        # An idle scheduler polls its sockets in a busy loop (a core at 100% per server): on a
        # CPU that core is what the other servers and their requests compute on. It sleeps on
        # the sockets instead (a request wakes it at once).
        server_args.sleep_on_idle = True
        # SGLang turns graphs off by itself only for torch_native; any other backend (mosaickv)
        # would reach get_graph_runner_cls(), which this platform does not provide.
        server_args.disable_cuda_graph = True
        try:
            from sglang.srt.model_executor.cuda_graph_config import Backend
            server_args.cuda_graph_config.decode.backend = Backend.DISABLED
            server_args.cuda_graph_config.prefill.backend = Backend.DISABLED
        except (ImportError, AttributeError):  # config layout of another SGLang release
            pass
        if (server_args.tp_size or 1) > 1:
            tp_cpu_defaults(server_args, os.environ)

    def init_backend(self) -> None:
        super().init_backend()
        batch_invariant_linears()

    def get_mha_kv_pool_cls(self) -> type:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        return MHATokenToKVPool

    def get_paged_allocator_cls(self) -> type:
        return torch_paged_allocator_cls()
