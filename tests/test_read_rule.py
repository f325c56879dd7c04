"""The read rule and its prefill path without a server (docs/determinism.md).

* `chunk_attention` equals a per-query reference: query t reads the first read[t] pages
  compressed and the dense tokens from page read[t] up to itself;
* pages sealed layer by layer inside a prefill forward (`plan_chunk_seal` / `seal_chunk_layer` /
  `finish_chunk_seal`) are the same bytes as the same pages sealed whole after it
  (`seal_request`), whatever pages are sealed together: a block's bases come from its first page;
* a chunked prefill reads the same K/V at every position whatever the chunk boundaries.
"""
from types import SimpleNamespace

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from mosaickv_sglang.serving.prefill_attention import chunk_attention
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.pool import MosaicKVPool

PS, H, D, LAYERS = 128, 2, 64, 2


def _reference(q, kc, vc, kd, vd, first, read, ja, page, scale):
    group = q.shape[0] // kc.shape[0]
    out = torch.empty_like(q)
    for i in range(q.shape[1]):
        t, j = first + i, int(read[i])
        keys = torch.cat([kc[:, :j * page], kd[:, (j - ja) * page:t + 1 - ja * page]], 1)
        vals = torch.cat([vc[:, :j * page], vd[:, (j - ja) * page:t + 1 - ja * page]], 1)
        keys, vals = keys.repeat_interleave(group, 0), vals.repeat_interleave(group, 0)
        out[:, i] = scaled_dot_product_attention(q[None, :, i:i + 1], keys[None], vals[None],
                                                 scale=scale)[0, :, 0]
    return out


@pytest.mark.parametrize("first,n,hot", [(0, 300, 0), (256, 200, 0), (384, 256, 64), (512, 40, 0)])
def test_chunk_attention_matches_per_query_reference(first, n, hot, seed):
    g = torch.Generator().manual_seed(seed)
    page, hq, hk, d = 32, 4, 2, 16
    last = first + n - 1
    rule = lambda t: max(t - hot, 0) // page  # noqa: E731
    ja, jc = rule(first), rule(last)
    q = torch.randn(hq, n, d, generator=g)
    kc, vc = (torch.randn(hk, jc * page, d, generator=g) for _ in range(2))
    kd, vd = (torch.randn(hk, first + n - ja * page, d, generator=g) for _ in range(2))
    read = torch.tensor([rule(t) for t in range(first, first + n)])
    got = chunk_attention(q, kc, vc, kd, vd, first, read, ja, page, 0.25)
    want = _reference(q, kc, vc, kd, vd, first, read, ja, page, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                               msg=f"seed {seed}, chunk [{first}, {first + n})")


def make_pool(**cfg) -> MosaicKVPool:
    return MosaicKVPool(40 * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=MosaicConfig(hot_buffer_fraction=0.5, read_rule="position",
                                                   basis_fit="first_page", **cfg))


def _write(pool, slots, k, v, layer_id):
    pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots, k, v)


def _prefill(pool, slots, kv, chunks):
    """Run a prefill of `slots` in `chunks` (end positions) the way the backend does: write each
    layer, seal the chunk's pages layer by layer, read, install, then seal after the forward.
    Returns per chunk and layer what each query read: (Kc, Kd, ja, read)."""
    seen, start = [], 0
    for end in chunks:
        pages = (slots[:end:PS] // PS).tolist()
        cs = None
        for layer_id in range(LAYERS):
            k, v = kv[layer_id]
            _write(pool, slots[start:end], k[start:end], v[start:end], layer_id)
            if layer_id == 0:
                cs = pool.plan_chunk_seal([(pages, end - 1, None)])
            fresh = {} if cs is None else pool.seal_chunk_layer(cs, layer_id)
            kc, vc, kd, vd, jc, ja = pool.chunk_kv(layer_id, slots[:end], start, fresh)
            seen.append((start, end, layer_id, kc.clone(), kd.clone(), ja))
        if cs is not None:
            pool.finish_chunk_seal(cs)
        pool.seal_request(slots[:end], end)
        start = end
    return seen


def _segments_bytes(pool, pages):
    """Every tensor a sealed page keeps (each layer's K and V codes, scales, page metadata,
    header, and the bases), with its strategy spec."""
    out = []
    for p in pages:
        sp = pool.sealed[p]
        for seg in sp.segments:
            for c in (seg.k, seg.v):
                out.append((c.strategy.spec, dict(c.encoded.tensors)))
            out.append(seg.header)
            if seg.pages is not None:
                out.append({k: t for k, t in vars(seg.pages).items()
                            if isinstance(t, torch.Tensor)})
        out.append(torch.stack(sp.bases.k + sp.bases.v))
    return out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("chunks", [[1300], [512, 1024, 1300], [200, 700, 1300]])
def test_prefill_reads_and_seals_the_same_whatever_the_chunks(chunks, seed):
    """Default codec, hot_tokens 0: chunkings of one prompt seal identical pages and every query
    reads identical K/V (compressed prefix as it reads back + its own page dense)."""
    g = torch.Generator().manual_seed(seed)
    n = chunks[-1]
    kv = [(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))
          for _ in range(LAYERS)]
    results = {}
    for name, ch in (("whole", [n]), ("chunked", chunks)):
        pool = make_pool(hot_tokens=0)
        slots = torch.arange(PS, PS + n)  # logical pages 1.. (0 is padding)
        seen = _prefill(pool, slots, kv, ch)
        full_pages = (slots[: n // PS * PS: PS] // PS).tolist()
        assert pool.sealed_prefix(full_pages) == n // PS, "every full page sealed after the prompt"
        # what the last token of each page would read compressed (Kc prefix) at layer 0..L-1
        reads = {}
        for start, end, layer_id, kc, kd, ja in seen:
            for t in range(start, end):
                j = max(t, 0) // PS
                reads[(t, layer_id)] = kc[:j * PS]
        results[name] = (_segments_bytes(pool, full_pages), reads)
    assert _equal(results["whole"][0], results["chunked"][0]), f"sealed bytes differ (seed {seed})"
    whole, chunked = results["whole"][1], results["chunked"][1]
    for key in whole:
        assert torch.equal(whole[key], chunked[key]), f"position/layer {key} reads differ (seed {seed})"


@pytest.mark.parametrize("rule,hot", [("position", 0), ("position", 64), ("chunk", 64)])
def test_chunk_reads_follow_the_read_rule(rule, hot):
    """What each token of a chunk reads compressed: compressed_pages(t), never below what the
    chunk's first token reads; under the chunk rule, what the first token reads."""
    pool = MosaicKVPool(40 * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=MosaicConfig(read_rule=rule, hot_tokens=hot,
                                                   basis_fit="first_page" if rule == "position"
                                                   else "group"))
    first, end, ja = 300, 900, 3
    want = [ja if rule == "chunk" else max(pool.compressed_pages(t), ja)
            for t in range(first, end)]
    assert pool.chunk_reads(first, end, ja).tolist() == want


@pytest.mark.parametrize("cfg", [{}, {"k_error_budget": 1e-6}], ids=["default", "k-fallback"])
def test_a_chunk_reads_its_fresh_pages_as_they_read_back_once_sealed(cfg, seed):
    """`seal_chunk_layer`'s read-back (the chooser's reconstructions, unrotated in one batch
    per basis block) is bit for bit what each page reads back once installed (`decompress`,
    the codec per segment), sink page, rotated and unrotated (dense fallback) segments and two
    basis blocks included."""
    g = torch.Generator().manual_seed(seed)
    pool = make_pool(hot_tokens=0, basis_block_tokens=4 * PS, **cfg)
    n = 9 * PS + 5
    slots = torch.arange(PS, PS + n)
    for layer_id in range(LAYERS):
        k = torch.randn(n, H, D, generator=g) * (1 + torch.arange(D) % 5)
        _write(pool, slots, k, torch.randn(n, H, D, generator=g), layer_id)
    pages = (slots[::PS] // PS).tolist()
    cs = pool.plan_chunk_seal([(pages, n - 1, None)])
    assert len(cs.pages) == 9 and len(cs.groups) == 3
    fresh = [pool.seal_chunk_layer(cs, layer_id) for layer_id in range(LAYERS)]
    kinds = set()
    pool.finish_chunk_seal(cs)
    for layer_id in range(LAYERS):
        kc, vc = pool.decompress(layer_id, cs.pages)
        for i, p in enumerate(cs.pages):
            rows = slice(i * PS, (i + 1) * PS)
            fk, fv = fresh[layer_id][p]
            assert torch.equal(fk, kc[rows]) and torch.equal(fv, vc[rows]), \
                f"seed {seed}, layer {layer_id}, page {p}: read back differently once sealed"
            seg = pool.sealed[p].segments[layer_id]
            kinds |= {seg.k.strategy.rot, seg.v.strategy.rot}
    if cfg:
        assert kinds == {True, False}, kinds  # both kinds of segment were read back


def test_a_chunk_past_its_rotated_budget_installs_the_same_bytes(monkeypatch, seed):
    """Layers of a prefill chunk's seal past `CHUNK_ROTATED_BYTES` keep no rotated K/V and
    install by torch copies (counted): the arena holds the same bytes as with every layer
    packed by the kernel (interpreted here)."""
    from mosaickv_sglang.serving import pool as pool_mod
    g = torch.Generator().manual_seed(seed)
    n = 5 * PS + 7
    kv = [(torch.randn(n, H, D, generator=g) * (1 + torch.arange(D) % 5),
           torch.randn(n, H, D, generator=g)) for _ in range(LAYERS)]
    one_layer = (n // PS) * H * PS * D * 8  # float32 K and V of one layer's sealed pages
    stores = {}
    for name, budget in (("all", 1 << 40), ("first", one_layer)):
        monkeypatch.setattr(pool_mod, "CHUNK_ROTATED_BYTES", budget)
        pool = make_pool(hot_tokens=0, pack_kernel="triton")
        slots = torch.arange(PS, PS + n)
        pages = (slots[::PS] // PS).tolist()
        cs = None
        for layer_id in range(LAYERS):
            _write(pool, slots, *kv[layer_id], layer_id)
            if layer_id == 0:
                cs = pool.plan_chunk_seal([(pages, n - 1, None)])
            pool.seal_chunk_layer(cs, layer_id)
        pool.finish_chunk_seal(cs)
        stores[name] = pool.store
    a, b = stores["all"], stores["first"]
    assert a.pack_counts["no_rotated"] == 0 and a.pack_counts["kernel"] > 0
    assert b.pack_counts["no_rotated"] > 0 and b.pack_counts["kernel"] > 0  # layer 0 kept
    for layer in range(LAYERS):
        top = a.top[layer]
        assert top == b.top[layer] and torch.equal(a.data[layer][:top], b.data[layer][:top]), \
            f"seed {seed}, layer {layer}: the copied layer's bytes differ from the packed ones"
        assert torch.equal(a.headers[layer], b.headers[layer])
