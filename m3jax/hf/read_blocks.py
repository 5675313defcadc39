"""A parameter built from the blocks this process's devices hold, reading only those bytes of the checkpoint.

On a multi-host mesh each process addresses only its own devices' shards: an expert placed on another host, the
other hosts' FSDP rows. Reading every tensor on every process (and handing the whole of it to `device_put`, which
keeps the local shards) reads the whole checkpoint per host: 852 GB of bf16 for the release on each of the 32-node
recipe's 16 trainer hosts, where each holds 53 GB of it (`scripts/checkpoint_reads.py`). Here a parameter's
sharding says which block of it each local device holds (`addressable_devices_indices_map`); a block is filled
from the HF tensors that overlap it, each read for just that slice (`TensorReader`), so a process reads its own
shards' bytes. Devices holding the same block (replicas) read it once. The devices' arrays are then joined into
the global array (`jax.make_array_from_single_device_arrays`): nothing is compiled, and nothing crosses hosts.

Host memory in flight: one device block of one parameter (all of it without a mesh). On CPU the block becomes the
device buffer itself (`_aligned_empty`), so a CPU load holds each parameter once.
"""

from __future__ import annotations

import math
import mmap
import os
from typing import Sequence

import jax
import numpy as np

from m3jax.hf.layouts import Slot
from m3jax.hf.safetensors_io import CheckpointError, TensorInfo, count_nonfinite

Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension


class TensorReader:
    """Reads slices of checkpoint tensors, one open file per checkpoint file (`close()` closes them). A slice of
    whole rows (an expert of a stacked tensor, an FSDP row block, a whole tensor) is one `os.preadv` of its bytes,
    straight into the caller's block when the dtypes agree; a slice that cuts the rows goes through `_columns`.
    Plain reads rather than one memory map of each file: a mapped page counts in the process's resident memory
    for as long as the map lives. `bytes_read`: the bytes of the slices read so far."""

    def __init__(self):
        self._files: dict[str, int] = {}
        self.bytes_read = 0

    def read(self, info: TensorInfo, shape: tuple[int, ...], region: Region, out: np.ndarray | None = None):
        """The `region` of the tensor viewed as `shape` (same size as its own), into `out` when given (C-contiguous,
        the region's shape, any dtype: cast on copy) -> the region's array (out itself when given)."""
        dtype = info.np_dtype
        (a, b), rest = (region[0], region[1:]) if shape else ((0, 1), ())
        row = math.prod(shape[1:]) * dtype.itemsize
        if not all(lo == 0 and hi == n for (lo, hi), n in zip(rest, shape[1:])):
            return self._columns(info, shape, region, out, info.start + a * row, (b - a) * row)
        if out is not None and out.dtype == dtype and out.flags.c_contiguous:
            self._pread(info, info.start + a * row, memoryview(out.reshape(-1).view(np.uint8)))
            return out
        buf = np.empty((b - a,) + tuple(shape[1:]), dtype)
        self._pread(info, info.start + a * row, memoryview(buf.reshape(-1).view(np.uint8)))
        if out is None:
            return buf.reshape(tuple(hi - lo for lo, hi in region))
        out[...] = buf.reshape(out.shape)
        return out

    def _columns(self, info: TensorInfo, shape, region: Region, out, start: int, length: int):
        """A slice that cuts the rows (a tensor split by columns): copied out of a memory map of the rows it spans,
        which the kernel reads page by page, so a slice of wide rows skips the other columns' pages. The map is
        dropped right after: its pages count in the process's resident memory while it lives."""
        page = mmap.ALLOCATIONGRANULARITY
        lead = start % page
        fd = self._fd(info)
        with mmap.mmap(fd, lead + length, access=mmap.ACCESS_READ, offset=start - lead) as m:
            rows = np.frombuffer(m, info.np_dtype, length // info.np_dtype.itemsize, lead)
            cut = (slice(None),) + tuple(slice(lo, hi) for lo, hi in region[1:])
            view = rows.reshape((-1,) + tuple(shape[1:]))[cut]
            part = np.array(view) if out is None else None
            if out is not None:
                out[...] = view
            del rows, view
        self.bytes_read += math.prod(hi - lo for lo, hi in region) * info.np_dtype.itemsize
        return part if out is None else out

    def _fd(self, info: TensorInfo) -> int:
        fd = self._files.get(info.file)
        if fd is None:
            fd = self._files[info.file] = os.open(info.file, os.O_RDONLY)
        return fd

    def _pread(self, info: TensorInfo, offset: int, view: memoryview) -> None:
        fd = self._fd(info)
        got = 0
        while got < len(view):
            k = os.preadv(fd, [view[got:]], offset + got)
            if not k:
                raise CheckpointError(f"{info.file}: truncated while reading a tensor at byte {offset + got}")
            got += k
        self.bytes_read += got

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def region_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    """A sharding's index (slices) of an array of `shape` as (start, stop) per dimension."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def slot_region(index: tuple[int, ...], shape: tuple[int, ...]) -> Region:
    """The region of a parameter of `shape` that a slot at leading `index` fills."""
    return tuple((i, i + 1) for i in index) + tuple((0, n) for n in shape[len(index):])


def blocks_by_region(sharding, shape: tuple[int, ...]) -> dict[Region, list]:
    """{block of the parameter: this process's devices holding it}; without a sharding, the whole parameter on
    jax's default device (None)."""
    if sharding is None:
        return {tuple((0, n) for n in shape): [None]}
    out: dict[Region, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        out.setdefault(region_of(index, shape), []).append(device)
    return out


def fill_block(out: np.ndarray, region: Region, shape: tuple[int, ...], slots: Sequence[Slot],
               tensors: dict[str, TensorInfo], reader: TensorReader, check_finite: bool) -> list[str]:
    """Copy into `out` (the block `region` of a parameter of `shape`) the part of each slot's HF tensor that
    falls inside it, cast to out's dtype. A slot fills the parameter at its leading `index` with the tensor
    reshaped to the parameter's remaining dimensions; the slots must fill the whole block (`out` starts
    uninitialised). Returns a problem line for each slice holding NaN or Inf (with check_finite), counted after
    the cast."""
    problems, filled = [], 0
    for slot in slots:
        k = len(slot.index)
        if not all(a <= i < b for i, (a, b) in zip(slot.index, region)):
            continue
        info = tensors[slot.name]
        dst = reader.read(info, shape[k:], region[k:], out[tuple(i - a for i, (a, _) in zip(slot.index, region))
                                                                + (Ellipsis,)])
        filled += dst.size
        if check_finite and (bad := count_nonfinite(dst)):
            read = math.prod(b - a for a, b in region[k:])
            part = "" if read == math.prod(info.shape) else f" (in the {read} of them this process read)"
            problems.append(f"tensor {slot.name} ({info.file}) holds {bad} NaN or Inf value(s) of "
                            f"{math.prod(info.shape)}{part}")
    if filled != out.size:  # the block is uninitialised memory: every element must come from a tensor
        raise RuntimeError(f"the tensors {[s.name for s in slots][:4]}... fill {filled} of the {out.size} elements "
                           f"of the parameter's block {region}: the layout's slots do not cover the parameter")
    return problems


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array on a 64-byte boundary: XLA:CPU then adopts it as the device buffer instead of
    copying it (so a CPU load holds each parameter once); numpy's own allocations are 16-byte aligned."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip:skip + nbytes].view(dtype).reshape(shape)


def build_param(shape: tuple[int, ...], dtype, sharding, slots: Sequence[Slot], tensors: dict[str, TensorInfo],
                reader: TensorReader, check_finite: bool) -> tuple[jax.Array, list[str]]:
    """The parameter as a jax.Array placed by `sharding` (None: jax's default device), each local block read from
    the checkpoint once; and the non-finite problems found (`fill_block`)."""
    problems, arrays = [], {}
    for region, devices in blocks_by_region(sharding, shape).items():
        block = _aligned_empty([b - a for a, b in region], dtype)
        problems += fill_block(block, region, shape, slots, tensors, reader, check_finite)
        first = arrays[devices[0]] = jax.device_put(block, devices[0])
        for device in devices[1:]:  # replicas copy the first device's, never share the host block
            arrays[device] = jax.device_put(first, device)
        first.block_until_ready()  # the transfer has let go of the host block: one block in flight
        del block
    if sharding is None:
        return arrays[None], problems
    order = list(sharding.addressable_devices_indices_map(shape))
    return jax.make_array_from_single_device_arrays(shape, sharding, [arrays[d] for d in order]), problems
