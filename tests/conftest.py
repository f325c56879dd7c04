"""Shared helpers for the codec tests: a fresh random seed per test (reported on failure) and a
closeness check that NaN/inf can never pass.

Every test that draws random data takes the `seed` fixture: it seeds torch's global RNG with a
fresh seed (or MOSAICKV_TEST_SEED, to reproduce a failure) and returns it; a failing test's
report carries a "random seed" section with the rerun line (`pytest_runtest_makereport`), and
assertion messages may carry it too (`repro`).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on a CPU; this must precede the first `import triton`
    # of the session, whichever test module (the kernel tests, or SGLang via the plugin tests)
    # happens to import it first.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fresh_seed() -> int:
    env = os.environ.get("MOSAICKV_TEST_SEED")
    if env:
        return int(env)
    return random.SystemRandom().randrange(2**31)


@pytest.fixture
def seed(request):
    s = _fresh_seed()
    torch.manual_seed(s)
    # in the failure report (pytest_runtest_makereport below) and in --junitxml
    request.node.user_properties.append(("seed", s))
    # the tensors here are tiny: one intra-op thread avoids OpenMP spin-waiting on a busy 2-core box
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield s
    torch.set_num_threads(threads)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that drew a seed shows it: a "random seed" section in its report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(("random seed", repro(value)))


def repro(seed: int) -> str:
    return f"[seed={seed}; rerun with MOSAICKV_TEST_SEED={seed}]"


def write_requests(pool, lengths, seed: int, device: str = "cpu", width: int = 1024):
    """Requests of `lengths` tokens written into `pool` (random K with uneven channel scales,
    random V, every layer) and sealed, in request rows 1.. (row 0 is SGLang's padding row),
    `width` slots each -> req_to_token int32 [len(lengths) + 1, width] on the CPU."""
    from types import SimpleNamespace
    ps, h, d = pool.page_size, pool.head_num, pool.head_dim
    gen = torch.Generator().manual_seed(seed)
    req_to_token = torch.zeros(len(lengths) + 1, width, dtype=torch.int32)
    page = 1
    for rid, n in enumerate(lengths, start=1):
        slots = torch.arange(page * ps, page * ps + width)
        req_to_token[rid] = slots.to(torch.int32)
        for layer_id in range(pool.layer_num):
            k = torch.randn(n, h, d, generator=gen) * (1 + torch.arange(d) % 7)
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots[:n].to(device),
                               k.bfloat16().to(device),
                               torch.randn(n, h, d, generator=gen).bfloat16().to(device))
        if pool.prompt_split and n:
            # the position rule with a window: sealed as a prefill of an n-token prompt seals
            # (after its last token and after the forward: every full page ending at least W
            # before the prompt's end; the window's pages stay hot)
            pool.set_prompt_len(rid, n)
            pool.seal_request(slots[:n].to(device), n - 1, prompt=n)
            pool.seal_request(slots[:n].to(device), n, prompt=n)
        else:
            pool.seal_request(slots[:n].to(device), n)
        page += width // ps
    return req_to_token


def decode_steps(req_to_token, lengths, device: str = "cpu", steps: int = 5):
    """(step, live decode batch) for `steps` steps of the requests in rows 1.. of
    `req_to_token` (`write_requests`; `lengths` their prompts), one more token each, as SGLang
    hands a decode batch to the backend."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    real = torch.arange(1, len(lengths) + 1, device=device)
    seq = list(lengths)
    for step in range(steps):
        seq = [n + 1 for n in seq]
        locs = torch.stack([req_to_token[r, n - 1] for r, n in zip(real.tolist(), seq)]).long()
        yield step, SimpleNamespace(batch_size=len(seq), req_pool_indices=real,
                                    seq_lens=torch.tensor(seq, device=device),
                                    seq_lens_cpu=torch.tensor(seq), out_cache_loc=locs,
                                    forward_mode=ForwardMode.DECODE)


def refresh_static(static, live, fill: int) -> None:
    """What the decode graph runner's `fill_from` does before a replay: the live batch's
    requests, lengths and slots into the head of the capture-time buffers, padding after."""
    n = live.req_pool_indices.numel()
    static.req_pool_indices[:n], static.req_pool_indices[n:] = live.req_pool_indices, 0
    static.seq_lens[:n], static.seq_lens[n:] = live.seq_lens, fill
    static.seq_lens_cpu[:n], static.seq_lens_cpu[n:] = live.seq_lens_cpu, fill
    static.out_cache_loc[:n], static.out_cache_loc[n:] = live.out_cache_loc, 0


def replay_view(static, bs: int, pad: int, live_loc: torch.Tensor):
    """What SGLang's decode graph runner hands `init_forward_metadata_out_graph` before a replay
    (decode_cuda_graph_runner.build_replay_fb_view): the padded static buffers, refreshed in
    place, the padding count and the live (unpadded) out_cache_loc."""
    from types import SimpleNamespace
    return SimpleNamespace(batch_size=bs, num_padding=pad,
                           req_pool_indices=static.req_pool_indices[:bs],
                           seq_lens=static.seq_lens[:bs], seq_lens_cpu=static.seq_lens_cpu[:bs],
                           out_cache_loc=live_loc)


def assert_finite(t: torch.Tensor, what: str, seed: int) -> None:
    bad = ~torch.isfinite(t)
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} non-finite values {repro(seed)}"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str,
                     seed: int) -> float:
    """Finite, same shape, and ||actual - expected|| <= rel * ||expected||. Returns the error."""
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)} {repro(seed)}"
    assert_finite(actual, what + " (actual)", seed)
    assert_finite(expected, what + " (expected)", seed)
    assert float(expected.double().norm()) > 0, f"{what}: degenerate all-zero reference {repro(seed)}"
    err = rel_err(actual, expected)
    assert err < rel, f"{what}: relative error {err:.3e} >= {rel:.1e} {repro(seed)}"
    return err


class LaunchRecorder:
    """Stands in for a Triton kernel (`kernel[grid](...)` and `kernel.warmup(...)`): records
    the key Triton's cache would compile on (argument dtypes, ints, compile-time arguments) of
    each launch and each warm-up, and runs the launch on `real` when given. A test that start-up
    compiles cover a path asserts `launched <= warmed`."""

    def __init__(self, real=None):
        self.real, self.launched, self.warmed = real, set(), set()

    @staticmethod
    def _key(args, kwargs):
        return (tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args),
                tuple(sorted(kwargs.items())))

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.add(self._key(args, kwargs))
            return None if self.real is None else self.real[grid](*args, **kwargs)
        return launch

    def warmup(self, *args, grid, **kwargs):
        self.warmed.add(self._key(args, kwargs))


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Run in a fresh process without TRITON_INTERPRET (compile_sm90): prints the compiled kinds.
_COMPILE_SM90 = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constexprs = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}},
                constexprs=constexprs)
print(json.dumps(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm)))
"""


@pytest.fixture
def compile_sm90():
    """Compile a Triton kernel for the H200 (sm_90) down to a cubin, here on the CPU: the
    interpreter runs what the compiler refuses (e.g. one name bound to two pointer types in an
    if/else), so a kernel that passed its CPU test could still fail on the GPU. Returns the
    compiled kinds ("ttir" ... "cubin"). In a fresh process without the interpreter: the
    interpreter patches triton.language for the whole process while it runs a kernel (and a
    device function's call leaves its patches), so compiling here depended on which kernel
    tests ran first (seen in CI: "'ir.value' object has no attribute 'dtype'")."""
    import json
    import subprocess
    import sys

    def run(fn, signature: dict, constexprs: dict) -> list[str]:
        inner = getattr(fn, "fn", fn)  # a JITFunction, or the interpreter's wrapper of one
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90, json.dumps(
            [inner.__module__, inner.__name__, signature, constexprs])],
            capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])
    return run
