"""flashref: a course and a reference implementation of FlashAttention.

Modules, one idea each (import the one you need; the GPU ones import torch, triton or cupy lazily):

- ``flashref.reference``      standard attention in NumPy, forward and backward (the float64 ground truth)
- ``flashref.online_softmax`` the running max / running sum recurrence and the exact merge of two states
- ``flashref.numpy_flash``    tiled FlashAttention forward (two loop orders) and backward, in NumPy
- ``flashref.iomodel``        a simulated SRAM/HBM that counts the IO of standard and tiled attention
- ``flashref.hbm``            the bytes each GPU kernel launch loads and stores, as the hardware counts them
- ``flashref.kernel_tiles``   which tiles each program of the GPU kernels visits (pure Python)
- ``flashref.tile_walk``      the animated walk over the tile grid, drawn from numpy_flash and iomodel
- ``flashref.tile_plots``     pictures of the tile grid: which tiles a pass visits, in which order
- ``flashref.block_masks``    block masks for block-sparse attention: sliding window, BigBird, causal
- ``flashref.score_mods``     score and mask modifications: a token window, tanh soft-capping, ALiBi
- ``flashref.window_tiles``   which tiles a token window lets the kernels skip, in plain Python
- ``flashref.varlen``         packed batches of documents of different lengths (``cu_seqlens``)
- ``flashref.cupy``           CUDA C kernels launched with CuPy
- ``flashref.triton``         Triton forward and backward as a ``torch.autograd.Function`` (and a custom op)
- ``flashref.torch_attention`` attention in plain PyTorch: the baseline, SDPA, a sliding window, Performer
- ``flashref.model``          a small GPT trained on tiny Shakespeare with any of those attentions
- ``flashref.ring_attention`` exact attention over a sequence sharded across GPUs (a ring over torch.distributed)
- ``flashref.fp8``            FP8 (e4m3) inputs with per-block scales and incoherent processing, as FlashAttention-3
- ``flashref.hopper_timeline`` a schedule model of one H100 SM's units, one picture per idea of FlashAttention-3
- ``flashref.bench``          the benchmark harness (``python -m flashref.bench``)
- ``flashref.exercises``      checkers for the notebooks' exercises
- ``flashref.tolerance``      the one low-precision tolerance rule every test and notebook uses
- ``flashref.validation``     input checks shared by every implementation
- ``flashref.notebook``       small helpers the notebooks share (show the package's source, name the device)
- ``flashref.run_notebooks``  executes and stamps the notebooks; ``flashref.publish`` sets the repository URL
"""

__version__ = "0.1.0"

#: The course repository (the same URL as _config.yml's repository.url; a test keeps them equal). Code
#: that runs on Colab, where only the package is installed, fetches committed data from it.
REPOSITORY_URL = "https://github.com/flashref/flashref"
#: Its branch (_config.yml's repository.branch), from which Colab fetches the committed data.
REPOSITORY_BRANCH = "main"
