"""The SGLang plugin and CPU platform against the pinned SGLang (0.5.17).

SGLang only *logs* a plugin whose hook target does not resolve, so a renamed seam would silently
turn the plugin off: every target is resolved here. The CLI tests run the real launcher in a
subprocess (about 8 s each on 2 cores: SGLang's import time).
"""
import argparse
import os
import pickle
import pkgutil
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from mosaickv_sglang.integration import platform_cpu, plugin
from mosaickv_sglang.config import MosaicConfig

LAUNCH = [sys.executable, "-m", "sglang.launch_server"]


def _env():
    env = dict(os.environ)
    env.pop("MOSAICKV_CPU_PLATFORM", None)
    env.pop("SGLANG_PLUGINS", None)
    return env


# --------------------------------------------------------------------------- seams

_BCG = "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend." \
    "BreakableCudaGraphBackend"
# The seams MosaicKV hooks in SGLang 0.5.17, written out here rather than read from
# plugin.HOOKS: target -> (hook type, the hook's dotted name). A hook added, dropped, retyped or
# moved to another seam must be changed here too.
EXPECTED_HOOKS = {
    "sglang.srt.server_args.ServerArgs.add_cli_args":
        ("AFTER", "mosaickv_sglang.integration.plugin._add_cli_args"),
    "sglang.srt.server_args.ServerArgs.from_cli_args":
        ("AROUND", "mosaickv_sglang.integration.plugin._from_cli_args"),
    "sglang.srt.server_args.ServerArgs.check_server_args":
        ("AFTER", "mosaickv_sglang.integration.plugin._check_server_args"),
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size":
        ("AFTER", "mosaickv_sglang.integration.wiring._compute_cell_size"),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool":
        ("AROUND", "mosaickv_sglang.integration.wiring._build_token_to_kv_pool"),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure":
        ("AFTER", "mosaickv_sglang.integration.wiring._cap_running_requests"),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids":
        ("AROUND", "mosaickv_sglang.integration.wiring._release_page_ids"),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.clear":
        ("AFTER", "mosaickv_sglang.integration.wiring._allocator_clear"),
    "sglang.srt.models.utils.enable_fused_set_kv_buffer":
        ("AROUND", "mosaickv_sglang.integration.wiring._fused_set_kv_buffer"),
    "sglang.srt.utils.common.support_triton":
        ("AROUND", "mosaickv_sglang.integration.wiring._support_triton"),
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state":
        ("AFTER", "mosaickv_sglang.integration.wiring._internal_state"),
    "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run":
        ("BEFORE", "mosaickv_sglang.integration.wiring._step_boundary"),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend":
        ("AFTER", "mosaickv_sglang.integration.wiring._record_prompt_lens"),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.available_size":
        ("AROUND", "mosaickv_sglang.integration.wiring._available_size"),
    "sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info":
        ("AFTER", "mosaickv_sglang.integration.wiring._worker_info"),
    "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver."
    "_get_token_info": ("AFTER", "mosaickv_sglang.integration.wiring._token_info"),
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner."
    "can_run_graph": ("AROUND", "mosaickv_sglang.integration.wiring._decode_graph_can_run"),
    f"{_BCG}._alloc_full_buffer": ("AROUND", "mosaickv_sglang.integration.wiring._graph_per_field"),
    f"{_BCG}._slice_output": ("AROUND", "mosaickv_sglang.integration.wiring._graph_per_field"),
    f"{_BCG}._copy_output_to_buffer": ("AROUND", "mosaickv_sglang.integration.wiring._graph_copy"),
}


def test_the_pinned_sglang_is_installed():
    from importlib.metadata import version

    assert version("sglang") == "0.5.17"  # the seams below are this release's


@pytest.mark.parametrize("target", sorted(EXPECTED_HOOKS))
def test_hook_target_resolves(target):
    assert callable(pkgutil.resolve_name(target)), target


def test_register_registers_exactly_the_expected_hooks(monkeypatch):
    seen = []
    monkeypatch.setattr(plugin.HookRegistry, "register",
                        lambda target, hook, hook_type: seen.append((target, hook, hook_type)))
    plugin.register()
    got = [(target, hook_type.name, f"{hook.__module__}.{hook.__qualname__}")
           for target, hook, hook_type in seen]
    assert len(got) == len(set(t for t, _, _ in got)), "a seam hooked twice"
    assert sorted(got) == sorted((t, k, h) for t, (k, h) in EXPECTED_HOOKS.items())
    for _, hook, _ in seen:
        assert pkgutil.resolve_name(f"{hook.__module__}.{hook.__qualname__}") is hook


def test_other_sglang_names_resolve():
    # registries read by the availability check; helpers of the refusals and the platform
    for target in ("sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS",
                   "sglang.srt.layers.attention.attention_registry.register_attention_backend",
                   "sglang.srt.mem_cache.registry.get_radix_cache_factory",
                   "sglang.srt.configs.hybrid_arch.mambaish_config",
                   "sglang.srt.model_executor.cuda_graph_config.Backend.DISABLED",
                   "sglang.srt.configs.model_config.is_hybrid_swa_model",
                   "sglang.srt.utils.hf_transformers.config.get_config",
                   "sglang.srt.utils.hf_transformers.common.get_hf_text_config",
                   # used inside the pool / backend / radix / sizing hooks
                   "sglang.srt.model_executor.forward_context.get_token_to_kv_pool",
                   "sglang.srt.runtime_context.get_parallel",
                   "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
                   "sglang.srt.mem_cache.memory_pool.unwrap_write_loc",
                   "sglang.srt.mem_cache.radix_cache.RadixCache",
                   "sglang.srt.mem_cache.registry.register_radix_cache_backend",
                   "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend",
                   # the breakable decode graph (backend.py, wiring.py)
                   "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph."
                   "eager_on_graph",
                   "sglang.srt.layers.logits_processor.LogitsProcessorOutput",
                   "sglang.srt.model_executor.cuda_graph_config.Backend.BREAKABLE"):
        pkgutil.resolve_name(target)


def test_match_cap_seam_is_sglangs():
    """MosaicRadixCache.match_prefix caps a request's match with RadixKey's `limit` (the
    position rule's window is prefilled by each request itself): SGLang's key must keep it and
    the scheduler's match must pass the request."""
    import dataclasses
    import inspect

    from sglang.srt.managers import schedule_batch
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    assert "limit" in RadixKey.__slots__
    assert RadixKey([1, 2, 3, 4], limit=2)._raw_len() == 2
    assert "req" in {f.name for f in dataclasses.fields(MatchPrefixParams)}
    assert "req=self" in inspect.getsource(schedule_batch.Req.init_next_round_input)


def test_platform_overrides_real_seams():
    from sglang.srt.platforms.interface import SRTPlatform

    for name in ("get_mha_kv_pool_cls", "get_paged_allocator_cls", "apply_server_args_defaults",
                 "get_default_attention_backend", "get_dispatch_key_name", "get_device",
                 "is_pin_memory_available"):
        assert hasattr(SRTPlatform, name), name
        assert name in vars(platform_cpu.MosaicCpuPlatform), name
    cls = pkgutil.resolve_name(platform_cpu.PLATFORM_CLASS)
    p = cls()
    assert issubclass(cls, SRTPlatform) and p.is_out_of_tree() and not p.is_cpu()
    assert p.get_dispatch_key_name() == "native"
    assert p.get_default_attention_backend() == "torch_native"
    assert not p.is_pin_memory_available()
    assert p.get_device() == "cpu"
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    assert issubclass(p.get_paged_allocator_cls(), PagedTokenToKVPoolAllocator)
    assert p.get_mha_kv_pool_cls() is MHATokenToKVPool


def test_entry_points_discoverable():
    plugins = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    platforms = {ep.name: ep for ep in entry_points(group="sglang.srt.platforms")}
    assert plugins["mosaickv"].value == "mosaickv_sglang.integration.plugin:register"
    assert platforms["mosaickv_cpu"].value == "mosaickv_sglang.integration.platform_cpu:activate"
    assert plugins["mosaickv"].load() is plugin.register
    assert platforms["mosaickv_cpu"].load() is platform_cpu.activate


# --------------------------------------------------------------------------- platform

def test_platform_opt_in(monkeypatch):
    monkeypatch.delenv(platform_cpu.ENV_OPT_IN, raising=False)
    assert platform_cpu.activate() is None
    monkeypatch.setenv(platform_cpu.ENV_OPT_IN, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform_cpu.activate() == platform_cpu.PLATFORM_CLASS
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform_cpu.activate() is None  # refuses on a CUDA host


def test_platform_server_args_defaults():
    args = SimpleNamespace(tp_size=1, attention_backend="intel_amx", prefill_attention_backend=None,
                           decode_attention_backend="intel_amx", sampling_backend="flashinfer",
                           disable_cuda_graph=False, cuda_graph_config=SimpleNamespace(
                               decode=SimpleNamespace(backend="full"),
                               prefill=SimpleNamespace(backend="full")))
    platform_cpu.MosaicCpuPlatform().apply_server_args_defaults(args)
    assert args.sleep_on_idle  # an idle scheduler does not spin a core
    assert args.attention_backend == args.decode_attention_backend == "torch_native"
    assert args.sampling_backend == "pytorch" and args.disable_cuda_graph
    assert str(args.cuda_graph_config.decode.backend).endswith("disabled")


def test_platform_tp_defaults_split_cores_and_keep_explicit_settings(monkeypatch):
    monkeypatch.setattr(platform_cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    args, env = SimpleNamespace(tp_size=2, disable_custom_all_reduce=False), {}
    platform_cpu.tp_cpu_defaults(args, env)
    assert args.disable_custom_all_reduce
    assert env == {"SGLANG_NCCL_SO_PATH": platform_cpu.NO_NCCL,
                   "SGLANG_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    env = {"SGLANG_NCCL_SO_PATH": "/opt/nccl.so", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    platform_cpu.tp_cpu_defaults(args, env)
    assert env == {"SGLANG_NCCL_SO_PATH": "/opt/nccl.so", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    with pytest.raises(ValueError, match="needs a core per rank"):
        platform_cpu.tp_cpu_defaults(SimpleNamespace(tp_size=8), {})


def test_torch_paged_allocator_matches_sglang_reference():
    """extend_slots == SGLang's own pure-torch reference of alloc_extend_kernel; decode_slots
    == the kernel's rule (last_loc + 1, or the next fresh page when a page starts)."""
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        ps = int(torch.randint(1, 9, (1,), generator=g))
        bs = int(torch.randint(1, 6, (1,), generator=g))
        free = torch.randperm(400, generator=g) + 1
        pre = torch.randint(0, 30, (bs,), generator=g)
        seq = pre + torch.randint(1, 30, (bs,), generator=g)
        page_of_last = torch.randint(1000, 2000, (bs,), generator=g)
        last = torch.where(pre > 0, page_of_last * ps + (pre - 1) % ps, torch.full_like(pre, -1))
        n_new = int(((seq + ps - 1) // ps - (pre + ps - 1) // ps).sum())
        ref = torch.empty(int((seq - pre).sum()), dtype=torch.int64)
        alloc_extend_naive(pre, seq, last, free.clone(), ref, ps, "cpu")
        assert torch.equal(platform_cpu.extend_slots(pre, seq, last, free[:n_new], ps), ref)

        dseq = torch.randint(1, 40, (bs,), generator=g)
        dlast = page_of_last * ps + (dseq - 2) % ps
        needs = (dseq - 1) % ps == 0
        expect, k = [], 0
        for i in range(bs):
            expect.append(int(free[k]) * ps if needs[i] else int(dlast[i]) + 1)
            k += int(needs[i])
        got = platform_cpu.decode_slots(dseq, dlast.clone(), free[:k], ps)
        assert got.tolist() == expect


def test_torch_paged_allocator_bookkeeping():
    cls = platform_cpu.torch_paged_allocator_cls()
    a = cls(64, page_size=4, dtype=torch.float32, device="cpu", kvcache=None, need_sort=False)
    free0 = len(a.free_pages)
    out = a.alloc_extend(torch.tensor([0, 0]), torch.tensor([0, 0]), torch.tensor([5, 3]),
                         torch.tensor([5, 3]), torch.tensor([-1, -1]), extend_num_tokens=8)
    assert out.numel() == 8 and len(set(out.tolist())) == 8
    assert len(a.free_pages) == free0 - 3  # 2 pages + 1 page
    dec = a.alloc_decode(torch.tensor([6, 4]), torch.tensor([6, 4]), torch.stack([out[4], out[7]]))
    assert dec.tolist() == [int(out[4]) + 1, int(out[7]) + 1]
    assert a.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([400]),
                          torch.tensor([400]), torch.tensor([-1]), extend_num_tokens=400) is None


# --------------------------------------------------------------------------- plugin logic

def test_config_arg_parses_and_names_bad_key(tmp_path):
    assert plugin._config_arg('{"hot_tokens": 128}').hot_tokens == 128
    f = tmp_path / "m.json"
    f.write_text('{"select": {"budget_tokens": 2048}}')
    assert plugin._config_arg(f"@{f}").select.budget_tokens == 2048
    with pytest.raises(argparse.ArgumentTypeError, match="nope"):
        plugin._config_arg('{"nope": 1}')
    with pytest.raises(argparse.ArgumentTypeError, match="select.nope"):
        plugin._config_arg('{"select": {"nope": 1}}')


def _ns(**kw):
    base = dict(speculative_algorithm=None, enable_hierarchical_cache=False, enable_hisparse=False,
                enable_lmcache=False, disaggregation_mode="null", enable_pdmux=False,
                enable_dp_attention=False, dcp_size=1, attn_cp_size=1, kv_cache_dtype="auto",
                attention_backend=None, prefill_attention_backend=None,
                decode_attention_backend=None, radix_cache_backend=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, needle", [
    (dict(speculative_algorithm="EAGLE"), "speculative decoding"),
    (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(disaggregation_mode="prefill"), "PD disaggregation"),
    (dict(enable_dp_attention=True), "--enable-dp-attention"),
    (dict(kv_cache_dtype="fp8_e4m3"), "--kv-cache-dtype fp8_e4m3"),
    (dict(attention_backend="triton"), "--attention-backend triton"),
    (dict(radix_cache_backend="other"), "--radix-cache-backend other"),
    (dict(dcp_size=2), "context parallelism"),
])
def test_flag_refusals(kw, needle):
    with pytest.raises(plugin.MosaicKVUnsupported, match=needle):
        plugin._refuse_flags(_ns(**kw))


def test_flags_accepted():
    plugin._refuse_flags(_ns())
    plugin._refuse_flags(_ns(kv_cache_dtype="bf16", attention_backend="mosaickv",
                             radix_cache_backend="mosaickv"))


def test_model_refusals():
    from transformers import (DeepseekV3Config, Gemma2Config, LlamaConfig, MistralConfig,
                              Qwen2Config, Qwen3NextConfig)

    assert plugin.model_refusal(LlamaConfig()) is None
    assert plugin.model_refusal(Qwen2Config()) is None  # sliding window configured but off
    assert "MLA" in plugin.model_refusal(DeepseekV3Config())
    assert "sliding_attention" in plugin.model_refusal(Gemma2Config())
    assert "linear_attention" in plugin.model_refusal(Qwen3NextConfig())
    assert "sliding_window=4096" in plugin.model_refusal(MistralConfig(sliding_window=4096))
    assert plugin.model_refusal(MistralConfig(sliding_window=None)) is None
    gqa = LlamaConfig(hidden_size=384, num_attention_heads=6, num_key_value_heads=3)
    assert plugin.model_refusal(gqa, tp_size=3) is None
    assert "3 KV heads do not split over --tp-size 2" in plugin.model_refusal(gqa, tp_size=2)


def test_resolved_check_refuses_half_configuration():
    dense = SimpleNamespace(attention_backend="torch_native", radix_cache_backend=None)
    assert plugin._check_server_args(None, dense) is None
    half = SimpleNamespace(attention_backend="mosaickv", radix_cache_backend=None)
    with pytest.raises(plugin.MosaicKVUnsupported, match="half-configured"):
        plugin._check_server_args(None, half)


def test_config_survives_pickling():
    """ServerArgs reaches the scheduler processes pickled (mp spawn): the attribute survives."""
    from sglang.srt.server_args import ServerArgs

    args = plugin._attach(ServerArgs(model_path="dummy"), "mosaickv", MosaicConfig(hot_tokens=96))
    back = pickle.loads(pickle.dumps(args))
    assert plugin.get_config(back) == MosaicConfig(hot_tokens=96)
    dense = plugin._attach(ServerArgs(model_path="dummy"), "default", None)
    assert plugin.get_config(pickle.loads(pickle.dumps(dense))) is None


def test_programmatic_server_args(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    args = plugin.server_args(model_path=str(tmp_path), mosaickv_config={"hot_tokens": 32},
                              device="cpu")
    assert plugin.backend_available()  # server_args loads the plugins, which register them
    assert (args.attention_backend, args.radix_cache_backend) == ("mosaickv", "mosaickv")
    assert args.page_size == MosaicConfig().segment_tokens and args.disable_cuda_graph
    assert getattr(args, plugin.CONFIG_ATTR).hot_tokens == 32
    with pytest.raises(plugin.MosaicKVUnsupported, match="speculative"):
        plugin.server_args(model_path=str(tmp_path), speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="nope"):
        plugin.server_args(model_path=str(tmp_path), mosaickv_config={"nope": 1})


# --------------------------------------------------------------------------- CLI (subprocess)

def test_cli_help_shows_flags():
    proc = subprocess.run(LAUNCH + ["--help"], capture_output=True, text=True, timeout=180,
                          env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--kv-backend {default,mosaickv}" in proc.stdout
    assert "--mosaickv-config" in proc.stdout


def test_cli_bad_config_fails_before_loading():
    # a model path that does not exist: the only way to get this error is argument parsing
    argv = ["--model-path", "/nonexistent/model", "--kv-backend", "mosaickv",
            "--mosaickv-config", '{"nope":1}']
    proc = subprocess.run(LAUNCH + argv, capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode != 0
    assert "argument --mosaickv-config" in proc.stderr, proc.stderr[-2000:]
    assert "unknown key 'nope'" in proc.stderr
    assert "Load weight" not in proc.stdout + proc.stderr


def _graphs(decode, prefill="disabled", debug=False):
    return SimpleNamespace(cuda_graph_config=SimpleNamespace(
        decode=SimpleNamespace(backend=decode), prefill=SimpleNamespace(backend=prefill)),
        debug_cuda_graph=debug)


def test_cuda_graph_backends_follow_decode_cuda_graph():
    """decode_cuda_graph 'off' turns graphs off and refuses any flag that turns a decode graph
    back on; 'breakable' asks SGLang for the breakable decode graph and no prefill graph, and
    refuses full/tc_piecewise decode, any prefill graph and --debug-cuda-graph. 'disabled' (the
    CPU platform's choice) is accepted in both modes."""
    off, brk = MosaicConfig(decode_cuda_graph="off"), MosaicConfig(decode_cuda_graph="breakable")
    args = {}
    plugin._apply_backend_args(args, off)
    assert args["disable_cuda_graph"] is True and "cuda_graph_backend_decode" not in args
    args = {}
    plugin._apply_backend_args(args, brk)
    assert "disable_cuda_graph" not in args
    assert (args["cuda_graph_backend_decode"], args["cuda_graph_backend_prefill"]) == \
        ("breakable", "disabled")
    for config in (off, brk):
        plugin._refuse_cuda_graphs(_graphs("disabled"), config)
    plugin._refuse_cuda_graphs(_graphs("breakable"), brk)
    refused = [(off, _graphs("full"), "'full' decode"), (off, _graphs("breakable"), "'breakable'"),
               (brk, _graphs("full"), "'full' decode"), (brk, _graphs("tc_piecewise"), "'tc_piecewise'"),
               (brk, _graphs("breakable", "tc_piecewise"), "prefill"),
               (brk, _graphs("breakable", debug=True), "debug-cuda-graph")]
    for config, server, match in refused:
        with pytest.raises(plugin.MosaicKVUnsupported, match=match):
            plugin._refuse_cuda_graphs(server, config)
    # 'full': SGLang's full decode graph and no prefill graph; any other decode graph refused
    full = MosaicConfig(decode_cuda_graph="full")
    args = {}
    plugin._apply_backend_args(args, full)
    assert "disable_cuda_graph" not in args
    assert (args["cuda_graph_backend_decode"], args["cuda_graph_backend_prefill"]) == \
        ("full", "disabled")
    plugin._refuse_cuda_graphs(_graphs("full"), full)
    plugin._refuse_cuda_graphs(_graphs("disabled"), full)
    for server, match in ((_graphs("breakable"), "'breakable' decode"),
                          (_graphs("full", "full"), "prefill")):
        with pytest.raises(plugin.MosaicKVUnsupported, match=match):
            plugin._refuse_cuda_graphs(server, full)


def test_breakable_config_resolves_through_sglang(tmp_path):
    """Through SGLang's own resolution (and the resolved-args check): decode 'breakable',
    prefill 'disabled' with decode_cuda_graph 'breakable'; decode 'disabled' without it, and an
    explicit --cuda-graph-backend-decode full (which outranks --disable-cuda-graph) refused."""
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    args = plugin.server_args(model_path=str(tmp_path), device="cpu",
                              mosaickv_config={"decode_cuda_graph": "breakable"})
    assert (str(args.cuda_graph_config.decode.backend), str(args.cuda_graph_config.prefill.backend)) \
        == ("breakable", "disabled")
    assert getattr(args, plugin.CONFIG_ATTR).decode_cuda_graph == "breakable"
    args = plugin.server_args(model_path=str(tmp_path), device="cpu",
                              mosaickv_config={"decode_cuda_graph": "full"})
    assert (str(args.cuda_graph_config.decode.backend), str(args.cuda_graph_config.prefill.backend)) \
        == ("full", "disabled")
    args = plugin.server_args(model_path=str(tmp_path), device="cpu")
    assert str(args.cuda_graph_config.decode.backend) == "disabled"
    assert getattr(args, plugin.CONFIG_ATTR).decode_cuda_graph == "off"  # 'auto' on the CPU
    with pytest.raises(plugin.MosaicKVUnsupported, match="'full' decode"):
        plugin.server_args(model_path=str(tmp_path), device="cpu", cuda_graph_backend_decode="full")


def test_auto_decode_cuda_graph_is_full_on_cuda_with_the_triton_path(caplog):
    """decode_cuda_graph 'auto' (the default) is resolved from the server's arguments, the same
    on every rank: 'full' on CUDA with the Triton decode path, 'off' on the CPU or with the
    reference decode; 'off' (logged) when the full graph's own requirement fails."""
    assert MosaicConfig().decode_cuda_graph == "auto"
    assert plugin.resolve_config({"device": "cuda"}, None).decode_cuda_graph == "full"
    assert plugin.resolve_config({"device": "cpu"}, None).decode_cuda_graph == "off"
    ref = MosaicConfig(decode_kernel="reference")
    assert plugin.resolve_config({"device": "cuda"}, ref).decode_cuda_graph == "off"
    explicit = MosaicConfig(decode_cuda_graph="breakable")
    assert plugin.resolve_config({"device": "cuda"}, explicit) is explicit
    big_hot = MosaicConfig(hot_tokens=1024)  # graph_hot_tokens (1024) < 1024 + 2 segments
    with caplog.at_level("WARNING"):
        assert plugin.resolve_config({"device": "cuda"}, big_hot).decode_cuda_graph == "off"
    assert "graph_hot_tokens" in caplog.text
    args = {}
    plugin._apply_backend_args(args, plugin.resolve_config({"device": "cuda"}, None))
    assert args["cuda_graph_backend_decode"] == "full" and "disable_cuda_graph" not in args
