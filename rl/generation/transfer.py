"""Trainer weights -> generation engines: HF-named, checksummed buckets, staged, then applied together.

The tensors come from `m3jax.hf.save.hf_tensors` (the generator `save_pretrained` writes from), so what
an engine receives is byte for byte what an exported checkpoint would hold.

An update is a two-phase commit so that a bad bucket can never leave an engine half updated:
  1. stage: every bucket goes to every engine, which verifies each tensor (XXH3-64 of its bytes, and its
     name / shape / dtype against the engine's own checkpoint manifest) and holds it without applying;
  2. commit: only when every engine has acknowledged every bucket is `commit(version)` sent; each engine
     applies the staged tensors (one copy into its loaded parameters, `rl.generation.inplace`, or
     vLLM's `reload_weights` where that does not cover the model) and reports the new version.
On any failure the sender sends `abort(version)` everywhere and raises `TransferError` naming the
tensor: the engines keep serving the previous version.

Conversion of bucket n+1 runs in a thread while bucket n is being put into the object store and staged
(`depth` buckets in flight), which is the double buffering of grpo-reference §3.

`generation.weight_transport` names the entry of `TRANSPORTS` that `make_transport` builds:
`RayObjectStoreTransport` ("ray") moves host buffers through Ray's object store;
`SharedMemoryTransport` ("shm") writes them once into shared-memory files that the engines of the trainer's
machine map (rl.generation.shared_segments);
`rl.generation.collective.CollectiveTransport` ("collective") broadcasts the buckets over a
torch.distributed group (gloo on CPU, NCCL on GPU) joined by the trainer process and the engines.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterable, Iterator, Protocol

import numpy as np

from rl.generation.collective import CollectiveTransport
from rl.generation.shared_segments import SegmentWriter, SharedBucket
from rl.generation.transfer_base import (Bucket, TensorRecord, TransferError, TransferStats,  # noqa: F401 - re-exported
                                         abort_staged, as_transfer_error, checksum)


def model_tensors(graphdef, params, rest=None, layout: str = "released",
                  on_device: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """The trainer's parameters as HF-named host arrays, through `hf_tensors` (what `save_pretrained`
    writes). On a multi-host mesh iterating it is a collective: every process must drain it. on_device:
    JAX arrays where the parameters live instead (for buckets on the accelerator: `hf_tensors(on_host=False)`)."""
    from flax import nnx

    from m3jax.hf.save import hf_tensors
    from m3jax.hf.tensors import host_views

    if not on_device:
        params, rest = host_views(params), host_views(rest)
    model = nnx.merge(graphdef, params, rest) if rest is not None else nnx.merge(graphdef, params)
    return hf_tensors(model, layout, on_host=not on_device)


def make_buckets(named_arrays: Iterable[tuple[str, np.ndarray]], bucket_bytes: int, version: int) -> Iterator[Bucket]:
    """Group tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor travels alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: expected >= 1")
    records, arrays, size, index = [], [], 0, 0
    for name, array in named_arrays:
        array = np.ascontiguousarray(array)
        if arrays and size + array.nbytes > bucket_bytes:
            yield Bucket(version, index, records, arrays)
            records, arrays, size, index = [], [], 0, index + 1
        records.append(TensorRecord(name, tuple(array.shape), str(array.dtype), checksum(array)))
        arrays.append(array)
        size += array.nbytes
    if arrays:
        yield Bucket(version, index, records, arrays)


def verify_bucket(bucket: Bucket, check=None) -> None:
    """Raise TransferError naming the first tensor whose bytes, shape or dtype disagree with its record,
    or that `check(name, shape, dtype)` (the receiving engine's manifest) rejects."""
    if len(bucket.records) != len(bucket.arrays):
        raise TransferError(f"bucket {bucket.index} of version {bucket.version}: {len(bucket.records)} records "
                            f"for {len(bucket.arrays)} tensors")
    for rec, array in zip(bucket.records, bucket.arrays):
        where = f"tensor {rec.name!r} (bucket {bucket.index}, version {bucket.version})"
        if tuple(array.shape) != rec.shape or str(array.dtype) != rec.dtype:
            raise TransferError(f"{where}: arrived as {array.dtype}{list(array.shape)}, "
                                f"sent as {rec.dtype}{list(rec.shape)}")
        got = checksum(array)
        if got != rec.checksum:
            raise TransferError(f"{where}: checksum mismatch (xxh3 {got:#018x}, expected {rec.checksum:#018x}): "
                                "the bytes were corrupted in transit")
        if check is not None:
            try:
                check(rec.name, rec.shape, rec.dtype)
            except (KeyError, ValueError) as e:
                raise TransferError(f"{where}: rejected by the engine: {e}") from None


class StagedUpdate:
    """Receiver side of one update: verified buckets held until commit (or dropped on abort)."""

    def __init__(self):
        self.version: int | None = None
        self.buckets: dict[int, Bucket] = {}
        self.mappings: dict = {}  # shared_segments: the sender's segment files, mapped once and kept

    def stage(self, bucket: Bucket | SharedBucket, check=None) -> None:
        if self.version != bucket.version:  # a new update replaces any abandoned one
            self.version, self.buckets = bucket.version, {}
        if isinstance(bucket, SharedBucket):
            bucket = bucket.open(self.mappings)
        verify_bucket(bucket, check)
        self.buckets[bucket.index] = bucket

    def tensors(self, version: int, num_buckets: int) -> Iterator[tuple[str, np.ndarray]]:
        """The staged tensors in send order; refuses an incomplete update or a repeated name (vLLM's
        reload must see each name once)."""
        if self.version != version or sorted(self.buckets) != list(range(num_buckets)):
            raise TransferError(f"commit of version {version} with {num_buckets} buckets, but staged "
                                f"version {self.version} holds buckets {sorted(self.buckets)}")
        seen = set()
        for i in range(num_buckets):
            for rec in self.buckets[i].records:
                if rec.name in seen:
                    raise TransferError(f"tensor {rec.name!r} sent twice in version {version}")
                seen.add(rec.name)
        for i in range(num_buckets):
            b = self.buckets[i]
            yield from zip((r.name for r in b.records), b.arrays)

    def clear(self) -> None:
        self.version, self.buckets = None, {}


class Transport(Protocol):
    broken: bool  # True once the transport cannot be reused (the pool then builds a new one)

    def push(self, named_arrays: Iterable[tuple[str, np.ndarray]], version: int) -> TransferStats: ...

    def close(self) -> None: ...


class RayObjectStoreTransport:
    """Buckets through Ray's object store to engine actors exposing stage / commit / abort."""

    broken = False  # holds no connection: reusable for any update to the same engines

    def __init__(self, engines, bucket_bytes: int, depth: int = 2, timeout_s: float = 600.0):
        self.engines, self.bucket_bytes, self.depth, self.timeout_s = list(engines), bucket_bytes, depth, timeout_s

    def close(self) -> None:
        pass

    def push(self, named_arrays, version: int) -> TransferStats:
        t0 = time.perf_counter()
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        convert = {"s": 0.0, "error": None}
        stop = threading.Event()

        def hand_over(item) -> None:
            while not stop.is_set():
                try:
                    return ready.put(item, timeout=0.1)
                except queue.Full:
                    continue

        def produce():
            try:
                it = self._buckets(named_arrays, version)
                while not stop.is_set():
                    s = time.perf_counter()
                    b = next(it, None)
                    convert["s"] += time.perf_counter() - s
                    hand_over(b)
                    if b is None:
                        return
            except BaseException as e:  # surfaced in the caller's thread below
                convert["error"] = e
                hand_over(None)

        converter = threading.Thread(target=produce, daemon=True, name="weight-convert")
        converter.start()
        live = dict(enumerate(self.engines))  # an engine that dies mid-update is dropped, not fatal
        inflight: list[dict] = []
        n_buckets = n_bytes = n_tensors = 0
        send_s = 0.0
        try:
            while (bucket := ready.get()) is not None:
                s = time.perf_counter()
                inflight.append(self._send(bucket, live))
                n_buckets, n_bytes, n_tensors = n_buckets + 1, n_bytes + bucket.nbytes, n_tensors + len(bucket.records)
                del bucket  # the store (or the shm file) keeps the bytes until every engine has staged them
                while len(inflight) >= self.depth:
                    self._collect(inflight.pop(0), live)
                send_s += time.perf_counter() - s
            if convert["error"] is not None:
                raise TransferError(f"converting the weights of version {version} failed: {convert['error']!r}")
            s = time.perf_counter()
            while inflight:
                self._collect(inflight.pop(0), live)
            send_s += time.perf_counter() - s
            if not live:
                raise TransferError(f"every engine died during the update to version {version}")
        except Exception as e:
            stop.set()  # the converter must not keep producing buckets nobody will take
            # and must be out of named_arrays before the caller reads on: a multi-host trainer's process 0 drains it
            # (a collective) after a failed push (rl.generation.multihost)
            converter.join()
            self.abort(version)
            raise as_transfer_error(e) from None
        s = time.perf_counter()
        commits = {i: e.commit.remote(version, n_buckets) for i, e in live.items()}
        try:
            self._collect(commits, live, expect=version)
        except Exception as e:  # staged bytes were verified, so this is the engine failing to apply them
            raise as_transfer_error(e) from None
        end = time.perf_counter()
        return TransferStats(version, n_bytes, n_buckets, n_tensors, convert["s"], send_s, end - s, end - t0,
                             lost=sorted(set(range(len(self.engines))) - set(live)))

    def _buckets(self, named_arrays, version: int):
        """The update's buckets, built in the converter thread."""
        return make_buckets(named_arrays, self.bucket_bytes, version)

    def _send(self, bucket, live: dict) -> dict:
        """Hand one bucket to every live engine's `stage`: {engine: its answer's ref}."""
        import ray

        ref = ray.put(bucket)  # one copy in the store, read by every engine
        return {i: e.stage.remote(ref) for i, e in live.items()}

    def _collect(self, acks: dict, live: dict, expect=None) -> None:
        """Wait for one round of engine answers; drop engines that died, re-raise anything else."""
        import ray

        for i, ref in acks.items():
            if i not in live:
                continue
            try:
                got = ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                live.pop(i)
                continue
            if expect is not None and got != expect:
                raise TransferError(f"engine {i} reports version {got} after committing version {expect}")

    def abort(self, version: int) -> None:
        """Tell every engine to drop what it staged for `version` (`abort_staged`)."""
        abort_staged(self.engines, version, self.timeout_s)


class SharedMemoryTransport(RayObjectStoreTransport):
    """Buckets written once into shared-memory files that every engine of this machine maps
    (rl.generation.shared_segments); only the buckets' descriptions travel through Ray. Same two-phase commit,
    checks and failure handling as the object-store path."""

    def __init__(self, engines, bucket_bytes: int, depth: int = 2, timeout_s: float = 600.0, segments=None):
        """segments: a `SegmentWriter` that outlives this transport (the pool's, kept while engines are
        replaced); by default one of its own, removed on close."""
        super().__init__(engines, bucket_bytes, depth, timeout_s)
        self.own_segments = segments is None
        self.segments = SegmentWriter(bucket_bytes) if segments is None else segments

    def close(self) -> None:
        if self.own_segments:
            self.segments.close()

    def _buckets(self, named_arrays, version: int):
        return self.segments.buckets(named_arrays, version)

    def _send(self, bucket, live: dict) -> dict:
        return {i: e.stage.remote(bucket) for i, e in live.items()}


TRANSPORTS: dict[str, type] = {"ray": RayObjectStoreTransport, "shm": SharedMemoryTransport,
                               "collective": CollectiveTransport}


def make_transport(name: str, engines, bucket_bytes: int, timeout_s: float = 600.0, peers=None,
                   device: str = "cpu", segments=None) -> Transport:
    """The transport `name` (a key of TRANSPORTS) to these engine actors; `peers`: the other trainer
    processes that send their own tensors beside this one (collective only, rl.generation.multihost);
    `device`: where the collective transport's buckets live ("cpu": gloo, "cuda": NCCL); `segments`: the
    `shm` transport's files, kept by the caller across transports (shm only)."""
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"weight transport {name!r} is not built; allowed: {', '.join(TRANSPORTS)}") from None
    if cls is not CollectiveTransport:
        if peers is not None:
            raise ValueError(f"weight transport {name!r} sends from one process; several senders need 'collective'")
        if cls is SharedMemoryTransport:
            return cls(engines, bucket_bytes, timeout_s=timeout_s, segments=segments)
        return cls(engines, bucket_bytes, timeout_s=timeout_s)
    return cls(engines, bucket_bytes, timeout_s=timeout_s, peers=peers, device=device)
