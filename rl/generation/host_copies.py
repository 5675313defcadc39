"""Host-to-host tensor copies at memcpy speed while vLLM's loaders write a weight update (issue 12 item 3).

vLLM's weight loaders write each received tensor with `Tensor.copy_`. On the CPU, a CPU engine pins its
OpenMP threads to its cores at start, so torch copies with one thread, and its copy kernel writes through the
cache: 6.8-7.0 GB/s here, against 12.7-12.8 GB/s for numpy's `copyto` (glibc's memcpy, whose large copies
use non-temporal stores), measured inside a started engine (BENCHMARKS.md, issue 12, session 24). The 1 GB
bench model's loaders spent 0.16 s of a 0.22 s apply in those copies.

`memcpy_copies()` is a torch function mode: inside it, a `copy_` between two CPU tensors of one dtype and one
shape, large enough to matter, goes through numpy on the same memory, split over the process's cores when both
are contiguous (1 GB into a mapped file here: 11.5 GB/s on one thread, 22.3 on two: one thread does not reach
the memory's bandwidth); every other call (a device, a dtype cast, a broadcast, autograd) runs as torch would. The bytes written
are the same; only the store path differs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os

import numpy as np

# Below this a copy is a few microseconds either way, and the mode's checks would be most of it.
MIN_BYTES = 1 << 20


def _int_view(t):
    """The tensor's bytes as a numpy array of same-sized integers (numpy has no bfloat16), on its memory."""
    import torch

    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(as_int).numpy()


class _Threads(concurrent.futures.ThreadPoolExecutor):
    def __init__(self, workers: int):
        super().__init__(workers, thread_name_prefix="m3jax-copy")
        self.workers = workers


def _copy(dst: np.ndarray, src: np.ndarray, pool: _Threads | None) -> None:
    """dst[...] = src; contiguous arrays in one piece per thread of `pool` (None: this thread). Arrays that
    may overlap are copied whole by numpy, which copies overlapping memory as if through a temporary."""
    if (pool is None or not (dst.flags.c_contiguous and src.flags.c_contiguous)
            or np.may_share_memory(dst, src)):
        np.copyto(dst, src, casting="no")
        return
    d, s = dst.reshape(-1), src.reshape(-1)
    step = -(-d.size // pool.workers)
    list(pool.map(lambda i: np.copyto(d[i:i + step], s[i:i + step], casting="no"), range(0, d.size, step)))


def _numpy_copy(dst, src, pool=None) -> bool:
    """Copy src into dst with numpy when both are plain CPU tensors of one dtype and shape; whether it did."""
    import torch

    if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)):
        return False
    if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype or dst.shape != src.shape
            or dst.is_complex() or dst.element_size() not in (1, 2, 4, 8)
            or dst.numel() * dst.element_size() < MIN_BYTES or dst.requires_grad or torch.is_grad_enabled()):
        return False
    if type(dst) not in (torch.Tensor, torch.nn.Parameter) or type(src) not in (torch.Tensor, torch.nn.Parameter):
        return False  # a tensor subclass may define copy_ itself
    _copy(_int_view(dst), _int_view(src), pool)
    return True


@contextlib.contextmanager
def memcpy_copies():
    """Within the block, large same-dtype CPU `Tensor.copy_` calls run through numpy (see the module doc).
    The mode is per thread: other threads' torch calls are untouched."""
    import torch
    from torch.overrides import TorchFunctionMode

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    pool = _Threads(min(cores, 8)) if cores > 1 else None

    class _MemcpyCopies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func is torch.Tensor.copy_ and len(args) == 2 and not kwargs.get("non_blocking")
                    and _numpy_copy(args[0], args[1], pool)):
                return args[0]
            return func(*args, **kwargs)

    try:
        with _MemcpyCopies():
            yield
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
