"""Buckets written once into shared-memory files that the engines of this machine map
(`generation.weight_transport: shm`, issue 12 item 2 on one host).

On the `ray` transport every byte is copied twice on the sender: `hf_tensors`' layout change (most weights are
transposed from JAX's [in, out] to HF's [out, in]) writes a fresh array, and `ray.put` copies it into the object
store. Here the layout change writes straight into a file under /dev/shm, and the engine maps that file: one
copy on the sender, none on the wire. Both ends keep their mappings between updates, so neither faults the pages
in again (a fresh 4 kB page costs ~60x a used one on this VM: BENCHMARKS.md, issue 12, session 16). This is the
CPU counterpart of NeMo-RL's and vLLM's IPC refit for engines colocated with the trainer; engines on other
machines need the `collective` transport, and the pool refuses `shm` for them at start.

What the other paths guarantee holds: each tensor's XXH3 is taken from the bytes in the file and checked by every
engine against what it maps, with name, shape and dtype; the commit is the same two-phase commit. A segment is
only rewritten by the next update, which starts after every engine has committed or dropped this one.

Files live in a directory named after the trainer's host and pid; the pool removes it at shutdown, and a new
writer removes the directories of this host's processes that no longer run (a trainer killed with SIGKILL leaves
its files behind until then).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import mmap
import os
import shutil
import tempfile
import threading
from typing import Iterable, Iterator

import numpy as np

from rl.generation.transfer_base import Bucket, TensorRecord, TransferError, checksum, record_dtype
from rl.run_lock import pid_alive

log = logging.getLogger(__name__)

SEGMENT_ROOT = "/dev/shm"  # RAM-backed; containers often mount only 64 MB there (checked per segment)
PREFIX = "m3jax-weights-"
ALIGN = 64  # every tensor starts on a cache line
CHUNK_BYTES = 4 << 20  # the sender's copies are split in row blocks of about this size across its threads


def _map(path: str, size: int, writable: bool) -> np.ndarray:
    """The file as a uint8 array on a shared mapping whose pages are mapped at once (MAP_POPULATE): one call
    instead of a fault per 4 kB page at first touch (8.65 s for the first 1 GB update without it)."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        m = mmap.mmap(fd, size, flags=flags, prot=prot)
    finally:
        os.close(fd)  # the mapping keeps the file
    return np.frombuffer(m, dtype=np.uint8)


@dataclasses.dataclass(frozen=True)
class SharedBucket:
    """What travels to the engines: where a bucket's tensors lie in a segment file, not the bytes."""

    version: int
    index: int
    records: list[TensorRecord]
    offsets: list[int]  # byte offset of each tensor in the file
    path: str
    capacity: int  # the file's size in bytes

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(r.shape, dtype=np.int64)) * record_dtype(r.dtype).itemsize for r in self.records)

    def open(self, mappings: dict) -> Bucket:
        """The bucket as arrays on the engine's mapping of its file (mapped once per file and kept in
        `mappings`); read-only, so a loader that tried to write into a received tensor would fault, not
        change the next update's bytes. Verification (`transfer.verify_bucket`) follows."""
        m = mappings.get(self.path)
        if m is None:
            try:
                m = _map(self.path, self.capacity, writable=False)
            except (OSError, ValueError) as e:
                raise TransferError(f"bucket {self.index} of version {self.version}: cannot map {self.path} ({e}); "
                                    "weight_transport 'shm' needs every engine on the trainer's machine") from None
            for stale in [p for p in mappings if not os.path.exists(p)]:  # segments the sender replaced
                del mappings[stale]
            mappings[self.path] = m
        arrays = []
        for rec, off in zip(self.records, self.offsets):
            dtype = record_dtype(rec.dtype)
            n = int(np.prod(rec.shape, dtype=np.int64)) * dtype.itemsize
            if off < 0 or off + n > m.size:
                raise TransferError(f"tensor {rec.name!r} (bucket {self.index}, version {self.version}): bytes "
                                    f"[{off}, {off + n}) lie outside segment {self.path} of {m.size} bytes")
            arrays.append(m[off:off + n].view(dtype).reshape(rec.shape))
        return Bucket(self.version, self.index, list(self.records), arrays)


def _owner_prefix(pid: int) -> str:
    """The directory prefix of a trainer process of this host: the hostname, so that a container sharing
    /dev/shm with another (another pid namespace, another hostname) never takes a live trainer's files for
    a dead one's."""
    import socket

    return f"{PREFIX}{socket.gethostname()}-{pid}-"


def sweep(root: str) -> list[str]:
    """Remove the segment directories of this host's trainer processes that no longer run; returns what it
    removed."""
    gone, mine = [], _owner_prefix(0)[:-2]  # "m3jax-weights-<host>-"
    for d in os.listdir(root) if os.path.isdir(root) else ():
        if not d.startswith(mine):
            continue
        try:
            pid = int(d[len(mine):].split("-", 1)[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
            gone.append(d)
    return gone


def bucket_sizes(tensor_bytes: Iterable[int], bucket_bytes: int) -> list[int]:
    """The byte sizes of the buckets `SegmentWriter.buckets` makes of tensors of these sizes, in this order
    (what `reserve` creates before the first update)."""
    sizes, used = [], 0
    for n in tensor_bytes:
        if used and used + n > bucket_bytes:
            sizes.append(used)
            used = 0
        used = -(-(used + n) // ALIGN) * ALIGN
    return sizes + [used] if used else sizes


def checkpoint_tensor_bytes(model_dir: str) -> list[int]:
    """Byte size of every tensor of a checkpoint directory (or of its shapes: `m3jax.hf.shapes`), in file and header
    order (which is `hf_tensors`' order for a checkpoint m3jax wrote)."""
    from m3jax.hf.shapes import tensor_bytes

    return tensor_bytes(model_dir)


class SegmentWriter:
    """The sender's segment files, kept (and mapped) between updates: each bucket takes the smallest free file
    that holds it, and a new file is made only when none does (the first update, or a larger tensor).

    A bucket's copies and hashes run on `threads` threads (numpy's copy and XXH3 release the GIL): one copy
    thread is not bound by memory here (1 GB into a mapped file: 11.5 GB/s on one thread, 22.3 on two; XXH3 14.2
    and 24.9), and below glibc's non-temporal threshold one thread copies megabyte-sized tensors at 7.2 GB/s
    (BENCHMARKS.md, issue 12, session 24)."""

    def __init__(self, bucket_bytes: int, root: str = SEGMENT_ROOT, threads: int | None = None):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: expected >= 1")
        root = root if os.path.isdir(root) else tempfile.gettempdir()
        sweep(root)
        self.bucket_bytes, self.root = bucket_bytes, root
        self.dir = tempfile.mkdtemp(prefix=_owner_prefix(os.getpid()), dir=root)
        self.files: list[tuple[str, np.ndarray]] = []  # (path, mapping), every file this writer made
        self._free: list[tuple[str, np.ndarray]] = []  # the files the update being written has not taken
        if threads is None:
            threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, min(threads, 8)), thread_name_prefix="m3jax-segment")

    def close(self) -> None:
        self.files, self._free = [], []
        self.pool.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def reserve(self, sizes: Iterable[int]) -> None:
        """Make (and fault in) files of these sizes before the first update (`bucket_sizes` of the checkpoint's
        tensors): a fresh page costs so much on this VM that the first 1 GB update's sender took 8-9 s without
        this. The pool runs it in a thread while its engines start."""
        for size in sizes:
            _, seg = self._new(max(size, self.bucket_bytes))
            seg[::mmap.PAGESIZE] = 0  # a write per page: MAP_POPULATE alone left the first update 3x slower

    def _new(self, size: int) -> tuple[str, np.ndarray]:
        free = shutil.disk_usage(self.root).free
        if size > free:  # say so instead of a SIGBUS when a page cannot be allocated mid-write
            raise OSError(f"a weight bucket of {size / 2**20:.0f} MiB does not fit in {self.root} ({free / 2**20:.0f} "
                          "MiB free); enlarge it (docker --shm-size) or use weight_transport 'ray'")
        path = os.path.join(self.dir, f"segment-{len(self.files)}-{size}")
        with open(path, "wb") as f:
            f.truncate(size)
        self.files.append((path, _map(path, size, writable=True)))
        return self.files[-1]

    def _take(self, need: int) -> tuple[str, np.ndarray]:
        fits = [f for f in self._free if f[1].size >= need]
        if not fits:
            return self._new(max(need, self.bucket_bytes))
        best = min(fits, key=lambda f: f[1].size)
        self._free.remove(best)
        return best

    def buckets(self, named_arrays: Iterable[tuple[str, np.ndarray]], version: int) -> Iterator[SharedBucket]:
        """Write the tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor travels alone),
        each tensor's layout change done by the one copy into the file. A file is taken by one bucket per
        update: the engines read it until this update is committed or dropped, before the next one starts."""
        self._free = list(self.files)
        index, used, pending = 0, 0, []  # pending: (name, source array, offset) of the open bucket
        for name, array in named_arrays:
            array = np.asarray(array)
            if pending and used + array.nbytes > self.bucket_bytes:
                yield self._fill(version, index, pending, *self._take(used))
                index, used, pending = index + 1, 0, []
            pending.append((name, array, used))
            used = -(-(used + array.nbytes) // ALIGN) * ALIGN
        if pending:
            yield self._fill(version, index, pending, *self._take(used))

    def _fill(self, version: int, index: int, pending: list, path: str, seg: np.ndarray) -> SharedBucket:
        """Copy a bucket's tensors into its segment in row blocks, then hash each from the segment."""
        dsts = [seg[off:off + a.nbytes].view(a.dtype).reshape(a.shape) for _, a, off in pending]
        blocks = []
        for (_, a, _), dst in zip(pending, dsts):
            rows = a.shape[0] if a.ndim else 1
            step = max(1, rows * CHUNK_BYTES // max(a.nbytes, 1))
            blocks += [(dst, a, r, r + step) for r in range(0, rows, step)] if a.ndim else [(dst, a, None, None)]

        def copy(block):
            dst, src, lo, hi = block
            if lo is None:
                np.copyto(dst, src, casting="no")
            else:
                np.copyto(dst[lo:hi], src[lo:hi], casting="no")

        list(self.pool.map(copy, blocks))
        sums = list(self.pool.map(checksum, dsts))
        records = [TensorRecord(name, tuple(a.shape), str(a.dtype), c) for (name, a, _), c in zip(pending, sums)]
        return SharedBucket(version, index, records, [off for _, _, off in pending], path, seg.size)


def reserve_in_background(segments: "SegmentWriter", model_dir: str, bucket_bytes: int) -> threading.Thread:
    """`segments.reserve` for the checkpoint's buckets in a daemon thread (while the engines start); a failure
    (a small /dev/shm) is logged, not raised: the first push then makes the files itself and says what does not
    fit."""
    def run():
        try:
            segments.reserve(bucket_sizes(checkpoint_tensor_bytes(model_dir), bucket_bytes))
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning("shm transport: making its files in advance failed (%r); the first push makes them", e)

    thread = threading.Thread(target=run, daemon=True, name="m3jax-warm-segments")
    thread.start()
    return thread
