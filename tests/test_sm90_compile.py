"""Every Triton kernel of triton_kernels/ compiles for the H200 (sm_90) down to a cubin, here on
the CPU, in the variants the server launches (scripts/sm90_compile.py: the wrappers called as
the server calls them, each launch stopped before it compiles and then compiled offline by
Triton's ptxas), with registers and spills per variant; no kernel spills unless it is
allow-listed below; and no @triton.jit function escapes the list (a new kernel must get a
scenario). MOSAICKV_SM90_REPORT=FILE keeps the JSON report.

The interpreter runs what the compiler refuses (e.g. one name bound to two pointer types), and
a kernel at the register limit spills on the GPU only: both are caught here, without a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import sm90_compile  # noqa: E402  (imported, it changes nothing: no env, no driver)

# Spill bytes (stores + loads) a kernel may have in its worst variant; every other kernel: 0.
# From the report of 2026-12-04 (Triton 3.6.0, sm_90, 4 warps):
ALLOWED_SPILL_BYTES = {
    # Stage 1 of the band decode holds a K and a V tile of each band width and a [G, D] fp32
    # accumulator: at head_dim 128 it sits at the 255-register limit, and 10 of its 44
    # variants spill 8-44 bytes: 5 of the 16 d128 width classes without selection (worst: K
    # and V both b8=8,b4=120: 28 stores + 16 loads), 1 of 16 with selection, 3 of the 4 fp16
    # (exact=False) ones, 1 of the 8 d64 ones (b8=4,b4=60 for K and V, with selection: 40).
    # A larger spill, or a spill in another kernel, is a regression to look at.
    "band_decode._band_decode_stage1": 64,
    # The decode graph's stage 1 gathers every layout's codes through its per-channel plan
    # (tiles of 64-bit addresses), holds q, the row's accumulator and the next page's header
    # fields: at head_dim 128 with 4 warps and 32-token units (the fastest on the H200,
    # benchmarks/request_decode_sweep.py: 165 us vs 213 with 16-token units, 373 with 8 warps)
    # it sits at 255 registers and spills 104 bytes (60 stored, 44 loaded).
    "request_decode._request_decode_stage1": 112,
}


def test_every_jit_function_is_compiled():
    """Each @triton.jit function is a kernel some scenario launches, or is called by one."""
    graph = sm90_compile.jit_call_graph(sm90_compile.kernel_sources())
    assert len(graph) >= 20, sorted(graph)  # the parser found the package's jit functions
    missing = sm90_compile.uncovered(graph, sm90_compile.covered_kernels())
    assert not missing, (f"@triton.jit functions no sm_90 compile covers: {missing}; add a "
                         f"Scenario that launches the kernel to scripts/sm90_compile.py")
    assert set(ALLOWED_SPILL_BYTES) <= sm90_compile.covered_kernels()


def test_the_coverage_check_finds_a_new_kernel():
    sources = {
        "mod": "import triton\n"
               "from .common import helper\n"
               "@triton.jit\ndef _used(x):\n    return x\n"
               "@triton.jit\ndef kernel(X):\n    _used(X)\n    helper(X)\n"
               "@triton.jit\ndef new_kernel(X):\n    pass\n"
               "def host(x):\n    return x\n",
        "common": "import triton\n@triton.jit\ndef helper(x):\n    return _inner(x)\n"
                  "@triton.jit\ndef _inner(x):\n    return x\n"
                  "@triton.jit\ndef unused(x):\n    return x\n",
    }
    graph = sm90_compile.jit_call_graph(sources)
    assert graph["mod.kernel"] == {"mod._used", "common.helper"}
    assert "mod.host" not in graph
    assert sm90_compile.uncovered(graph, {"mod.kernel"}) == ["common.unused", "mod.new_kernel"]
    assert sm90_compile.uncovered(graph, {"mod.kernel", "mod.new_kernel", "common.unused"}) == []


def test_ptxas_log_is_read():
    log = ("ptxas info    : Compiling entry function '_k' for 'sm_90a'\n"
           "ptxas info    : Function properties for _k\n"
           "    16 bytes stack frame, 28 bytes spill stores, 16 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    assert sm90_compile.parse_ptxas(log) == {"registers": 255, "stack": 16,
                                             "spill_stores": 28, "spill_loads": 16}
    assert sm90_compile.parse_ptxas("nothing")["registers"] is None


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_within_its_spill_allowance(tmp_path, capsys):
    report_path = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "sm90_compile.py"),
                           "--json", str(report_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    print(proc.stdout)  # the per-variant table (shown with -s or on failure)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    report = json.loads(report_path.read_text())
    assert report["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}
    kernels = report["kernels"]
    assert set(kernels) == sm90_compile.covered_kernels(), sorted(kernels)
    rows = report["variants"]
    assert all(r["ok"] and r["registers"] is not None for r in rows), \
        [r for r in rows if not r["ok"]]
    over = [f"{r['kernel']} [{r['scenario']}: {sm90_compile.variant_label(r, rows)}] "
            f"{r['registers']} registers, spills {r['spill_stores']}/{r['spill_loads']} bytes"
            for r in rows if r["spill_stores"] + r["spill_loads"] >
            ALLOWED_SPILL_BYTES.get(r["kernel"], 0)]
    with capsys.disabled():  # the per-kernel summary in every run's log
        print(f"\nsm_90 compile: {len(rows)} variants of {len(kernels)} kernels in "
              f"{report['seconds']} s ({report['jobs']} jobs)")
        for name, s in kernels.items():
            print(f"  {name:<36} {s['variants']:>3} variants, <= {s['max_registers']:>3} regs, "
                  f"spills <= {s['max_spill_bytes']:>3} B in {s['spilling_variants']}")
    assert not over, "spills beyond ALLOWED_SPILL_BYTES:\n" + "\n".join(over)
