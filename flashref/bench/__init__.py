"""Benchmarks, run as ``python -m flashref.bench <suite>``; never part of the timed unit tests.

Suites:
- ``numpy``  tiled NumPy forward against naive NumPy attention: time and peak memory over N (CPU)
- ``gpu``    the GPU kernels against PyTorch's attention backends, in one run (CUDA)
- ``hbm``    HBM and L2 bytes of every kernel, counted by Nsight Compute, and the block-size sweep (CUDA, ncu)
- ``features`` grouped-query attention and dropout against SDPA, block-sparse time against density (CUDA)
"""
