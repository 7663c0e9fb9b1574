"""flashref: a course and a reference implementation of FlashAttention.

Modules, one idea each (import the one you need; the GPU ones import torch, triton or cupy lazily):

- ``flashref.reference``      standard attention in NumPy, forward and backward (the float64 ground truth)
- ``flashref.online_softmax`` the running max / running sum recurrence and the exact merge of two states
- ``flashref.numpy_flash``    tiled FlashAttention forward (two loop orders) and backward, in NumPy
- ``flashref.iomodel``        a simulated SRAM/HBM that counts the IO of standard and tiled attention
- ``flashref.hbm``            the bytes each GPU kernel launch loads and stores, as the hardware counts them
- ``flashref.cupy``           CUDA C kernels launched with CuPy
- ``flashref.triton``         Triton forward and backward as a ``torch.autograd.Function``
- ``flashref.bench``          the benchmark harness (``python -m flashref.bench``)
- ``flashref.exercises``      checkers for the notebooks' exercises
- ``flashref.tolerance``      the one low-precision tolerance rule every test and notebook uses
- ``flashref.validation``     input checks shared by every implementation
"""

__version__ = "0.1.0"

#: The course repository (the same URL as _config.yml's repository.url; a test keeps them equal). Code
#: that runs on Colab, where only the package is installed, fetches committed data from it.
REPOSITORY_URL = "https://github.com/flashref/flashref"
