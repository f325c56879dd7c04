"""Every segment strategy: packed-form q.k / p.v agree with the full decode, byte accounting,
reconstruction quality ordering, and spec parsing errors."""
from __future__ import annotations

import pytest
import torch

from mosaickv_sglang.codec.strategies import (Encoded, Strategy, parse_strategy, strategy_id,
                                              strategy_names)
from mosaickv_sglang.codec.strategies.values import FP8_MAX

from conftest import assert_finite, assert_rel_close, rel_err, repro, tensor_bytes

VALUE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
S_TOKENS = 128  # every group size used below divides it

SPECS = (
    [f"topr:r={r},val={val},index={index}"
     for val in ("bf16", "fp8", "int8", "int4")
     for r, index in ((8, "u8"), (8, "bitmap"), (8, "auto"), (10, "auto"), (16, "u8"))]
    + [f"topr:r=12,val=bf16,rot={rot}" for rot in (0, 1)] + ["topr:r=10,val=fp32"]
    + [f"lowbit:bits={bits},group={group},k_axis={axis},v_axis={axis}"
       for bits in (2, 4, 8) for axis in ("channel", "token") for group in (32, 128)]
    + ["lowbit:bits=4,group=64,k_axis=token,v_axis=channel,rot=1"]
    + [f"mask:r={r},val={val}" for r in (8, 24) for val in ("bf16", "fp8", "int8", "int4")]
    + ["mask:r=12,val=fp32"]
    + ["band:b8=8,b4=24,b2=16,group=64", "band:b8=0,b4=48,b2=16,group=128",
       "band:b8=16,b4=0,b2=0,group=32", "band:b8=4,b4=44,b2=16,group=128",
       "band:b8=0,b4=0,b2=32,group=64", "band:b8=2,b4=2,b2=4,group=128,rot=0"]
    + ["dense", "dense:val=bf16", "dense:val=fp8", "dense:val=fp32"]
    + list(strategy_names())  # every registered strategy with its default parameters
)


def channels_needed(strat: Strategy) -> int:
    if strat.name in ("topr", "mask"):
        return strat.r
    return 1


def make_case(spec: str, kind: str):
    """Random shapes/data for one spec: x [H, S, D] with decaying channel energy and outliers
    (what a rotated K/V segment looks like), q [H, G, D], p [H, G, S] (a softmax)."""
    strat = parse_strategy(spec)
    h = int(torch.randint(2, 4, ()))
    g = int(torch.randint(2, 4, ()))
    if strat.name == "band":  # widths are per 64 channels: head_dim a multiple of 64
        d = 64 if torch.rand(()) < 0.7 else 128
    else:
        d = 64 if channels_needed(strat) > 32 or torch.rand(()) < 0.5 else 32
    decay = torch.exp(-torch.linspace(0, 3, d))[torch.randperm(d)] if not strat.rot else \
        torch.exp(-torch.linspace(0, 3, d))
    x = torch.randn(h, S_TOKENS, d) * decay * torch.rand(h, S_TOKENS, 1).add(0.5) * 2
    x += torch.randn(()) * 0.3  # a common offset
    outliers = torch.rand(h, S_TOKENS, d) < 0.01
    x = torch.where(outliers, x * 8, x)
    q = torch.randn(h, g, d) * 2
    p = torch.softmax(torch.randn(h, g, S_TOKENS) * 2, -1)
    enc = Encoded(kind, tuple(x.shape), strat.encode(x, kind))
    return strat, x, q, p, enc


def expected_nbytes(strat: Strategy, kind: str, h: int, s: int, d: int) -> float:
    n = h * s  # vectors
    if strat.name == "dense":
        return n * d * VALUE_BYTES[strat.val]
    if strat.name in ("topr", "mask"):
        vals = n * strat.r * VALUE_BYTES[strat.val] + (n * 2 if strat.val.startswith("int") else 0)
        if strat.name == "mask":
            return vals + h * strat.r  # uint8 channel ids per head
        bitmap = strat.index == "bitmap" or (strat.index == "auto" and 8 * strat.r > d)
        return vals + n * (d / 8 if bitmap else strat.r)
    if strat.name == "lowbit":
        codes = n * d * strat.bits / 8
        axis = strat.k_axis if kind == "k" else strat.v_axis
        pairs = h * (s // strat.group) * d if axis == "channel" else n
        return codes + pairs * 2 * 2  # fp16 scale + fp16 zero
    if strat.name == "band":
        total = 0.0
        for bits in (8, 4, 2):
            c = getattr(strat, f"b{bits}") * (d // 64)  # widths are per 64 channels
            if c:
                total += n * c * bits / 8 + h * (s // strat.group) * c * 2 * 2
        return total
    raise AssertionError(f"no byte formula for strategy '{strat.name}': add one")


def test_spec_list_covers_every_registered_strategy():
    covered = {parse_strategy(s).name for s in SPECS}
    assert covered == set(strategy_names())
    # ids are fixed per strategy (headers carry them), distinct, independent of import order
    assert {n: strategy_id(n) for n in strategy_names()} == \
        {"lowbit": 0, "band": 1, "dense": 2, "mask": 3, "topr": 4}


def test_a_strategy_registers_only_with_its_own_fixed_id():
    from mosaickv_sglang.codec.strategies.base import register

    class NoId(Strategy):
        name = "no_id_test"

    class Taken(Strategy):
        name = "taken_id_test"
        id = 1  # band's

    with pytest.raises(ValueError, match="needs its own fixed `id`"):
        register(NoId)
    with pytest.raises(ValueError, match="id 1 is strategy 'band'"):
        register(Taken)
    assert "no_id_test" not in strategy_names() and "taken_id_test" not in strategy_names()
    with pytest.raises(ValueError, match="unknown strategy"):
        strategy_id("no_id_test")


@pytest.mark.parametrize("kind", ("k", "v"))
@pytest.mark.parametrize("spec", SPECS)
def test_packed_qk_pv_match_decode(spec, kind, seed):
    strat, x, q, p, enc = make_case(spec, kind)
    dec = strat.decode(enc)
    assert dec.dtype == torch.float32 and tuple(dec.shape) == tuple(x.shape), f"{spec} {repro(seed)}"
    assert_finite(dec, f"{spec} decode", seed)
    # loose sanity only: the decode points the same way as the input (2-bit codes with outliers
    # or 8 raw channels of 64 are legitimately poor); the quality ordering is tested below
    cos = float((dec.double() * x.double()).sum() / (dec.double().norm() * x.double().norm()))
    min_cos = 0.1 if spec == "band:b8=2,b4=2,b2=4,group=128,rot=0" else 0.4
    assert cos > min_cos, f"{spec}: decode unrelated to input (cos {cos:.3f}) {repro(seed)}"
    qk = strat.qk(enc, q)
    assert_rel_close(qk, torch.einsum("hgd,hsd->hgs", q.double(), dec.double()), 1e-4,
                     f"{spec} {kind} qk vs decode", seed)
    pv = strat.pv(enc, p)
    assert_rel_close(pv, torch.einsum("hgs,hsd->hgd", p.double(), dec.double()), 1e-4,
                     f"{spec} {kind} pv vs decode", seed)


@pytest.mark.parametrize("kind", ("k", "v"))
@pytest.mark.parametrize("spec", SPECS)
def test_encode_decoded_is_encode_then_decode(spec, kind, seed):
    """The chooser's `encode_decoded` (Band rebuilds from its codes before packing) gives the
    bytes `encode` keeps and, bit for bit, what `decode` reads back from them."""
    strat, x, _, _, enc = make_case(spec, kind)
    tensors, decoded = strat.encode_decoded(x, kind)
    assert tensors.keys() == enc.tensors.keys(), f"{spec} {repro(seed)}"
    for name, t in tensors.items():
        assert torch.equal(t, enc.tensors[name]), f"{spec} {kind} {name} {repro(seed)}"
    want = strat.decode(enc)
    assert decoded.dtype == want.dtype and torch.equal(decoded, want), f"{spec} {kind} {repro(seed)}"


@pytest.mark.parametrize("kind", ("k", "v"))
@pytest.mark.parametrize("spec", SPECS)
def test_nbytes_is_tensor_bytes_and_formula(spec, kind, seed):
    strat, x, _, _, enc = make_case(spec, kind)
    h, s, d = x.shape
    assert enc.nbytes() == sum(tensor_bytes(t) for t in enc.tensors.values()), repro(seed)
    expect = expected_nbytes(strat, kind, h, s, d)
    if strat.name == "topr":  # which index format was stored (u8 and bitmap can tie in bytes)
        bitmap = strat.index == "bitmap" or (strat.index == "auto" and 8 * strat.r > d)
        assert set(enc.tensors) & {"index", "bitmap"} == {"bitmap" if bitmap else "index"}, \
            f"{spec} D={d}: {sorted(enc.tensors)} {repro(seed)}"
    assert enc.nbytes() == expect, (f"{spec} {kind} H={h} S={s} D={d}: {enc.nbytes()} bytes, "
                                    f"formula {expect} {repro(seed)}")
    assert enc.nbytes() <= h * s * d * (4 if getattr(strat, "val", "") == "fp32" else 2), \
        f"{spec}: more bytes than dense bf16 {repro(seed)}"


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trips(spec):
    strat = parse_strategy(spec)
    again = parse_strategy(strat.spec)
    assert type(again) is type(strat) and again.spec == strat.spec
    for key in (*strat.params, "rot"):
        assert getattr(again, key) == getattr(strat, key), (spec, key)
    assert parse_strategy(strat) is strat


@pytest.mark.parametrize("kind", ("k", "v"))
def test_dense_bf16_is_exact_to_bf16_rounding(kind, seed):
    strat, x, _, _, enc = make_case("dense", kind)
    assert enc.tensors["values"].dtype == torch.bfloat16
    assert torch.equal(strat.decode(enc), x.to(torch.bfloat16).float()), repro(seed)
    # bf16 input (what the cache holds) is reproduced bit-exactly
    xb = x.to(torch.bfloat16).float()
    enc = Encoded(kind, tuple(x.shape), strat.encode(xb, kind))
    assert torch.equal(strat.decode(enc), xb), repro(seed)


@pytest.mark.parametrize("kind", ("k", "v"))
def test_dense_fp32_is_exact(kind, seed):
    strat, x, q, p, enc = make_case("dense:val=fp32", kind)
    assert enc.tensors["values"].dtype == torch.float32
    assert torch.equal(strat.decode(enc), x), repro(seed)
    assert torch.equal(strat.qk(enc, q), torch.einsum("hgd,hsd->hgs", q, x)), repro(seed)


def test_dense_fp8_is_e4m3_rounding(seed):
    strat, x, _, _, enc = make_case("dense:val=fp8", "k")
    dec = strat.decode(enc)
    assert torch.equal(dec, x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()), repro(seed)
    normal = x.abs() > 2 ** -6
    assert float(((dec - x).abs() / x.abs())[normal].max()) <= 2 ** -4, repro(seed)


@pytest.mark.parametrize("val", ("fp32", "bf16", "fp8", "int8", "int4"))
@pytest.mark.parametrize("index", ("u8", "bitmap"))
def test_topr_keeps_the_r_largest_per_vector(val, index, seed):
    r = 2 * int(torch.randint(2, 12, ()))
    strat, x, _, _, enc = make_case(f"topr:r={r},val={val},index={index}", "k")
    dec = strat.decode(enc)
    top = x.abs().topk(r, dim=-1).indices.sort(-1).values
    assert torch.equal(strat.channels(enc), top), repro(seed)
    outside = torch.ones_like(x, dtype=torch.bool).scatter_(2, top, False)
    assert bool((dec[outside] == 0).all()), repro(seed)
    kept, back = torch.gather(x, 2, top), torch.gather(dec, 2, top)
    if val == "bf16":
        assert torch.equal(back, kept.to(torch.bfloat16).float()), repro(seed)
    if val == "fp32":
        assert torch.equal(back, kept), repro(seed)


def test_mask_keeps_the_r_highest_energy_channels(seed):
    strat, x, _, _, enc = make_case("mask:r=8,val=bf16", "v")
    top = x.pow(2).sum(1).topk(8, dim=-1).indices.sort(-1).values
    assert torch.equal(enc.tensors["channels"].long(), top), repro(seed)
    dec = strat.decode(enc)
    expect = torch.zeros_like(x).scatter_(2, top[:, None].expand(-1, x.shape[1], -1),
                                          torch.gather(x, 2, top[:, None].expand(-1, x.shape[1], -1)))
    assert torch.equal(dec, expect.to(torch.bfloat16).float()), repro(seed)


def _errors(specs: list[str], kind: str, x: torch.Tensor) -> list[float]:
    out = []
    for spec in specs:
        strat = parse_strategy(spec)
        enc = Encoded(kind, tuple(x.shape), strat.encode(x, kind))
        err = rel_err(strat.decode(enc), x)
        assert err == err, f"{spec}: NaN error"
        out.append(err)
    return out


def _assert_non_increasing(specs, errs, seed):
    for (a, ea), (b, eb) in zip(zip(specs, errs), zip(specs[1:], errs[1:])):
        assert eb <= ea * (1 + 1e-6), f"{b} error {eb:.4e} > {a} error {ea:.4e} {repro(seed)}"
    assert errs[-1] < errs[0], f"no improvement over {specs} ({errs}) {repro(seed)}"


@pytest.mark.parametrize("kind", ("k", "v"))
@pytest.mark.parametrize("val", ("fp32", "bf16", "fp8", "int8", "int4"))
def test_topr_error_decreases_with_r(val, kind, seed):
    _, x, _, _, _ = make_case("topr:r=64", kind)
    specs = [f"topr:r={r},val={val}" for r in (2, 4, 8, 16, 32, 64)]
    _assert_non_increasing(specs, _errors(specs, kind, x), seed)


@pytest.mark.parametrize("kind", ("k", "v"))
@pytest.mark.parametrize("axis", ("channel", "token"))
def test_lowbit_error_decreases_with_bits(axis, kind, seed):
    _, x, _, _, _ = make_case("lowbit", kind)
    specs = [f"lowbit:bits={b},group=32,k_axis={axis},v_axis={axis}" for b in (2, 4, 8)]
    _assert_non_increasing(specs, _errors(specs, kind, x), seed)


@pytest.mark.parametrize("kind", ("k", "v"))
def test_band_error_decreases_with_channels_and_bits(kind, seed):
    _, x, _, _, _ = make_case("band:b8=8,b4=48,b2=8", kind)
    more_channels = ["band:b8=0,b4=8,b2=0", "band:b8=0,b4=16,b2=0", "band:b8=0,b4=32,b2=0",
                     "band:b8=0,b4=64,b2=0"]
    _assert_non_increasing(more_channels, _errors(more_channels, kind, x), seed)
    more_bits = ["band:b8=0,b4=0,b2=32", "band:b8=0,b4=32,b2=0", "band:b8=32,b4=0,b2=0"]
    _assert_non_increasing(more_bits, _errors(more_bits, kind, x), seed)


@pytest.mark.parametrize("d", (64, 128))
def test_band_widths_scale_with_head_dim(d, seed):
    strat = parse_strategy("band:b8=8,b4=24,b2=16,group=32")
    x = torch.randn(2, 64, d)
    enc = Encoded("k", tuple(x.shape), strat.encode(x, "k"))
    scale = d // 64
    for bits, width in ((8, 8), (4, 24), (2, 16)):
        assert enc.tensors[f"scale{bits}"].shape == (2, 2, width * scale), repro(seed)
        assert enc.tensors[f"codes{bits}"].shape == (2, 64, width * scale * bits // 8)
    dec = strat.decode(enc)
    kept = 48 * scale
    assert bool((dec[..., kept:] == 0).all()) and bool((dec[..., :kept] != 0).any()), repro(seed)


@pytest.mark.parametrize("d", (32, 96))
def test_band_rejects_head_dim_not_multiple_of_64(d, seed):
    strat = parse_strategy("band:b8=8,b4=16,b2=0,group=32")
    with pytest.raises(ValueError, match="head_dim"):
        strat.encode(torch.randn(2, 64, d), "k")


@pytest.mark.parametrize("kind", ("k", "v"))
def test_mask_error_decreases_with_r(kind, seed):
    _, x, _, _, _ = make_case("mask:r=64", kind)
    specs = [f"mask:r={r}" for r in (4, 8, 16, 32, 64)]
    _assert_non_increasing(specs, _errors(specs, kind, x), seed)


@pytest.mark.parametrize("spec,needle", [
    ("nosuch", "nosuch"),
    ("nosuch:r=4", "nosuch"),
    ("topr:foo=1", "foo"),
    ("lowbit:k_axs=token", "k_axs"),
    ("band:b16=8", "b16"),
    ("topr:r", "'r'"),
    ("topr:r=0", "r=0"),
    ("mask:r=-3", "r=-3"),
    ("topr:val=bf17", "bf17"),
    ("dense:val=int3", "int3"),
    ("topr:index=u16", "u16"),
    ("lowbit:bits=3", "bits=3"),
    ("lowbit:bits=16", "bits=16"),
    ("lowbit:group=0", "group=0"),
    ("lowbit:k_axis=chan", "k_axis"),
    ("lowbit:v_axis=row", "v_axis"),
    ("band:b4=3", "b4=3"),
    ("band:b2=2", "b2=2"),
    ("band:b8=-8", "b8=-8"),
    ("band:group=0", "group=0"),
])
def test_parse_strategy_rejects_bad_specs(spec, needle):
    with pytest.raises(ValueError) as info:
        parse_strategy(spec)
    assert needle in str(info.value), f"{spec!r}: message {str(info.value)!r} lacks {needle!r}"


@pytest.mark.parametrize("spec", ["", None, 3])
def test_parse_strategy_rejects_non_specs(spec):
    with pytest.raises(ValueError, match="non-empty string"):
        parse_strategy(spec)


@pytest.mark.parametrize("spec,param", [("topr:r=abc", "r"), ("lowbit:bits=4.0", "bits"),
                                        ("band:group=sixty", "group")])
def test_parse_strategy_names_param_of_non_int_value(spec, param):
    with pytest.raises(ValueError) as info:
        parse_strategy(spec)
    msg = str(info.value)
    assert f"{param}=" in msg or f"'{param}'" in msg, msg


@pytest.mark.parametrize("spec", ["topr:rot=no", "lowbit:rot=off", "dense:rot=2"])
def test_parse_strategy_rejects_non_bool_rot(spec):
    with pytest.raises(ValueError, match="rot"):
        parse_strategy(spec)


@pytest.mark.parametrize("spec,default_rot", [("topr", True), ("band", True), ("lowbit", False),
                                              ("mask", False), ("dense", False)])
def test_rot_flag_parsing(spec, default_rot):
    assert parse_strategy(spec).rot is default_rot
    for text, value in (("1", True), ("0", False), ("true", True), ("false", False)):
        assert parse_strategy(f"{spec}:rot={text}").rot is value
