"""A weight update handed to vLLM's worker processes as files ("mp" and "ray" executors, rl.generation.vllm_engine):
collective_rpc would pickle tensors into plain lists (stack-notes §8), so the engine writes the update once
as a safetensors file under /dev/shm, which every worker on this host reads back (`staged_tensors`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import numpy as np

from m3jax.hf.safetensors_io import StreamingWriter
from rl.generation.torch_arrays import to_numpy

STAGING_ROOT = "/dev/shm"  # RAM-backed: the workers read the update without touching a disk


@contextlib.contextmanager
def staged_checkpoint(items: list[tuple[str, np.ndarray]], root: str = STAGING_ROOT):
    """A directory holding `items` as one safetensors file, for the life of the block.

    Written under a temporary name and renamed when complete, so a reader never sees a partial file;
    removed on exit whatever happened.
    """
    root = root if os.path.isdir(root) else tempfile.gettempdir()
    arrays = [(name, to_numpy(a)) for name, a in items]  # torch tensors too: buckets received on a device
    need, free = sum(a.nbytes for _, a in arrays), shutil.disk_usage(root).free
    if need > free:  # containers often mount a 64 MB /dev/shm: say so instead of failing mid-write
        raise OSError(f"weight update of {need / 2**20:.0f} MiB does not fit in {root} ({free / 2**20:.0f} MiB "
                      "free); enlarge it (docker --shm-size) or use the in-process executor")
    tmp = tempfile.mkdtemp(prefix=".m3jax-update-", dir=root)
    final = tmp.replace(".m3jax-update-", "m3jax-update-")
    try:
        writer = StreamingWriter(os.path.join(tmp, "model.safetensors"),
                                 [(name, a.dtype, a.shape) for name, a in arrays])
        for name, a in arrays:
            writer.write(name, a)
        writer.close()
        os.rename(tmp, final)
        yield final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)


def staged_tensors(path: str):
    """(name, torch tensor) of every tensor in the safetensors files of a staged directory: views of the
    files' pages (RAM-backed under /dev/shm), so a worker copies only the slice its rank keeps. Every header
    is checked (offsets inside the file) before its first tensor is handed out."""
    from m3jax.hf.safetensors_io import read_header
    from rl.generation.torch_arrays import to_torch

    for f in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        file = os.path.join(path, f)
        infos = read_header(file)
        pages = np.memmap(file, dtype=np.uint8, mode="c")  # copy on write: a loader writing into it cannot fault
        for name, info in infos.items():
            yield name, to_torch(pages[info.start:info.end].view(info.np_dtype).reshape(info.shape))
