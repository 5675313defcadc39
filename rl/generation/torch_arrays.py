"""numpy arrays handed to torch (vLLM's loaders) without a copy.

Its own module because the sender side (the slice probe), the worker extension and the engine actor all
hand arrays to vLLM, and none of them may import another for it (tests/test_layers.py: no cycles).
"""

from __future__ import annotations

import numpy as np


def to_torch(array):
    """A numpy array as a torch tensor on the same memory (bfloat16 from ml_dtypes by its bits); a torch tensor
    (a bucket received on a device, rl.generation.collective) as it is."""
    import warnings

    import torch

    if isinstance(array, torch.Tensor):
        return array
    a = np.asarray(array)
    if a.dtype.name == "bfloat16":  # ml_dtypes: torch cannot read it, the bits are the same
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays (from JAX): vLLM only copies out of them
        return torch.from_numpy(a)


def torch_dtype(dtype) -> "torch.dtype":  # noqa: F821 - torch is imported on use
    """The torch dtype of a numpy one (ml_dtypes' bfloat16 included)."""
    import torch

    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype)).dtype


def numpy_dtype(array) -> np.dtype:
    """The numpy dtype of a numpy array or of a torch tensor (bfloat16 as ml_dtypes')."""
    import torch

    if not isinstance(array, torch.Tensor):
        dtype = getattr(array, "dtype", None)  # a JAX array's: read without fetching the array to the host
        return np.dtype(dtype) if isinstance(dtype, np.dtype) else np.asarray(array).dtype
    if array.dtype == torch.bfloat16:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty(0, dtype=array.dtype).numpy().dtype


def to_numpy(array) -> np.ndarray:
    """A torch tensor as a host numpy array (a copy when it is on a device; bfloat16 as ml_dtypes'); anything
    else through np.asarray."""
    import torch

    if not isinstance(array, torch.Tensor):
        return np.asarray(array)
    host = array.detach().cpu()
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(numpy_dtype(host))
    return host.numpy()


def device_tensor(array):
    """A JAX array as a torch tensor on the same device memory (DLPack, no copy); one spread over several
    devices (a sharded parameter) is first brought to one of them by JAX. Torch tensors pass as they are,
    numpy arrays as `to_torch`."""
    import torch

    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        return to_torch(array)
    import jax

    devices = array.devices()
    if len(devices) > 1:
        array = jax.device_put(array, min(devices, key=lambda d: d.id))
    # JAX computes on streams of its own: the slice or transfer above may still be running
    return torch.from_dlpack(jax.block_until_ready(array))
