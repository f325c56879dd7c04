"""SGLang plugin wiring: ``--kv-backend {default,mosaickv}`` and ``--mosaickv-config``.

``register()`` is the ``sglang.srt.plugins`` entry point. SGLang 0.5.17 runs it in the launcher
(before argument parsing), in ``Engine.__init__`` and in every scheduler process, then applies
the hooks below (``HOOKS``; a failing hook is only *logged* by SGLang, so
``tests/test_plugin_hooks.py`` checks that every target resolves). Caveat: SGLang skips the
general plugins of every distribution that ships a platform plugin other than the one named by
``SGLANG_PLATFORM``; this distribution ships ``mosaickv_cpu``, so ``SGLANG_PLATFORM=<another
platform>`` also drops ``--kv-backend``. Leave SGLANG_PLATFORM unset (or ``mosaickv_cpu``).

CLI::

    python -m sglang.launch_server --model-path M --kv-backend mosaickv \
        --mosaickv-config '{"hot_tokens": 128}'        # or --mosaickv-config @mosaic.json

``--kv-backend mosaickv`` is translated into ``--attention-backend mosaickv`` and
``--radix-cache-backend mosaickv`` and the validated :class:`MosaicConfig` rides to the
scheduler processes on ``ServerArgs._mosaickv_config`` (``ServerArgs`` is a plain dataclass:
the extra attribute survives the pickling of the spawned processes). Combinations MosaicKV
cannot honour are refused at startup with an error naming the flag or the model attribute.

Programmatic (``sglang.Engine(**kwargs)`` rejects unknown kwargs)::

    from mosaickv_sglang.integration.plugin import Engine, server_args
    engine = Engine(model_path=M, mosaickv_config={"hot_tokens": 128})     # kv_backend="mosaickv"
    # or: sglang.Engine(server_args=server_args(model_path=M, mosaickv_config=...))
"""
from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from . import wiring
from ..config import MosaicConfig, check_fits

logger = logging.getLogger(__name__)

KV_BACKEND_CHOICES = ("default", "mosaickv")
ATTENTION_BACKEND = "mosaickv"  # name under sglang's register_attention_backend
RADIX_CACHE_BACKEND = "mosaickv"  # name under sglang's register_radix_cache_backend
CONFIG_ATTR = wiring.CONFIG_ATTR  # on ServerArgs: the MosaicConfig, or None (dense)
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16")

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"


class MosaicKVUnsupported(ValueError):
    """A server configuration that MosaicKV refuses to run (rather than run it wrong or dense)."""


# --------------------------------------------------------------------------- public helpers

def get_config(server_args) -> MosaicConfig | None:
    """The MosaicConfig a server runs with (None: the dense default KV cache)."""
    return getattr(server_args, CONFIG_ATTR, None)


def backend_available() -> bool:
    """Both the attention backend and the radix-cache backend are registered in SGLang."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    return (ATTENTION_BACKEND in ATTENTION_BACKENDS
            and get_radix_cache_factory(RADIX_CACHE_BACKEND) is not None)


def server_args(kv_backend: str = "mosaickv", mosaickv_config: Any = None, **kwargs):
    """A validated ``sglang.srt.server_args.ServerArgs`` for ``sglang.Engine(server_args=...)``.

    ``mosaickv_config``: MosaicConfig, dict, JSON text or ``@file`` (None: defaults). The other
    kwargs are ServerArgs fields. Raises MosaicKVUnsupported / ValueError on refusal.
    """
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # what the launcher does first; it registers this plugin's hooks and backends
    if kv_backend not in KV_BACKEND_CHOICES:
        raise ValueError(f"kv_backend={kv_backend!r}; choose one of {KV_BACKEND_CHOICES}")
    config = _coerce_config(mosaickv_config)
    if kv_backend == "mosaickv":
        fields = argparse.Namespace(**{**_server_args_defaults(), **kwargs})
        _prepare(fields)
        config = resolve_config(kwargs, config)
        _apply_backend_args(kwargs, config)
    args = ServerArgs(**kwargs)
    return _attach(args, kv_backend, config)


def Engine(kv_backend: str = "mosaickv", mosaickv_config: Any = None, **kwargs):  # noqa: N802
    """``sglang.Engine`` with ``kv_backend`` / ``mosaickv_config`` understood (see server_args)."""
    from sglang.srt.entrypoints.engine import Engine as SGLangEngine  # sglang.Engine is lazy

    kwargs.setdefault("log_level", "error")  # what sglang.Engine(**kwargs) defaults to
    return SGLangEngine(server_args=server_args(kv_backend, mosaickv_config, **kwargs))


# --------------------------------------------------------------------------- hooks

def _add_cli_args(result, parser: argparse.ArgumentParser):
    """AFTER ServerArgs.add_cli_args(parser)."""
    if "--kv-backend" in parser._option_string_actions:
        return None
    group = parser.add_argument_group("MosaicKV")
    group.add_argument("--kv-backend", choices=KV_BACKEND_CHOICES, default="default",
                       help="KV cache: 'default' (SGLang's dense cache) or 'mosaickv' "
                            "(compressed; sets the attention and radix-cache backends).")
    group.add_argument("--mosaickv-config", type=_config_arg, default=None, metavar="JSON|@FILE",
                       help="MosaicKV configuration (JSON object or @path.json); only with "
                            "--kv-backend mosaickv. Unknown keys are rejected.")
    return None


def _from_cli_args(original, cls, args: argparse.Namespace):
    """AROUND ServerArgs.from_cli_args(args): translate --kv-backend before resolution."""
    kv_backend = getattr(args, "kv_backend", "default")
    config = getattr(args, "mosaickv_config", None)
    if kv_backend == "mosaickv":
        try:
            _prepare(args)
            config = resolve_config(args, config)
            _apply_backend_args(args, config)
        except MosaicKVUnsupported as exc:
            raise SystemExit(f"error: {exc}") from None
    elif config is not None:
        logger.warning("--mosaickv-config is ignored without --kv-backend mosaickv")
    return _attach(original(cls, args), kv_backend, config)


def _arg(args, key: str):
    """One of SGLang's arguments, from a Namespace or a dict of ServerArgs fields (None: unset)."""
    return args.get(key) if isinstance(args, dict) else getattr(args, key, None)


def resolve_config(args, config: MosaicConfig | None) -> MosaicConfig:
    """The config a server runs with, its `auto` choices made from the server's arguments (a
    Namespace or a dict), the same on every TP rank: `decode_cuda_graph: auto` is "full" on CUDA
    with the Triton decode path, else "off". Auto falls back to "off" (logged) when the full
    graph's own requirement fails (graph_hot_tokens below hot_tokens + 2 segments)."""
    import dataclasses

    import torch

    config = config or MosaicConfig()
    if config.decode_cuda_graph != "auto":
        return config
    device = _arg(args, "device") or ("cuda" if torch.cuda.is_available() else "cpu")
    mode = "full" if device == "cuda" and config.decode_kernel in ("auto", "triton") else "off"
    try:
        return dataclasses.replace(config, decode_cuda_graph=mode)
    except ValueError as exc:
        logger.warning("MosaicKV: decode_cuda_graph 'auto' runs decode eagerly ('off'): %s", exc)
        return dataclasses.replace(config, decode_cuda_graph="off")


def _apply_backend_args(args, config: MosaicConfig) -> None:
    """What --kv-backend mosaickv implies for SGLang's own arguments (a Namespace or a dict)."""
    page = _arg(args, "page_size")
    if page not in (None, 1, config.segment_tokens):
        raise MosaicKVUnsupported(f"--page-size {page}: MosaicKV pages are segments, so the page "
                                  f"size is segment_tokens={config.segment_tokens}")
    values = {"attention_backend": ATTENTION_BACKEND, "radix_cache_backend": RADIX_CACHE_BACKEND,
              "page_size": config.segment_tokens}
    if config.decode_cuda_graph in ("breakable", "full"):
        # breakable: the model's layers replayed, MosaicKV attention eager between the graph
        # segments; full: the whole decode step replayed, MosaicKV attention included
        values.update(cuda_graph_backend_decode=config.decode_cuda_graph,
                      cuda_graph_backend_prefill="disabled")
    else:  # the packed decode step itself is not capturable (docs/cuda_graphs.md)
        values["disable_cuda_graph"] = True
    for key, value in values.items():
        if isinstance(args, dict):
            args[key] = value
        else:
            setattr(args, key, value)


def _check_server_args(result, self):
    """AFTER ServerArgs.check_server_args(): the resolved configuration, every entry path."""
    uses = {self.attention_backend == ATTENTION_BACKEND,
            getattr(self, "radix_cache_backend", None) == RADIX_CACHE_BACKEND,
            get_config(self) is not None}
    if uses == {False}:
        return None
    if uses != {True}:
        raise MosaicKVUnsupported(
            f"MosaicKV is half-configured (attention_backend={self.attention_backend!r}, "
            f"radix_cache_backend={self.radix_cache_backend!r}, config "
            f"{'set' if get_config(self) else 'missing'}): use --kv-backend mosaickv, or "
            f"mosaickv_sglang.integration.plugin.server_args()/Engine() from Python")
    _refuse_flags(self)
    _refuse_cuda_graphs(self, get_config(self))
    model_config = self.get_model_config()
    _refuse_model(model_config.hf_config, self.tp_size, model_config=model_config)
    try:
        check_fits(get_config(self), model_config.head_dim)
    except ValueError as exc:
        raise MosaicKVUnsupported(str(exc)) from None
    _require_backend()
    return None


HOOKS: dict[str, tuple[Any, HookType]] = {
    f"{_SERVER_ARGS}.add_cli_args": (_add_cli_args, HookType.AFTER),
    f"{_SERVER_ARGS}.from_cli_args": (_from_cli_args, HookType.AROUND),
    f"{_SERVER_ARGS}.check_server_args": (_check_server_args, HookType.AFTER),
    **wiring.HOOKS,  # pool, allocator, backend and stats seams
}


def register() -> None:
    """``sglang.srt.plugins`` entry point (zero arguments; runs in every SGLang process)."""
    for target, (hook, hook_type) in HOOKS.items():
        HookRegistry.register(target, hook, hook_type)
    wiring.register_backends()


# --------------------------------------------------------------------------- validation

def _config_arg(text: str) -> MosaicConfig:
    try:
        return MosaicConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _coerce_config(value: Any) -> MosaicConfig:
    if value is None:
        return MosaicConfig()
    if isinstance(value, MosaicConfig):
        return value
    if isinstance(value, dict):
        return MosaicConfig.from_dict(value)
    if isinstance(value, str):
        return MosaicConfig.parse(value)
    raise TypeError(f"mosaickv_config must be a MosaicConfig, dict, JSON text or @file, "
                    f"got {type(value).__name__}")


def _attach(args, kv_backend: str, config: MosaicConfig | None):
    """The resolved ServerArgs gets its MosaicConfig (CLI and programmatic paths alike), after
    the checks that need SGLang's resolution (the CUDA graph backends)."""
    config = (config or MosaicConfig()) if kv_backend == "mosaickv" else None
    if config is not None:
        _refuse_cuda_graphs(args, config)
    setattr(args, CONFIG_ATTR, config)
    return args


def _server_args_defaults() -> dict:
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    return {f.name: f.default for f in dataclasses.fields(ServerArgs)
            if f.default is not dataclasses.MISSING}


def _prepare(args) -> None:
    """Refusals that can be decided before SGLang resolves its arguments (fast, clean errors)."""
    _refuse_flags(args)
    hf_config = _load_hf_config(args)
    if hf_config is not None:
        _refuse_model(hf_config, getattr(args, "tp_size", 1) or 1)
    _require_backend()


def _require_backend() -> None:
    if not backend_available():
        raise MosaicKVUnsupported(
            "--kv-backend mosaickv: the MosaicKV backend is not available in this build "
            f"(no attention backend {ATTENTION_BACKEND!r} and radix-cache backend "
            f"{RADIX_CACHE_BACKEND!r} registered in SGLang). Use --kv-backend default.")


def _refuse_flags(args) -> None:
    """Server flags MosaicKV cannot honour: args is an argparse Namespace (before SGLang
    resolves it) or the resolved ServerArgs (model defaults may have switched features on)."""
    def get(name, default=None):
        return getattr(args, name, default)

    why = []
    if get("speculative_algorithm"):
        why.append(f"speculative decoding (--speculative-algorithm {get('speculative_algorithm')})")
    if get("enable_hierarchical_cache"):
        why.append("HiCache (--enable-hierarchical-cache)")
    if get("enable_hisparse"):
        why.append("HiSparse (--enable-hisparse)")
    if get("enable_lmcache"):
        why.append("LMCache (--enable-lmcache)")
    if get("disaggregation_mode", "null") not in (None, "null"):
        why.append(f"PD disaggregation (--disaggregation-mode {get('disaggregation_mode')})")
    if get("enable_pdmux"):
        why.append("PD multiplexing (--enable-pdmux)")
    if get("enable_dp_attention"):
        why.append("DP attention (--enable-dp-attention)")
    if (get("dcp_size", 1) or 1) > 1 or (get("attn_cp_size", 1) or 1) > 1:
        why.append("context parallelism (--dcp-size / --attn-cp-size > 1)")
    if get("kv_cache_dtype", "auto") not in SUPPORTED_KV_CACHE_DTYPES:
        why.append(f"--kv-cache-dtype {get('kv_cache_dtype')} (MosaicKV stores its own "
                   f"compressed format from bf16: use auto or bf16)")
    for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                 "radix_cache_backend"):
        value = get(flag)
        if value is not None and value != ATTENTION_BACKEND:
            why.append(f"--{flag.replace('_', '-')} {value} (--kv-backend mosaickv sets the "
                       f"attention and radix-cache backends itself)")
    if why:
        raise MosaicKVUnsupported("--kv-backend mosaickv cannot run with " + "; ".join(why))


def _refuse_cuda_graphs(server_args, config: MosaicConfig) -> None:
    """The resolved CUDA graph backends must be what `decode_cuda_graph` allows: a flag or JSON
    that asks for more (they outrank --disable-cuda-graph) would capture MosaicKV's host-planned
    attention into a graph. "disabled" is always fine (e.g. the CPU platform turns graphs off)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    graphs = getattr(server_args, "cuda_graph_config", None)
    if graphs is None:
        return
    decode, prefill = graphs.decode.backend, graphs.prefill.backend
    allowed = {Backend.DISABLED} | {"breakable": {Backend.BREAKABLE},
                                    "full": {Backend.FULL}}.get(config.decode_cuda_graph, set())
    why = []
    if decode not in allowed:
        why.append(f"a '{decode}' decode CUDA graph (MosaicKV allows "
                   f"{sorted(allowed)} with decode_cuda_graph={config.decode_cuda_graph!r})")
    if prefill != Backend.DISABLED:
        why.append(f"a '{prefill}' prefill CUDA graph (MosaicKV prefill runs eagerly)")
    if decode == Backend.BREAKABLE and getattr(server_args, "debug_cuda_graph", False):
        why.append("--debug-cuda-graph with the breakable decode graph")
    if why:
        raise MosaicKVUnsupported("--kv-backend mosaickv cannot run with " + "; ".join(why))


def _load_hf_config(args):
    """The model's HF config through SGLang's own loader, or None (the resolved check retries)."""
    model_path = getattr(args, "model_path", None)
    if not model_path or str(model_path).lower() in ("none", "dummy"):
        return None
    try:
        from sglang.srt.utils.hf_transformers.config import get_config

        overrides = json.loads(getattr(args, "json_model_override_args", None) or "{}")
        return get_config(model_path,
                          trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
                          revision=getattr(args, "revision", None),
                          model_override_args=overrides or None)
    except Exception as exc:  # noqa: BLE001 - decided again on the resolved ModelConfig
        logger.info("mosaickv: model config not readable before startup (%s); checked later", exc)
        return None


# hf text-config attributes that mean "not plain full multi-head attention on every layer"
_HYBRID_ATTRS = ("layers_block_type", "hybrid_override_pattern", "layer_block_types",
                 "attn_type_list", "full_attention_interval", "linear_attn_config",
                 "attention_chunk_size", "interleaved_sliding_window", "sliding_window_pattern")


def model_refusal(hf_config, tp_size: int = 1) -> str | None:
    """Why a model's attention is not something MosaicKV can compress (None: plain MHA/GQA)."""
    from sglang.srt.configs.model_config import is_hybrid_swa_model
    from sglang.srt.utils.hf_transformers.common import get_hf_text_config

    text = get_hf_text_config(hf_config)
    archs = list(getattr(hf_config, "architectures", None) or [])
    if getattr(text, "kv_lora_rank", None):
        return f"MLA attention (kv_lora_rank={text.kv_lora_rank})"
    if getattr(text, "index_topk", None):
        return f"DSA sparse attention (index_topk={text.index_topk})"
    layer_types = getattr(text, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        return f"hybrid layers (layer_types contains {other})"
    window = getattr(text, "sliding_window", None)
    max_pos = getattr(text, "max_position_embeddings", None)
    if window and getattr(text, "use_sliding_window", True) is not False and not (
            max_pos and window >= max_pos):
        return f"sliding-window attention (sliding_window={window})"
    for attr in _HYBRID_ATTRS:
        if getattr(text, attr, None):
            return f"hybrid / local / linear attention ({attr}={getattr(text, attr)!r})"
    if archs and is_hybrid_swa_model(archs, text):
        return f"hybrid sliding-window architecture {archs[0]}"
    kv_heads = (getattr(text, "num_key_value_heads", None)
                or getattr(text, "num_attention_heads", None))
    if kv_heads and tp_size > 1 and kv_heads % tp_size:
        return (f"{kv_heads} KV heads do not split over --tp-size {tp_size} "
                f"(use a tensor-parallel size that divides {kv_heads})")
    return None


def _refuse_model(hf_config, tp_size: int, model_config=None) -> None:
    why = model_refusal(hf_config, tp_size)
    if why is None and model_config is not None:
        from sglang.srt.configs.hybrid_arch import mambaish_config
        from sglang.srt.configs.model_config import AttentionArch

        if model_config.attention_arch != AttentionArch.MHA:
            why = f"attention architecture {model_config.attention_arch.name}"
        elif getattr(model_config, "is_hybrid_swa", False):
            why = "hybrid sliding-window attention"
        elif mambaish_config(model_config) is not None:
            why = "hybrid linear-attention / state-space layers"
    if why:
        raise MosaicKVUnsupported(f"--kv-backend mosaickv supports models with plain multi-head "
                                  f"(MHA/GQA) attention only; this model has {why}")
