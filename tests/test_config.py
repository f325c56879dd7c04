"""MosaicConfig / SelectionConfig: defaults, parsing (JSON text, @file), rejection of bad input
with the offending key named, and dict round trips."""
from __future__ import annotations

import json
import math

import pytest

from mosaickv_sglang.codec.strategies import parse_strategy
from mosaickv_sglang.config import (check_fits, fit_rescue, DEFAULT_K_CANDIDATES, DEFAULT_SINK_CANDIDATES,
                                    DEFAULT_V_CANDIDATES, MosaicConfig, SelectionConfig)


def test_defaults_validate():
    cfg = MosaicConfig()
    cfg.validate()  # idempotent, no exception
    assert cfg.segment_tokens % cfg.page_tokens == 0
    assert cfg.basis_block_tokens % cfg.segment_tokens == 0
    assert cfg.k_candidates == list(DEFAULT_K_CANDIDATES)
    assert cfg.v_candidates == list(DEFAULT_V_CANDIDATES)
    assert cfg.sink_candidates == list(DEFAULT_SINK_CANDIDATES)
    for spec in (*cfg.k_candidates, *cfg.v_candidates, *cfg.sink_candidates):
        parse_strategy(spec)
    assert isinstance(cfg.select, SelectionConfig) and cfg.select.enabled
    assert cfg.select.budget_tokens >= cfg.page_tokens
    # candidates are independent copies, not the shared module defaults
    other = MosaicConfig()
    other.k_candidates.append("dense")
    assert MosaicConfig().k_candidates == list(DEFAULT_K_CANDIDATES)


@pytest.mark.parametrize("text", [None, ""])
def test_parse_empty_is_defaults(text):
    assert MosaicConfig.parse(text) == MosaicConfig()


def test_parse_json_text_and_file(tmp_path):
    data = {"segment_tokens": 64, "page_tokens": 16, "basis_block_tokens": 256, "hot_tokens": 8,
            "k_candidates": ["topr:r=8,val=int8"], "v_candidates": ["lowbit:bits=2,group=16"],
            "k_error_budget": 0.2, "sink_candidates": [],
            "select": {"budget_tokens": 128, "meta_channels": 4}}
    cfg = MosaicConfig.parse(json.dumps(data))
    assert cfg.segment_tokens == 64 and cfg.page_tokens == 16 and cfg.hot_tokens == 8
    assert cfg.k_candidates == ["topr:r=8,val=int8"] and cfg.sink_candidates == []
    assert cfg.k_error_budget == 0.2 and cfg.v_error_budget == MosaicConfig().v_error_budget
    assert cfg.select == SelectionConfig(budget_tokens=128, meta_channels=4)
    path = tmp_path / "mosaic.json"
    path.write_text(json.dumps(data))
    assert MosaicConfig.parse(f"@{path}") == cfg


def test_parse_missing_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match="nope.json"):
        MosaicConfig.parse(f"@{missing}")


@pytest.mark.parametrize("text,needle", [("{not json", "JSON"), ("[1, 2]", "object"),
                                         ('"text"', "object")])
def test_parse_rejects_non_objects(text, needle):
    with pytest.raises(ValueError, match=needle):
        MosaicConfig.parse(text)


def _rejects(data: dict, needle: str):
    with pytest.raises(ValueError) as info:
        MosaicConfig.from_dict(data)
    assert needle in str(info.value), f"{data}: {str(info.value)!r} lacks {needle!r}"
    with pytest.raises(ValueError) as info:  # same through JSON text
        MosaicConfig.parse(json.dumps(data))
    assert needle in str(info.value)


@pytest.mark.parametrize("data,needle", [
    ({"segment_tokenz": 128}, "segment_tokenz"),
    ({"dense_sink_segments": 1}, "dense_sink_segments"),  # a key from an older version
    ({"select": {"budget": 512}}, "select.budget"),
    ({"select": {"enabled": True, "metachannels": 8}}, "select.metachannels"),
    ({"select": {"rotated": False}}, "select.rotated"),  # removed: pages follow the K strategy
])
def test_unknown_keys_are_named(data, needle):
    _rejects(data, needle)


@pytest.mark.parametrize("data,needle", [
    ({"segment_tokens": "128"}, "segment_tokens"),
    ({"segment_tokens": 128.0}, "segment_tokens"),
    ({"hot_tokens": True}, "hot_tokens"),
    ({"page_tokens": None}, "page_tokens"),
    ({"k_error_budget": "0.1"}, "k_error_budget"),
    ({"v_error_budget": False}, "v_error_budget"),
    ({"hot_buffer_fraction": "0.5"}, "hot_buffer_fraction"),
    ({"k_candidates": "dense"}, "k_candidates"),
    ({"sink_candidates": {"dense": 1}}, "sink_candidates"),
    ({"select": [1, 2]}, "select"),
    ({"select": {"enabled": 1}}, "select.enabled"),
    ({"select": {"budget_tokens": 1024.5}}, "select.budget_tokens"),
])
def test_wrong_types_are_named(data, needle):
    _rejects(data, needle)


@pytest.mark.parametrize("key", ("k_candidates", "v_candidates", "sink_candidates"))
@pytest.mark.parametrize("spec,needle", [("topr:r=0", "r=0"), ("nosuch", "nosuch"),
                                         ("lowbit:bitz=4", "bitz"), ("band:b4=3", "b4"),
                                         ("", "non-empty")])
def test_bad_strategy_specs_are_named(key, spec, needle):
    data = {key: ["dense", spec]}
    with pytest.raises(ValueError) as info:
        MosaicConfig.from_dict(data)
    msg = str(info.value)
    assert f"{key}[1]" in msg and needle in msg, msg


@pytest.mark.parametrize("key", ("k_candidates", "v_candidates"))
def test_empty_candidate_lists_rejected_except_sink(key):
    _rejects({key: []}, key)
    assert MosaicConfig.from_dict({"sink_candidates": []}).sink_candidates == []


@pytest.mark.parametrize("data,needle", [
    ({"segment_tokens": 100, "page_tokens": 32, "basis_block_tokens": 400}, "segment_tokens"),
    ({"segment_tokens": 32, "page_tokens": 64, "select": {"budget_tokens": 64}}, "page_tokens"),
    ({"basis_block_tokens": 1000}, "basis_block_tokens"),
    ({"segment_tokens": 0}, "segment_tokens"),
    ({"page_tokens": -32}, "page_tokens"),
    ({"hot_tokens": -1}, "hot_tokens"),
    ({"sink_segments": -1}, "sink_segments"),
    ({"k_error_budget": -0.1}, "k_error_budget"),
    ({"sink_error_budget": -1}, "sink_error_budget"),
    ({"hot_buffer_fraction": 1.01}, "hot_buffer_fraction"),
    ({"hot_buffer_requests": 0}, "hot_buffer_requests"),
    ({"hot_buffer_fraction": 1.5}, "hot_buffer_fraction"),
    ({"hot_buffer_fraction": -0.25}, "hot_buffer_fraction"),
    ({"select": {"budget_tokens": 16}}, "select.budget_tokens"),  # under one 32-token page
    ({"select": {"sink_tokens": -1}}, "select.sink_tokens"),
    ({"select": {"recent_tokens": -64}}, "select.recent_tokens"),
    ({"select": {"meta_channels": -8}}, "select.meta_channels"),
    ({"fit_solver": "iterative"}, "fit_solver"),
    ({"fit_solver": "Jacobi"}, "fit_solver"),
    ({"decode_cuda_graph": "Full"}, "decode_cuda_graph"),
    ({"decode_cuda_graph": "full", "graph_hot_tokens": 255}, "graph_hot_tokens"),
    ({"decode_cuda_graph": "full", "hot_tokens": 1024}, "graph_hot_tokens"),
    ({"graph_products": "fp16"}, "graph_products"),
    ({"select": {"rescore_layout": "tiles"}}, "select.rescore_layout='tiles'"),
    ({"graph_hot_tokens": "1024"}, "graph_hot_tokens"),
    ({"decode_seal_layers": -1}, "decode_seal_layers=-1 must be an int >= 0"),
    ({"decode_seal_layers": 2.0}, "'decode_seal_layers' must be int"),
])
def test_bad_values_are_named(data, needle):
    _rejects(data, needle)


@pytest.mark.parametrize("solver", ["auto", "host", "device", "jacobi"])
def test_fit_solvers_accepted(solver):
    assert MosaicConfig.parse(json.dumps({"fit_solver": solver})).fit_solver == solver


def test_nan_budget_rejected():
    with pytest.raises(ValueError, match="v_error_budget"):
        MosaicConfig.parse('{"v_error_budget": NaN}')
    with pytest.raises(ValueError, match="hot_buffer_fraction"):
        MosaicConfig.parse('{"hot_buffer_fraction": NaN}')
    assert MosaicConfig.parse('{"hot_buffer_fraction": 1}').hot_buffer_fraction == 1
    assert MosaicConfig.parse('{"v_error_budget": Infinity}').v_error_budget == math.inf


@pytest.mark.parametrize("data", [
    {"k_candidates": ["topr:r=7,val=int4"]},
    {"v_candidates": ["mask:r=5,val=int4"]},
    {"segment_tokens": 64, "page_tokens": 32, "basis_block_tokens": 4096},  # default bands: group=128
    {"k_candidates": ["lowbit:bits=4,group=48"]},
    {"k_candidates": ["band:b8=32,b4=40,b2=0,group=32"]},  # 72 channels per 64
])
def test_unencodable_candidates_rejected(data):
    with pytest.raises(ValueError):
        MosaicConfig.from_dict(data)


def _some_config() -> MosaicConfig:
    return MosaicConfig(segment_tokens=64, page_tokens=16, basis_block_tokens=512, hot_tokens=0,
                        hot_buffer_fraction=0.5,
                        sink_segments=2, sink_candidates=["dense:val=fp8"],
                        k_candidates=["topr:r=8,val=int4,index=bitmap", "band:b8=8,b4=8,b2=0,group=32"],
                        v_candidates=["lowbit:bits=2,group=16,v_axis=channel,rot=1"],
                        k_error_budget=0.5, v_error_budget=math.inf, sink_error_budget=0.0,
                        select=SelectionConfig(enabled=False, budget_tokens=48, sink_tokens=0,
                                               recent_tokens=16, meta_channels=64))


@pytest.mark.parametrize("make", (MosaicConfig, _some_config))
def test_to_dict_round_trips(make):
    cfg = make()
    d = cfg.to_dict()
    assert isinstance(d["select"], dict) and json.loads(json.dumps(d)) == d
    assert MosaicConfig.from_dict(d) == cfg
    assert MosaicConfig.parse(json.dumps(d)) == cfg
    assert MosaicConfig.from_dict(d).to_dict() == d
    # the dict is a deep copy: editing what came back leaves the config alone
    d["k_candidates"].append("dense")
    d["select"]["budget_tokens"] += 1
    assert cfg == make()


def test_select_may_be_a_selection_config():
    sel = SelectionConfig(budget_tokens=256)
    assert MosaicConfig.from_dict({"select": sel}).select == sel
    assert MosaicConfig(select={"budget_tokens": 256}).select == sel


@pytest.mark.parametrize("spec", ["topr:r=96,val=bf16", "mask:r=80"])
def test_valid_specs_for_wider_heads_accepted(spec):
    MosaicConfig.from_dict({"k_candidates": [spec]})


def test_sink_candidates_validated_for_v_too():
    with pytest.raises(ValueError, match="sink_candidates"):
        MosaicConfig.from_dict(
            {"sink_candidates": ["lowbit:bits=4,group=48,k_axis=token,v_axis=channel"]})


def test_graph_hot_tokens_binds_only_the_full_graph():
    MosaicConfig(hot_tokens=1024)  # the default 1024 is too narrow for it, but no graph reads it
    MosaicConfig(decode_cuda_graph="full", hot_tokens=1024, graph_hot_tokens=1280)


def test_daemon_modes_and_keys():
    assert MosaicConfig().daemon == "off"
    cfg = MosaicConfig.parse('{"daemon": "process", "daemon_workers": 3, "daemon_threads": 2, '
                             '"daemon_queue_segments": 40, "daemon_hot_watermark": 0.2, '
                             '"daemon_timeout_s": 5, "daemon_boundary_share": 0}')
    assert (cfg.daemon, cfg.daemon_workers, cfg.daemon_threads, cfg.daemon_queue_segments,
            cfg.daemon_hot_watermark, cfg.daemon_timeout_s, cfg.daemon_boundary_share) == (
        "process", 3, 2, 40, 0.2, 5, 0)


@pytest.mark.parametrize("data,needle", [
    ({"daemon": "on"}, "daemon='on'"),
    ({"daemon": 1}, "'daemon' must be str"),
    ({"daemon_workers": 0}, "daemon_workers=0"),
    ({"daemon_workers": 2.0}, "'daemon_workers' must be int"),
    ({"daemon_threads": 0}, "daemon_threads=0"),
    ({"daemon_queue_segments": 0}, "daemon_queue_segments=0"),
    ({"daemon_queue_segments": 8}, "daemon_queue_segments=8 must hold one basis block (32 pages"),
    ({"daemon_queue_segments": "64"}, "'daemon_queue_segments' must be int"),
    ({"daemon_hot_watermark": 1.0}, "daemon_hot_watermark=1.0"),
    ({"daemon_hot_watermark": -0.1}, "daemon_hot_watermark=-0.1"),
    ({"daemon_timeout_s": 0}, "daemon_timeout_s=0"),
    ({"daemon_timeout_s": True}, "'daemon_timeout_s' must be float"),
    ({"daemon_nice": 20}, "daemon_nice=20"),
    ({"daemon_nice": -1}, "daemon_nice=-1"),
    ({"daemon_boundary_share": 1.0}, "daemon_boundary_share=1.0"),
    ({"daemon_boundary_share": -0.01}, "daemon_boundary_share=-0.01"),
    ({"daemon_boundary_share": "0.1"}, "'daemon_boundary_share' must be float"),
])
def test_bad_daemon_values_are_named(data, needle):
    _rejects(data, needle)


def test_rescue_candidates_are_validated_and_may_be_empty():
    assert MosaicConfig(rescue_candidates=[]).rescue_candidates == []
    with pytest.raises(ValueError, match=r"rescue_candidates\[0\]"):
        MosaicConfig(rescue_candidates=["band:b8=99,b4=0,b2=0,group=32"])
    # head_dim 32: every K/V candidate fits, the default 8-bit band rescue does not; the start-up
    # check passes and fit_rescue drops the rescue (logged), keeping what fits
    cfg = MosaicConfig(k_candidates=["lowbit:bits=4,group=32"],
                       v_candidates=["lowbit:bits=4,group=32"], sink_candidates=[],
                       rescue_candidates=["band:b8=64,b4=0,b2=0,group=32", "lowbit:bits=8,group=32"])
    check_fits(cfg, head_dim=32)
    assert fit_rescue(cfg, 32).rescue_candidates == ["lowbit:bits=8,group=32"]
    assert fit_rescue(cfg, 64) is cfg


def test_decode_seal_layers_defaults_to_all_at_once():
    assert MosaicConfig().decode_seal_layers == 0  # every layer in one step (until measured)
    assert MosaicConfig.parse('{"decode_seal_layers": 4}').decode_seal_layers == 4
    with pytest.raises(ValueError, match="decode_seal_layers=-2 must be an int >= 0"):
        MosaicConfig(decode_seal_layers=-2)


def test_a_preset_is_a_starting_point_the_other_keys_override():
    from mosaickv_sglang.config import PRESETS

    cfg = MosaicConfig.parse('{"preset": "chunk_rule"}')
    for key, value in PRESETS["chunk_rule"].items():
        assert getattr(cfg, key) == value, key
    assert cfg.read_rule == "chunk" and MosaicConfig().read_rule == "position"
    # the default is the traffic-independent read rule
    for key, value in PRESETS["traffic_independent"].items():
        assert getattr(MosaicConfig(), key) == value, key
    # the user's keys win; a nested one merges key by key over the preset's (and the defaults)
    cfg = MosaicConfig.parse('{"preset": "chunk_rule", "hot_tokens": 0, '
                             '"select": {"rescore_factor": 2}}')
    assert cfg.hot_tokens == 0 and cfg.read_rule == "chunk"
    assert cfg.select.rescore_factor == 2
    assert cfg.select.rescore_channels == MosaicConfig().select.rescore_channels
    assert cfg.select.budget_tokens == MosaicConfig().select.budget_tokens
    with pytest.raises(ValueError, match="unknown preset 'nope'; known: .*traffic_independent"):
        MosaicConfig.parse('{"preset": "nope"}')
    for name, keys in PRESETS.items():  # every preset is a valid config on its own
        MosaicConfig.from_dict({"preset": name})
        assert "preset" not in keys
    # the former default: the chunk rule, its budgets, no second stage; the rest as today
    former = MosaicConfig.parse('{"preset": "former_default"}')
    assert (former.read_rule, former.basis_fit, former.hot_tokens) == ("chunk", "group", 64)
    assert (former.k_error_budget, former.v_error_budget) == (0.08, 0.12)
    assert former.select.rescore_factor == 0 and former.select.enabled
    assert (MosaicConfig().k_error_budget, MosaicConfig().select.rescore_factor) != (0.08, 0)
