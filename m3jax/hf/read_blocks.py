"""A parameter built from the blocks this process's devices hold, reading only those bytes of the checkpoint.

On a multi-host mesh each process addresses only its own devices' shards: an expert placed on another host, the
other hosts' FSDP rows. Reading every tensor on every process (and handing the whole of it to `device_put`, which
keeps the local shards) reads the whole checkpoint per host: 852 GB of bf16 for the release on each of the 32-node
recipe's 16 trainer hosts, where each holds 53 GB of it (`scripts/checkpoint_reads.py`). Here a parameter's
sharding says which block of it each local device holds (`addressable_devices_indices_map`); a block is filled
from the HF tensors that overlap it, each read for just that slice (`TensorReader`), so a process reads its own
shards' bytes. Devices holding the same block (replicas) read it once. The devices' arrays are then joined into
the global array (`jax.make_array_from_single_device_arrays`): nothing is compiled, and nothing crosses hosts.

The blocks are read ahead of their placement on the devices (`build_params`, `read_ahead`): READ_THREADS reads at
once, so a disk's queue stays full and a block's transfer overlaps the next blocks' reads, within READ_AHEAD_BYTES
of host memory beyond the block being placed. On CPU the block becomes the device buffer itself (`_aligned_empty`),
so a CPU load holds each parameter once.
"""

from __future__ import annotations

import collections
import contextlib
import math
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence, TypeVar

import jax
import numpy as np

from m3jax.hf.layouts import Slot
from m3jax.hf.safetensors_io import CheckpointError, TensorInfo, count_nonfinite

Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension
# Blocks read at once. On this 2-core VM two reads of fresh blocks from a warm page cache ran 1.9x one (4.8 -> 9.1
# GB/s, BENCHMARKS.md session 33); a disk or a network filesystem wants several requests queued.
READ_THREADS = 4
READ_AHEAD_BYTES = 1 << 30  # host memory the reads ahead may hold (at least one read is always under way)
READ_CHUNK_BYTES = 64 << 20  # a block's slots are read in parts of about this size, in parallel
T = TypeVar("T")
R = TypeVar("R")


class TensorReader:
    """Reads slices of checkpoint tensors, one open file per checkpoint file (`close()` closes them). A slice of
    whole rows (an expert of a stacked tensor, an FSDP row block, a whole tensor) is one `os.preadv` of its bytes,
    straight into the caller's block when the dtypes agree; a slice that cuts the rows goes through `_columns`.
    Plain reads rather than one memory map of each file: a mapped page counts in the process's resident memory
    for as long as the map lives. `bytes_read`: the bytes of the slices read so far."""

    def __init__(self):
        self._files: dict[str, int] = {}
        self.bytes_read = 0
        self._lock = threading.Lock()  # reads run in several threads (`read_ahead`): the files and the count

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
        self._count(math.prod(hi - lo for lo, hi in region) * info.np_dtype.itemsize)
        return part if out is None else out

    def _fd(self, info: TensorInfo) -> int:
        with self._lock:
            fd = self._files.get(info.file)
            if fd is None:
                fd = self._files[info.file] = os.open(info.file, os.O_RDONLY)
            return fd

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def _pread(self, info: TensorInfo, offset: int, view: memoryview) -> None:
        fd = self._fd(info)
        got = 0
        while got < len(view):
            k = os.preadv(fd, [view[got:]], offset + got)
            if not k:
                raise CheckpointError(f"{info.file}: truncated while reading a tensor at byte {offset + got}")
            got += k
        self._count(got)

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
    problems, filled = fill_slots(out, region, shape, slots, tensors, reader, check_finite)
    _check_filled(filled, out.size, region, slots)
    return problems


def _check_filled(filled: int, size: int, region: Region, slots: Sequence[Slot]) -> None:
    if filled != size:  # the block is uninitialised memory: every element must come from a tensor
        raise RuntimeError(f"the tensors {[s.name for s in slots][:4]}... fill {filled} of the {size} elements "
                           f"of the parameter's block {region}: the layout's slots do not cover the parameter")


def _inside(slot: Slot, region: Region) -> bool:
    return all(a <= i < b for i, (a, b) in zip(slot.index, region))


def fill_slots(out: np.ndarray, region: Region, shape: tuple[int, ...], slots: Sequence[Slot],
               tensors: dict[str, TensorInfo], reader: TensorReader, check_finite: bool) -> tuple[list[str], int]:
    """`fill_block`'s copies for these slots alone (the slots of a block may be filled by several calls, in several
    threads: each writes its own part of `out`) -> (problem lines, elements filled)."""
    problems, filled = [], 0
    for slot in slots:
        k = len(slot.index)
        if not _inside(slot, region):
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
    return problems, filled


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array on a 64-byte boundary: XLA:CPU then adopts it as the device buffer instead of
    copying it (so a CPU load holds each parameter once); numpy's own allocations are 16-byte aligned."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip:skip + nbytes].view(dtype).reshape(shape)


class ParamBlocks(NamedTuple):
    """A parameter to build: its shape and dtype, its sharding (None: jax's default device) and the checkpoint
    tensors that fill it (`m3jax.hf.layouts.Slot`)."""
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: object
    slots: Sequence[Slot]


def read_ahead(jobs: Iterable[T], read: Callable[[T], R], nbytes: Callable[[T], int], threads: int = READ_THREADS,
               ahead_bytes: int = READ_AHEAD_BYTES) -> Iterator[tuple[T, R]]:
    """(job, read(job)) in the jobs' order, the reads running on `threads` threads ahead of the consumer while the
    jobs read or being read and not yet handed over total at most `ahead_bytes` (`nbytes`; the next job is always
    started). Closing the iterator early (or an error in a read) cancels the reads not started and waits for the
    running ones, so nothing reads after it returns (the caller may then close the files)."""
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="read_ahead")
    pending: collections.deque = collections.deque()
    held, todo = 0, iter(jobs)
    upcoming = next(todo, None)
    try:
        while pending or upcoming is not None:
            while upcoming is not None and (not pending or held + nbytes(upcoming) <= ahead_bytes):
                pending.append((upcoming, pool.submit(read, upcoming)))
                held += nbytes(upcoming)
                upcoming = next(todo, None)
            job, future = pending.popleft()
            held -= nbytes(job)
            yield job, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _Block:
    """One device block of a parameter, its host buffer allocated by the first of its reads to start (its reads run
    in several threads) and let go once it is placed."""

    def __init__(self, i: int, region: Region, devices: list, dtype):
        self.i, self.region, self.devices, self.dtype = i, region, devices, dtype
        self.filled, self.problems, self._out, self._lock = 0, [], None, threading.Lock()

    def buffer(self) -> np.ndarray:
        with self._lock:
            if self._out is None:
                self._out = _aligned_empty([b - a for a, b in self.region], self.dtype)
            return self._out

    def release(self) -> np.ndarray:
        out, self._out = self.buffer(), None
        return out


class _Read(NamedTuple):
    block: _Block
    slots: Sequence[Slot]  # the part of the block's slots this read fills
    nbytes: int
    last: bool  # the block's last read: the block is complete when it is handed over


def _reads(i: int, p: ParamBlocks, region: Region, devices: list, chunk_bytes: int) -> list[_Read]:
    """A block's slots cut into reads of about `chunk_bytes` each (a slot is never cut): the reads of one large
    block then run in parallel too."""
    block, itemsize = _Block(i, region, devices, p.dtype), np.dtype(p.dtype).itemsize
    groups: list[tuple[list, int]] = [([], 0)]
    for slot in p.slots:
        if not _inside(slot, region):
            continue
        size = math.prod(b - a for a, b in region[len(slot.index):]) * itemsize
        if groups[-1][0] and groups[-1][1] + size > chunk_bytes:
            groups.append(([], 0))
        groups[-1][0].append(slot)
        groups[-1] = (groups[-1][0], groups[-1][1] + size)
    return [_Read(block, slots, n, k == len(groups) - 1) for k, (slots, n) in enumerate(groups)]


def build_params(params: Sequence[ParamBlocks], tensors: dict[str, TensorInfo], reader: TensorReader,
                 check_finite: bool, threads: int = READ_THREADS, ahead_bytes: int = READ_AHEAD_BYTES,
                 chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[tuple[int, jax.Array, list[str]]]:
    """(i, params[i] as a jax.Array placed by its sharding, the non-finite problems found in it (`fill_block`)) for
    each parameter in order, each local block read from the checkpoint once, in reads of about `chunk_bytes` run
    ahead (`read_ahead`), and placed one block at a time (a block's host memory is let go once its transfer is
    done)."""
    jobs = [r for i, p in enumerate(params) for region, devices in blocks_by_region(p.sharding, p.shape).items()
            for r in _reads(i, p, region, devices, chunk_bytes)]
    left = collections.Counter(r.block.i for r in jobs if r.last)
    arrays: dict[int, dict] = collections.defaultdict(dict)
    problems: dict[int, list[str]] = collections.defaultdict(list)

    def read(job: _Read):
        return fill_slots(job.block.buffer(), job.block.region, params[job.block.i].shape, job.slots, tensors,
                          reader, check_finite)

    with contextlib.closing(read_ahead(jobs, read, lambda r: r.nbytes, threads, ahead_bytes)) as done:
        for job, (found, filled) in done:
            b = job.block
            b.filled += filled
            problems[b.i] += found
            if not job.last:
                continue
            block = b.release()
            _check_filled(b.filled, block.size, b.region, params[b.i].slots)
            placed = arrays[b.i]
            first = placed[b.devices[0]] = jax.device_put(block, b.devices[0])
            for device in b.devices[1:]:  # replicas copy the first device's, never share the host block
                placed[device] = jax.device_put(first, device)
            first.block_until_ready()  # the transfer has let go of the host block
            del block
            left[b.i] -= 1
            if not left[b.i]:
                yield b.i, _joined(params[b.i], arrays.pop(b.i)), problems.pop(b.i)


def _joined(p: ParamBlocks, arrays: dict) -> jax.Array:
    if p.sharding is None:
        return arrays[None]
    order = list(p.sharding.addressable_devices_indices_map(p.shape))
    return jax.make_array_from_single_device_arrays(p.shape, p.sharding, [arrays[d] for d in order])
