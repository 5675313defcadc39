"""The collective weight path (`generation.weight_transport: collective`, issue 12 item 2).

The data plane leaves the Ray object store: the trainer process (rank 0) and every engine (one rank, or
one per worker of a Ray-executor engine: rl.generation.vllm_worker_weights) join one torch.distributed
group that is *not* the process-global default group (vLLM owns that one in each engine process, and the
trainer must not need a global init): a TCPStore rendezvous plus a
`ProcessGroupGloo` (CPU tensors) or `ProcessGroupNCCL` (CUDA tensors) object built directly on it, the
way NeMo-RL's stateless group does. The same code runs both backends; only the buffers' device differs.

vLLM 0.32's own weight-transfer API (`LLM.init_weight_transfer_engine` / `update_weights`) was the first
choice, but none of its backends (nccl, ipc, sparse_nccl, sharded_rdt, ...) runs on a CPU (stack-notes
§8b), and a custom backend would still need this group; the engine keeps vLLM's `load_weights` for the
apply (rl.generation.inplace), so only the wire is ours.

One update, per bucket (fixed size `bucket_bytes`; a larger tensor travels alone), rank 0 broadcasts
  1. a header int64[4]: kind (BUCKET / END / ABORT), metadata bytes, payload bytes, bucket index;
  2. the metadata (JSON: name, shape, dtype, XXH3, offset of every tensor);
  3. the payload: the tensors packed at 64-byte-aligned offsets.
The sender packs bucket n+1 (HF names and layout from `hf_tensors`, XXH3 of each source array) in a
thread while bucket n is on the wire: two buffers, double buffered. Each engine receives into staging
buffers it keeps between updates and verifies bucket n (XXH3 of the received bytes, name / shape /
dtype against its checkpoint manifest) in a thread while bucket n+1 arrives; at END it checks that
every tensor of the checkpoint came exactly once. This is phase 1; the sender then commits on every
engine only if every engine accepted (phase 2 = the apply), else aborts everywhere: a corrupted,
refused or partial update leaves every engine on its old version, with the tensor named.

A failure inside the group (an engine dies mid-broadcast) fails the whole update, all engines keep the
old version, the pool replaces the dead engine, and the next update builds a new group.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import queue
import threading
import time

import numpy as np

from rl.generation.transfer_base import (TransferError, TransferStats, abort_staged, as_transfer_error,
                                         checksum)

BUCKET, END, ABORT = 0, 1, 2
ALIGN = 64


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class WeightGroup:
    """A stateless process group: its own TCPStore rendezvous and backend object, no global state."""

    def __init__(self, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        # Rank 0 serves the store without waiting for the others, so it can hand out the port first.
        self.store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout, wait_for_workers=False)
        self.port, self.rank, self.world, self.backend = self.store.port, rank, world, backend
        self._host, self._timeout = host, timeout
        self.pg = None

    def connect(self) -> "WeightGroup":
        """Blocks until every rank has connected (a collective)."""
        import torch.distributed as dist

        if self.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.world, self._timeout)
        elif self.backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(self.store, self.rank, self.world)
        else:
            raise ValueError(f"weight group backend {self.backend!r}: expected gloo or nccl")
        return self

    def broadcast(self, tensor, root: int = 0):
        return self.pg.broadcast(tensor, root)

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "abort"):
            try:
                pg.abort()  # peers blocked in a collective fail now instead of at the timeout
            except Exception:  # noqa: BLE001 - gloo has no abort in some builds: dropping it closes the sockets
                pass
        self.store = None


class Receiver:
    """Engine side: joins the group, stages verified buckets, hands them to the apply at commit."""

    def __init__(self):
        self.group: WeightGroup | None = None
        self.version: int | None = None
        self.views: list[list[tuple[str, np.ndarray]]] = []
        self._buffers: list = []  # kept between updates: no page faults after the first one
        self.verify_s = 0.0

    def join(self, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float) -> int:
        self.leave()
        self.group = WeightGroup(host, port, rank, world, backend, timeout_s).connect()
        return rank

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def _buffer(self, index: int, nbytes: int, device: str):
        import torch

        while len(self._buffers) <= index:
            self._buffers.append(None)
        b = self._buffers[index]
        if b is None or b.numel() < nbytes:
            b = self._buffers[index] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        return b[:nbytes]

    def receive(self, version: int, check, manifest, device: str = "cpu") -> int:
        """Phase 1 of `version`: take every bucket rank 0 broadcasts; returns the bucket count once every
        tensor arrived intact, or raises TransferError naming the first bad one (after draining the
        stream, so the group stays in step)."""
        import torch

        if self.group is None:
            raise TransferError(f"engine is not in a weight group (version {version})")
        self.clear()
        self.version, error, t_verify = version, None, [0.0]
        verifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-verify")
        pending = []

        def verify(index, records, payload):
            s = time.perf_counter()
            host = payload.cpu().numpy() if payload.device.type != "cpu" else payload.numpy()
            out = []
            for r in records:
                where = f"tensor {r['name']!r} (bucket {index}, version {version})"
                a = host[r["offset"]:r["offset"] + r["nbytes"]]
                got = checksum(a)
                if got != r["checksum"]:
                    raise TransferError(f"{where}: checksum mismatch (xxh3 {got:#018x}, expected "
                                        f"{r['checksum']:#018x}): the bytes were corrupted in transit")
                try:
                    check(r["name"], tuple(r["shape"]), _dtype(r["dtype"]))
                except (KeyError, ValueError) as e:
                    raise TransferError(f"{where}: rejected by the engine: {e}") from None
                out.append((r["name"], a.view(_dtype(r["dtype"])).reshape(r["shape"])))
            t_verify[0] += time.perf_counter() - s
            return out

        head = torch.empty(4, dtype=torch.int64, device=device)
        try:
            while True:
                self.group.broadcast(head).wait()
                kind, n_meta, n_payload, index = (int(x) for x in head.tolist())
                if kind == ABORT:
                    error = error or TransferError(f"the sender aborted version {version}")
                    break
                if kind == END:
                    break
                meta = torch.empty(n_meta, dtype=torch.uint8, device=device)
                self.group.broadcast(meta).wait()
                payload = self._buffer(index, n_payload, device)
                self.group.broadcast(payload).wait()
                records = json.loads(meta.cpu().numpy().tobytes())
                pending.append(verifier.submit(verify, index, records, payload))
            for f in pending:
                try:
                    self.views.append(f.result())
                except TransferError as e:
                    error = error or e
        finally:
            verifier.shutdown(wait=True)
            self.verify_s = t_verify[0]
        if error is None:
            error = self._complete(version, manifest)
        if error is not None:
            self.clear()
            raise error
        return len(self.views)

    def _complete(self, version: int, manifest) -> TransferError | None:
        seen = set()
        for bucket in self.views:
            for name, _ in bucket:
                if name in seen:
                    return TransferError(f"tensor {name!r} sent twice in version {version}")
                seen.add(name)
        missing = sorted(set(manifest) - seen)
        if missing:
            return TransferError(f"tensor {missing[0]!r} missing from version {version} (partial update: "
                                 f"{len(missing)} of {len(manifest)} tensors never arrived)")
        return None

    def tensors(self, version: int, num_buckets: int):
        if self.version != version or len(self.views) != num_buckets:
            raise TransferError(f"commit of version {version} with {num_buckets} buckets, but version "
                                f"{self.version} staged {len(self.views)}")
        for bucket in self.views:
            yield from bucket

    def clear(self) -> None:
        self.version, self.views = None, []


class CollectiveTransport:
    """Rank 0 of a weight group over engine actors exposing join_weight_group / receive_weights / commit /
    abort. Kept by the pool across updates (the group costs a rendezvous) until the engines change or a
    push fails inside the group (`broken`)."""

    def __init__(self, engines, bucket_bytes: int, depth: int = 2, timeout_s: float = 600.0, device: str = "cpu"):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: expected >= 1")
        self.engines, self.bucket_bytes, self.depth, self.timeout_s = list(engines), bucket_bytes, depth, timeout_s
        self.device, self.backend = device, ("nccl" if device.startswith("cuda") else "gloo")
        self.group: WeightGroup | None = None
        self.broken = False
        self._slots: list = [None] * depth  # the double buffer, kept between updates

    def connect(self) -> float:
        """Build the group (engine i joins as ranks 1 + the ranks of engines 0..i-1, one rank or one per
        Ray-executor worker); returns the seconds it took."""
        import ray

        t = time.perf_counter()
        try:  # an engine on vLLM's Ray executor takes one rank per worker (rl.generation.vllm_worker_weights)
            ranks = ray.get([e.weight_ranks.remote() for e in self.engines], timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead engine: no update, a fresh group next time
            self.broken = True
            raise TransferError(f"asking {len(self.engines)} engines for their weight ranks failed: {e}") from None
        host, world = ray.util.get_node_ip_address(), 1 + sum(ranks)
        group = WeightGroup(host, 0, 0, world, self.backend, self.timeout_s)
        first = np.cumsum([1] + list(ranks[:-1])).tolist()
        joins = [e.join_weight_group.remote(host, group.port, r, world, self.backend, self.timeout_s)
                 for e, r in zip(self.engines, first)]
        try:
            group.connect()
            ray.get(joins, timeout=self.timeout_s)
        except Exception as e:  # an engine that died or never joined: no update, a fresh group next time
            group.close()
            self.broken = True
            raise TransferError(f"building the weight group of {len(self.engines)} engines failed: {e}") from None
        self.group = group
        return time.perf_counter() - t

    def close(self) -> None:
        import ray

        if self.group is not None:
            for ref in [e.leave_weight_group.remote() for e in self.engines]:
                try:
                    ray.get(ref, timeout=10)
                except Exception:  # noqa: BLE001 - a dead engine has no group to leave
                    pass
            self.group.close()
            self.group = None

    def _slot(self, i: int, nbytes: int):
        import torch

        if self._slots[i] is None or self._slots[i].numel() < nbytes:
            self._slots[i] = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8, device=self.device)
        return self._slots[i]

    def push(self, named_arrays, version: int) -> TransferStats:
        import ray
        import torch

        t0 = time.perf_counter()
        setup_s = self.connect() if self.group is None else 0.0  # TransferError: nothing was sent
        receives = {i: e.receive_weights.remote(version) for i, e in enumerate(self.engines)}
        free: queue.Queue = queue.Queue()
        for i in range(self.depth):
            free.put(i)
        ready: queue.Queue = queue.Queue()
        stop = threading.Event()
        conv = {"s": 0.0, "error": None, "tensors": 0}

        def take_slot():
            while not stop.is_set():
                try:
                    return free.get(timeout=0.1)
                except queue.Empty:
                    continue
            raise InterruptedError

        def produce():
            try:
                slot, index, off, records = take_slot(), 0, 0, []
                s, it = time.perf_counter(), iter(named_arrays)
                while (item := next(it, None)) is not None:
                    name, a = item
                    a = np.ascontiguousarray(a)
                    start = -(-off // ALIGN) * ALIGN
                    if records and start + a.nbytes > self.bucket_bytes:
                        conv["s"] += time.perf_counter() - s
                        ready.put((slot, index, records, off))
                        slot, index, off, records, start = take_slot(), index + 1, 0, [], 0
                        s = time.perf_counter()
                    buf = self._slot(slot, start + a.nbytes)  # grows only for a tensor that travels alone
                    if a.nbytes:
                        buf[start:start + a.nbytes].copy_(_as_bytes(a))
                    records.append({"name": name, "shape": list(a.shape), "dtype": str(a.dtype),
                                    "checksum": checksum(a), "offset": start, "nbytes": a.nbytes})
                    off, conv["tensors"] = start + a.nbytes, conv["tensors"] + 1
                conv["s"] += time.perf_counter() - s
                if records:
                    ready.put((slot, index, records, off))
            except InterruptedError:
                return
            except BaseException as e:  # surfaced in the caller's thread below
                conv["error"] = e
            ready.put(None)

        threading.Thread(target=produce, daemon=True, name="weight-pack").start()
        n_buckets = n_bytes = 0
        wire_s = 0.0
        try:
            try:
                while (item := ready.get()) is not None:
                    slot, index, records, nbytes = item
                    s = time.perf_counter()
                    meta = torch.frombuffer(bytearray(json.dumps(records).encode()), dtype=torch.uint8)
                    head = torch.tensor([BUCKET, meta.numel(), nbytes, index], dtype=torch.int64)
                    for t in (head.to(self.device), meta.to(self.device), self._slots[slot][:nbytes]):
                        self.group.broadcast(t).wait()
                    wire_s += time.perf_counter() - s
                    free.put(slot)
                    n_buckets, n_bytes = n_buckets + 1, n_bytes + sum(r["nbytes"] for r in records)
                end = ABORT if conv["error"] is not None else END
                self.group.broadcast(torch.tensor([end, 0, 0, n_buckets], dtype=torch.int64, device=self.device)).wait()
            except Exception:
                self.broken = True  # the group is out of step: peers must not wait on it for the timeout
                self.group.close()
                raise
            s = time.perf_counter()
            refused = None
            try:
                self._collect(receives, version, "receive")
            except TransferError as e:
                refused = e
            wire_s += time.perf_counter() - s
            if conv["error"] is not None:  # the cause; the engines only saw the abort
                raise TransferError(f"converting the weights of version {version} failed: {conv['error']!r}")
            if refused is not None:
                raise refused
        except Exception as e:
            stop.set()
            self.abort(version)
            raise as_transfer_error(e) from None
        s = time.perf_counter()
        self._collect({i: e.commit.remote(version, n_buckets) for i, e in enumerate(self.engines)}, version,
                      "commit", expect=version)
        end_t = time.perf_counter()
        return TransferStats(version, n_bytes, n_buckets, conv["tensors"], conv["s"], wire_s, end_t - s,
                             end_t - t0, setup_s=setup_s)

    def _collect(self, refs: dict, version: int, what: str, expect=None) -> None:
        """Every engine's answer; the first failure is raised (after all have answered or timed out)."""
        import ray

        first = None
        for i, ref in refs.items():
            try:
                got = ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                self.broken = True
                first = first or TransferError(f"engine {i} died or hung during the {what} of version {version}: "
                                               f"{type(e).__name__}")
                continue
            except Exception as e:  # noqa: BLE001
                first = first or as_transfer_error(e)
                continue
            if expect is not None and got != expect:
                first = first or TransferError(f"engine {i} reports version {got} after committing {expect}")
        if first is not None:
            raise first

    def abort(self, version: int) -> None:
        abort_staged(self.engines, version, self.timeout_s)


def _as_bytes(a: np.ndarray):
    """The array's bytes as a torch uint8 tensor, without a copy (JAX hands out read-only arrays; they are
    only read from here)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a.reshape(-1).view(np.uint8))
