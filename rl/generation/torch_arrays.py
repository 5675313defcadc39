"""numpy arrays handed to torch (vLLM's loaders) without a copy.

Its own module because the sender side (the slice probe), the worker extension and the engine actor all
hand arrays to vLLM, and none of them may import another for it (tests/test_layers.py: no cycles).
"""

from __future__ import annotations

import numpy as np


def to_torch(array):
    """A numpy array as a torch tensor on the same memory (bfloat16 from ml_dtypes by its bits)."""
    import warnings

    import torch

    a = np.asarray(array)
    if a.dtype.name == "bfloat16":  # ml_dtypes: torch cannot read it, the bits are the same
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays (from JAX): vLLM only copies out of them
        return torch.from_numpy(a)
