"""Benchmarks, run as ``python -m flashref.bench <suite>``; never part of the timed unit tests.

The main suites (``python -m flashref.bench --help`` lists all sixteen, each with its notebook):
- ``numpy``  tiled NumPy forward against naive NumPy attention: time and peak memory over N (CPU)
- ``gpu``    the GPU kernels against PyTorch's attention backends, in one run (CUDA)
- ``hbm``    HBM and L2 bytes of every kernel, counted by Nsight Compute, and the block-size sweep (CUDA, ncu)
- ``features`` grouped-query attention and dropout against SDPA, block-sparse time against density (CUDA)
- ``mods``   sliding window, softcap and ALiBi against FlexAttention and SDPA; packed batches against padding (CUDA)
- ``model``  the GPT of :mod:`flashref.model` trained and timed with each attention (CUDA)
- ``cupy``   the CuPy kernels next to SDPA's flash backend (CUDA, CuPy)
- ``ring``   ring attention on every visible GPU against one GPU: throughput, longest sequence, timeline (CUDA, NCCL)
- ``decode`` flash-decoding (split keys) against the unsplit kernel and SDPA, one query against a long KV cache (CUDA)

What they share lives in :mod:`flashref.bench.results`: the loader of the committed results under
``book/data/``, the saver, the versions recorded beside every measurement, and the FLOP count.
"""
