"""benchmarks/serving_bench.py helpers that turn server stats into a point's numbers."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving_bench.py"
spec = importlib.util.spec_from_file_location("serving_bench", SCRIPT)
serving_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serving_bench)


def _stats(steps, ms):
    return {"decode": {"profile": {"sampled_steps": steps, "every": 4, "ms_per_step": ms}}}


def test_point_profile_is_the_difference_of_running_averages():
    before = _stats(2, {"kernels": 1.0, "host_plan": 3.0})
    after = _stats(6, {"kernels": 2.5, "host_plan": 3.0, "merge": 0.5})  # 4 new steps
    got = serving_bench.point_profile(before, after)
    # kernels: (2.5*6 - 1.0*2) / 4; a phase new in this point counts from 0
    assert got == {"sampled_steps": 4,
                   "ms_per_step": {"kernels": 3.25, "host_plan": 3.0, "merge": 0.75}}


def test_point_profile_without_new_sampled_steps_is_none():
    assert serving_bench.point_profile(None, None) is None
    assert serving_bench.point_profile(_stats(3, {"kernels": 1.0}),
                                       _stats(3, {"kernels": 1.0})) is None
    assert serving_bench.point_profile({"decode": None}, _stats(1, {"kernels": 2.0})) == \
        {"sampled_steps": 1, "ms_per_step": {"kernels": 2.0}}


def test_batches_parse_ints_and_max_and_name_bad_items():
    assert serving_bench.parse_batches("1,8,max") == [1, 8, "max"]
    for bad in ("0", "1,x", "-2", "1,,2"):
        with pytest.raises(SystemExit, match="positive ints or 'max'"):
            serving_bench.parse_batches(bad)


def test_each_dense_system_names_one_attention_backend():
    """`dense_flashinfer` / `fp8_flashinfer` serve the same caches as `dense` / `fp8` with
    FlashInfer's attention whatever --dense-backend says; the plain ones take --dense-backend;
    MosaicKV takes neither (the plugin sets its own)."""
    def backends(system, dense_backend="triton"):
        args = serving_bench.system_args(system, dense_backend)
        return [args[i + 1] for i, a in enumerate(args) if a == "--attention-backend"]

    assert backends("dense") == ["triton"] and backends("fp8", "torch_native") == ["torch_native"]
    assert backends("dense_flashinfer") == backends("fp8_flashinfer", "torch_native") == ["flashinfer"]
    assert backends("mosaickv") == []
    fp8 = serving_bench.system_args("fp8_flashinfer", "triton")
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    with pytest.raises(SystemExit, match="unknown system"):
        serving_bench.system_args("dense_flashinfer2", "triton")


def test_mosaickv_systems_merge_their_config_over_the_given_one():
    import json

    assert serving_bench.system_args("mosaickv", "triton") == ["--kv-backend", "mosaickv"]
    args = serving_bench.system_args("mosaickv_graph", "triton", '{"hot_buffer_fraction": 0.05}')
    assert args[:2] == ["--kv-backend", "mosaickv"] and args[2] == "--mosaickv-config"
    assert json.loads(args[3]) == {"hot_buffer_fraction": 0.05, "decode_cuda_graph": "breakable"}
    plain = serving_bench.system_args("mosaickv", "triton", '{"hot_buffer_fraction": 0.05}')
    assert json.loads(plain[3]) == {"hot_buffer_fraction": 0.05}
