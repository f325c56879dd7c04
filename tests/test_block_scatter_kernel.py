"""triton_kernels/block_scatter.py: a page's per-layer blocks into each layer's arena by one
launch vs `scatter_blocks_reference` (the slices + `_foreach_copy_` SegmentStore.adopt used), on
fresh random bytes; nothing outside the blocks written; bad blocks refused."""
import pytest
import torch

from mosaickv_kernels.block_scatter import BlockScatter, scatter_blocks_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)


@pytest.mark.parametrize("layers,capacity", [(1, 256), (4, 8192), (7, 20000)])
def test_scatter_matches_reference(layers, capacity):
    seed = int(torch.randint(0, 2**31, ()))
    gen = torch.Generator().manual_seed(seed)
    sizes = [16 * int(torch.randint(1, capacity // 32, (), generator=gen)) for _ in range(layers)]
    bases = [16 * int(torch.randint(0, (capacity - s) // 16 + 1, (), generator=gen))
             for s in sizes]
    pad = 64  # src holds more than the blocks (as a loaded page's blob does)
    src = torch.randint(0, 256, (sum(sizes) + pad,), dtype=torch.uint8, generator=gen).to(DEVICE)
    fill = torch.randint(0, 256, (layers, capacity), dtype=torch.uint8, generator=gen).to(DEVICE)
    got = [fill[i].clone() for i in range(layers)]
    want = [fill[i].clone() for i in range(layers)]
    BlockScatter(got)(src, bases, sizes)
    scatter_blocks_reference(want, src, bases, sizes)
    for layer in range(layers):
        assert torch.equal(got[layer], want[layer]), f"seed {seed}: layer {layer} differs"
        assert not torch.equal(got[layer], fill[layer]), f"seed {seed}: layer {layer} unwritten"


def test_scatter_refuses_bad_blocks():
    arenas = [torch.zeros(64, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    scatter = BlockScatter(arenas)
    src = torch.zeros(128, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        scatter(src, [0, 56], [16, 16])
    with pytest.raises(ValueError, match="does not fit"):
        scatter(src, [0, 2], [16, 16])
    with pytest.raises(ValueError, match="a base and a size"):
        scatter(src, [0], [16])
    with pytest.raises(ValueError, match="src has 112"):
        scatter(src[:112], [0, 0], [64, 64])
    with pytest.raises(ValueError, match="1-D"):
        BlockScatter([torch.zeros(4, 16, dtype=torch.uint8, device=DEVICE)])
