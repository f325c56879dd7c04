"""Band decode Triton kernel (mosaickv_kernels.band_decode) against the torch reference
`codec.attention.decode_attention` on the same CompressedLayers, and the packed arena layout.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before
triton is imported), so shapes stay tiny; the `gpu` test runs larger shapes on a device.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`

try:
    import triton  # noqa: F401
    from mosaickv_kernels.band_decode import BandDecodeWrapper, keep_to_page_list
    _IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the environment
    _IMPORT_ERROR = exc

from mosaickv_sglang.codec import attention
from mosaickv_sglang.codec.arena import ALIGN, HDR, pack_layer
from mosaickv_sglang.codec.basis import fit_basis, rotate
from mosaickv_sglang.codec.layer import Choice, CompressedLayer, Segment, compress_layer
from mosaickv_sglang.codec.quant import unpack_codes
from mosaickv_sglang.codec.strategies import Encoded, parse_strategy
from mosaickv_sglang.config import MosaicConfig, SelectionConfig

from conftest import assert_finite, assert_rel_close, repro

pytestmark = [
    pytest.mark.skipif(_IMPORT_ERROR is not None,
                       reason=f"triton / kernels not importable: {_IMPORT_ERROR!r}"),
    # numpy noise from Triton's interpreter on scalar loop bounds
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 32
REL = 2e-3
# The three default K/V candidates (config.py) plus a layout that drops its tail channels and
# uses 32-token groups (band widths are per 64 channels and scale with head_dim).
LAYOUTS = [
    ("band:b8=4,b4=44,b2=16,group=128", "band:b8=0,b4=48,b2=16,group=128"),
    ("band:b8=16,b4=48,b2=0,group=64", "band:b8=4,b4=60,b2=0,group=128"),
    ("band:b8=4,b4=60,b2=0,group=128", "band:b8=16,b4=48,b2=0,group=64"),
    ("band:b8=8,b4=24,b2=16,group=32", "band:b8=8,b4=24,b2=16,group=64"),
]


def make_layer(h: int, d: int, nseg: int, hot: int, seg: int = 128, first: int = 0,
               layouts=LAYOUTS, rotated: list | None = None) -> CompressedLayer:
    """A CompressedLayer with one basis block and the band layouts of `layouts` in turn (from
    `first`), built like compress_layer but with the strategy of each segment imposed. If
    `rotated` is a list, each segment's encoder input (k_rot, v_rot) [H, seg, D] is appended."""
    t = nseg * seg + hot
    spectrum = torch.exp(-torch.linspace(0, 2, d))[torch.randperm(d)] * 2
    k = (torch.randn(h, t, d) * spectrum + torch.randn(h, 1, d) * 0.5).to(torch.bfloat16)
    v = torch.randn(h, t, d).to(torch.bfloat16)
    kf, vf = k.float(), v.float()
    sealed = nseg * seg
    kb, vb = fit_basis(kf[:, :max(sealed, 1)]), fit_basis(vf[:, :max(sealed, 1)])
    layer = CompressedLayer(k_bases=[kb], v_bases=[vb], hot_start=sealed)
    for i in range(nseg):
        ks_spec, vs_spec = layouts[(first + i) % len(layouts)]
        ks, vs = parse_strategy(ks_spec), parse_strategy(vs_spec)
        part = slice(i * seg, (i + 1) * seg)
        k_rot, v_rot = rotate(kf[:, part], kb), rotate(vf[:, part], vb)
        if rotated is not None:
            rotated.append((k_rot, v_rot))
        kc = Choice(ks, Encoded("k", (h, seg, d), ks.encode(k_rot, "k")), 0.0, "within-budget")
        vc = Choice(vs, Encoded("v", (h, seg, d), vs.encode(v_rot, "v")), 0.0, "within-budget")
        layer.segments.append(Segment(i * seg, seg, kc, vc, 0, None, False,
                                      torch.zeros(6, dtype=torch.int32)))
    layer.hot_k = k[:, sealed:].contiguous()
    layer.hot_v = v[:, sealed:].contiguous()
    return layer


def reference(q: torch.Tensor, layers, keep: torch.Tensor | None, monkeypatch) -> torch.Tensor:
    """decode_attention per request (the query is the last token); `keep` [B, H, P] is imposed
    as the selector's page mask."""
    outs = []
    for b, layer in enumerate(layers):
        pages = sum(s.tokens for s in layer.segments) // PAGE
        mask = None if keep is None else keep[b:b + 1, :, :pages].cpu()
        monkeypatch.setattr(attention, "_select", lambda *a, _m=mask, **k: _m)
        out, _ = attention.decode_attention(q[b:b + 1].cpu(), layer,
                                            torch.tensor([layer.tokens() - 1]), None, PAGE)
        outs.append(out[0])
    return torch.stack(outs)


def random_keep(layers, h: int) -> torch.Tensor:
    """Per (request, KV head) page mask: about half the pages, one segment fully masked."""
    pages = [sum(s.tokens for s in layer.segments) // PAGE for layer in layers]
    keep = torch.zeros(len(layers), h, max(pages), dtype=torch.bool)
    for b, n in enumerate(pages):
        keep[b, :, :n] = torch.rand(h, n) < 0.5
        keep[b, :, :min(n, 1)] = True
        if n >= 8:
            keep[b, 0, 4:8] = False  # a whole segment skipped by head 0
    return keep


# ---- arena layout ----------------------------------------------------------------------------

def test_arena_holds_exact_encoded_bytes(seed):
    h, d = 2, 64
    layers = [make_layer(h, d, 3, 40), make_layer(h, d, 4, 70, first=1)]
    arena = pack_layer(layers)
    payload = sum(c.encoded.nbytes() for layer in layers for s in layer.segments
                  for c in (s.k, s.v))
    bd = arena.byte_breakdown()
    assert bd["codes"] + bd["scales"] == payload, repro(seed)
    assert bd["codes"] + bd["scales"] + bd["padding"] == arena.data.numel(), repro(seed)
    assert 0 <= bd["padding"] < 0.02 * arena.data.numel(), repro(seed)
    assert arena.seg_indptr.tolist() == [0, 3, 7] and arena.headers.shape[0] == 7
    # Every part of every (segment, head) reads back byte-exact through the header.
    n = 0
    for layer in layers:
        for seg in layer.segments:
            row = arena.headers[n].tolist()
            base = row[HDR["base16"]] * ALIGN
            assert row[HDR["tokens"]] == seg.tokens
            for kind, choice in (("k", seg.k), ("v", seg.v)):
                assert row[HDR[f"{kind}_group"]] == choice.strategy.group
                for name, t in choice.encoded.tensors.items():
                    off = row[HDR[f"{kind}_{name}"]]
                    assert off % ALIGN == 0
                    for head in range(h):
                        want = t[head].contiguous().view(torch.uint8).flatten()
                        at = base + head * row[HDR["head_stride"]] + off
                        got = arena.data[at:at + want.numel()]
                        assert torch.equal(got, want), f"{kind}.{name} head {head} {repro(seed)}"
            n += 1


def test_channel_plan_reads_every_code(seed):
    """Following a layout's per-channel plan through the arena bytes gives back exactly the
    codes, scales and zeros of the Encoded tensors (what stage 1 relies on)."""
    h, d = 2, 64
    layer = make_layer(h, d, len(LAYOUTS), 8)
    arena = pack_layer([layer])
    data = arena.data.long()
    f16 = arena.data.view(torch.float16).float()
    for n, seg in enumerate(layer.segments):
        row = arena.headers[n].tolist()
        plan = arena.plans[row[HDR["layout"]]].long()  # [2, fields, D]
        for k, choice in enumerate((seg.k, seg.v)):
            band = choice.strategy
            code, rowb, shift, mask, scale, zero, gbytes = plan[k, :7]
            kept = mask != 0
            want = torch.zeros(h, seg.tokens, d)
            want_s = torch.zeros(h, seg.tokens // band.group, d)
            want_z = torch.zeros_like(want_s)
            for start, nch, bits in band.bands(d):
                t = choice.encoded.tensors
                want[..., start:start + nch] = unpack_codes(t[f"codes{bits}"], bits).float()
                want_s[..., start:start + nch] = t[f"scale{bits}"].float()
                want_z[..., start:start + nch] = t[f"zero{bits}"].float()
            for head in range(h):
                base = row[HDR["base16"]] * ALIGN + head * row[HDR["head_stride"]]
                tok = torch.arange(seg.tokens)[:, None]
                got = (data[base + code + tok * rowb] >> shift) & mask
                assert torch.equal(got.float() * kept, want[head]), f"codes {k} {repro(seed)}"
                grp = torch.arange(seg.tokens // band.group)[:, None]
                # dropped channels point at arbitrary bytes (maybe a NaN pattern): where, not *
                got_s = torch.where(kept, f16[(base + scale + grp * gbytes) // 2], 0.0)
                got_z = torch.where(kept, f16[(base + zero + grp * gbytes) // 2], 0.0)
                assert torch.equal(got_s, want_s[head]) and torch.equal(got_z, want_z[head]), \
                    f"scales {k} {repro(seed)}"


def test_pack_rejects_what_the_kernel_cannot_read(seed):
    h, d = 2, 64
    k = torch.randn(h, 3 * 128 + 64, d).to(torch.bfloat16)
    v = torch.randn_like(k)
    # A sink segment stored lowbit in the raw basis.
    cfg = MosaicConfig(k_error_budget=10.0, v_error_budget=10.0, sink_error_budget=10.0,
                       sink_candidates=["lowbit:bits=8,group=32"])
    with pytest.raises(ValueError, match=r"segment 0 .*lowbit.*sink_candidates=\['band:b8=64"):
        pack_layer([compress_layer(k, v, cfg)])
    # Two basis blocks in one request.
    cfg = MosaicConfig(k_error_budget=10.0, v_error_budget=10.0, sink_segments=0,
                       basis_block_tokens=128)
    with pytest.raises(ValueError, match="one basis block per request"):
        pack_layer([compress_layer(k, v, cfg)])
    # Token groups smaller than a page.
    cfg = MosaicConfig(k_candidates=["band:b8=8,b4=56,b2=0,group=16"], k_error_budget=10.0,
                       v_error_budget=10.0, sink_segments=0)
    with pytest.raises(ValueError, match="group=16 is not a multiple of page_tokens=32"):
        pack_layer([compress_layer(k, v, cfg)])


# ---- kernel vs reference ---------------------------------------------------------------------

@pytest.mark.parametrize("selection,exact", [("none", True), ("mask", True), ("list", True),
                                             ("none", False), ("list", False),
                                             ("list-unpartitioned", True)])
def test_kernel_matches_reference(selection, exact, seed, monkeypatch):
    """With a page list (or mask) and several width classes, stage 1 reads the list grouped by
    class (`class_partition`); "list-unpartitioned": each class's launch walks the whole list."""
    h, g, d = 2, 2, 64
    layers = [make_layer(h, d, 3, 40), make_layer(h, d, 4, 70, first=1)]
    arena = pack_layer(layers).to(DEVICE)
    q = torch.randn(2, h * g, d) * 2
    keep = None if selection == "none" else random_keep(layers, h)
    expected = reference(q, layers, keep, monkeypatch)

    wrapper = BandDecodeWrapper()
    wrapper.plan(arena, h * g, num_kv_splits=2, exact=exact)
    assert wrapper.partition and len(wrapper.widths) > 1, repro(seed)
    wrapper.partition = selection != "list-unpartitioned"
    kwargs = {}
    if selection == "mask":
        kwargs["page_keep"] = keep.to(DEVICE)
    elif selection.startswith("list"):
        ids, counts = keep_to_page_list(keep)
        kwargs.update(page_ids=ids[:, :, :int(counts.max())].contiguous().to(DEVICE),
                      page_counts=counts.to(DEVICE))
    out = wrapper.run(q.to(DEVICE), arena, **kwargs)
    assert out.dtype == torch.float32
    # exact: ~1e-5; fp16 products: ~2^-11 per product
    assert_rel_close(out.cpu(), expected, 1e-4 if exact else REL, f"band decode ({selection})",
                     seed)
    # the running read count (server stats' selection): the kept pages, per KV head
    pages = sum(sum(s.tokens for s in layer.segments) // PAGE for layer in layers) * h
    assert wrapper.page_reads() == (pages, pages if keep is None else int(keep.sum())), \
        (wrapper.page_reads(), pages, repro(seed))

    read = wrapper.bytes_read(arena, keep)
    if keep is not None:
        full = wrapper.bytes_read(arena)
        assert read["codes"] < full["codes"] and read["selection"] > 0, repro(seed)
    assert read["total"] == sum(v for key, v in read.items() if key != "total")


@pytest.mark.parametrize("block", [64, 128])
def test_kernel_reads_larger_blocks(block, seed, monkeypatch):
    """Without selection, stage 1 walks blocks of up to 128 tokens when every token group
    allows it (here: groups of >= 64 tokens, or 128 only)."""
    h, g, d = 2, 2, 64
    layouts = LAYOUTS[:3] if block == 64 else [
        ("band:b8=4,b4=44,b2=16,group=128", "band:b8=0,b4=48,b2=16,group=128"),
        ("band:b8=8,b4=40,b2=0,group=128", "band:b8=4,b4=60,b2=0,group=128")]
    layers = [make_layer(h, d, 3, 40, layouts=layouts),
              make_layer(h, d, 2, 9, first=1, layouts=layouts)]
    arena = pack_layer(layers).to(DEVICE)
    q = torch.randn(2, h * g, d) * 2
    wrapper = BandDecodeWrapper()
    wrapper.plan(arena, h * g, num_kv_splits=2)
    assert wrapper.block_n == block
    out = wrapper.run(q.to(DEVICE), arena)
    assert_rel_close(out.cpu(), reference(q, layers, None, monkeypatch), REL,
                     f"blocks of {block}", seed)


def test_hot_partial_and_pipeline(seed, monkeypatch):
    """A precomputed hot partial gives the same output; compress_layer's own output (band sink,
    chooser's pick, page metadata) packs and matches with the reference's own page selection."""
    h, g, d = 2, 2, 64
    cfg = MosaicConfig(sink_candidates=["band:b8=64,b4=0,b2=0,group=32"],
                       k_error_budget=10.0, v_error_budget=10.0, sink_error_budget=10.0,
                       select=SelectionConfig(budget_tokens=128, sink_tokens=32,
                                              recent_tokens=32, meta_channels=8))
    layers, keeps = [], []
    q = torch.randn(2, h * g, d) * 2
    for b, t in enumerate((4 * 128 + 70, 3 * 128 + 100)):
        k = (torch.randn(h, t, d) * torch.exp(-torch.linspace(0, 2, d)) * 3).to(torch.bfloat16)
        layers.append(compress_layer(k, torch.randn(h, t, d).to(torch.bfloat16), cfg))
    for b, layer in enumerate(layers):
        _, info = attention.decode_attention(q[b:b + 1], layer, torch.tensor([layer.tokens() - 1]),
                                             cfg.select, PAGE)
        keeps.append(info.page_keep[0])
    keep = torch.zeros(2, h, max(kp.shape[1] for kp in keeps), dtype=torch.bool)
    for b, kp in enumerate(keeps):
        keep[b, :, :kp.shape[1]] = kp
    assert 0 < int(keep.sum()) < keep.numel(), "selection should drop some pages"
    expected = reference(q, layers, keep, monkeypatch)

    arena = pack_layer(layers).to(DEVICE)
    wrapper = BandDecodeWrapper()
    wrapper.plan(arena, h * g, num_kv_splits=3)
    out = wrapper.run(q.to(DEVICE), arena, page_keep=keep.to(DEVICE))
    assert_rel_close(out.cpu(), expected, REL, "pipeline layer", seed)

    # Hot partial computed here in torch (scores scaled by sm_scale, raw basis).
    qs = q.float() * d ** -0.5
    m = torch.empty(2, h * g)
    l, acc = torch.empty(2, h * g), torch.empty(2, h * g, d)
    for b, layer in enumerate(layers):
        kk = layer.hot_k.float().repeat_interleave(g, 0)
        vv = layer.hot_v.float().repeat_interleave(g, 0)
        s = torch.einsum("hd,htd->ht", qs[b], kk)
        m[b] = s.amax(-1)
        p = torch.exp(s - m[b, :, None])
        l[b], acc[b] = p.sum(-1), torch.einsum("ht,htd->hd", p, vv)
    given = wrapper.run(q.to(DEVICE), arena, page_keep=keep.to(DEVICE),
                        hot_partial=(m.to(DEVICE), l.to(DEVICE), acc.to(DEVICE)))
    assert_rel_close(given.cpu(), expected, REL, "given hot partial", seed)


def test_wrapper_rejects_misuse(seed):
    h, g, d = 2, 2, 64
    arena = pack_layer([make_layer(h, d, 1, 8)]).to(DEVICE)
    wrapper = BandDecodeWrapper()
    q = torch.randn(1, h * g, d, device=DEVICE)
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(q, arena)
    with pytest.raises(ValueError, match="do not group evenly"):
        wrapper.plan(arena, 3)
    wrapper.plan(arena, h * g)
    with pytest.raises(ValueError, match=r"q must be float32/bf16/fp16 \[1, 4, 64\]"):
        wrapper.run(q[:, :2], arena)
    with pytest.raises(ValueError, match="q must be"):
        wrapper.run(q.to(torch.int32), arena)
    with pytest.raises(ValueError, match="page_keep must be bool"):
        wrapper.run(q, arena, page_keep=torch.ones(1, h, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="past a request's last compressed page"):
        wrapper.run(q, arena, page_keep=torch.ones(1, h, 8, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="page_ids and page_counts go together"):
        wrapper.run(q, arena, page_ids=torch.zeros(1, h, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="hot_partial m must be float32"):
        wrapper.run(q, arena, hot_partial=(q, q, q))
    other = pack_layer([make_layer(h, d, 1, 8), make_layer(h, d, 1, 8)]).to(DEVICE)
    with pytest.raises(ValueError, match="call plan"):
        wrapper.run(q, other)
    with pytest.raises(TypeError, match="PackedArena"):
        wrapper.plan(object(), h * g)


def test_nan_never_passes(seed):
    """The comparison helper rejects a NaN output (guards the checks above)."""
    out = torch.randn(2, 4, 64)
    bad = out.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(AssertionError):
        assert_rel_close(bad, out, REL, "nan", seed)
    with pytest.raises(AssertionError):
        assert_finite(bad, "nan", seed)


# ---- device ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d,h,g", [(128, 8, 4), (64, 3, 3)])
def test_kernel_matches_reference_gpu(d, h, g, seed, monkeypatch):
    nsegs = (12, 16, 5, 9)
    layers = [make_layer(h, d, n, 30 + 41 * b, first=b) for b, n in enumerate(nsegs)]
    arena = pack_layer(layers).to("cuda")
    q = (torch.randn(len(nsegs), h * g, d) * 2).to(torch.bfloat16)
    keep = random_keep(layers, h)
    for sel in (None, keep):
        expected = reference(q.float(), layers, sel, monkeypatch)
        for splits in (None, 1, 7):
            wrapper = BandDecodeWrapper()
            wrapper.plan(arena, h * g, num_kv_splits=splits)
            out = wrapper.run(q.cuda(), arena, out_dtype=torch.float32,
                              page_keep=None if sel is None else sel.cuda())
            torch.cuda.synchronize()
            assert_rel_close(out.cpu(), expected, REL,
                             f"gpu d={d} splits={splits} select={sel is not None}", seed)
