"""The serving layers, bottom up: segment_store -> pool -> radix; packed_decode / graph_decode -> backend (mosaickv_sglang/README.md)."""
