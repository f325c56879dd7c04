"""Triton kernels on MosaicKV packed layouts (imported as `mosaickv_kernels`)."""
