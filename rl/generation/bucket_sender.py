"""One trainer process's end of the collective weight path: rank 0 of its own weight group.

Every trainer process that sends (process 0 alone on one host; each process of a multi-host trainer,
`rl.generation.multihost`) owns one group whose other ranks are the engines' receivers, and broadcasts
its own tensors into it, so the senders run side by side and no process relays another's bytes.

Per bucket (fixed size `bucket_bytes`; a larger tensor travels alone) the sender broadcasts
  1. a header int64[4]: kind (BUCKET / END / ABORT), metadata bytes, payload bytes, bucket index;
  2. the metadata (JSON: name, shape, dtype, XXH3, offset of every tensor);
  3. the payload: the tensors packed at 64-byte-aligned offsets.
A thread packs bucket n+1 (XXH3 of each source array) while bucket n is on the wire: `depth` buffers,
kept between updates.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time

import numpy as np

from rl.generation.transfer_base import checksum

BUCKET, END, ABORT = 0, 1, 2
ALIGN = 64


@dataclasses.dataclass
class SendResult:
    """What one sender did in one update; `error` set = this sender's part failed (the engines saw ABORT or
    a broken group), `broken` = its group can no longer be used."""
    buckets: int = 0
    bytes: int = 0
    tensors: int = 0
    convert_s: float = 0.0
    wire_s: float = 0.0
    error: str | None = None
    broken: bool = False
    route_buckets: tuple[int, ...] = ()  # buckets sent into each route's group (rl.generation.weight_routes)

    ERROR_BYTES = 480  # the error text travels to process 0 in a fixed-size array

    def to_array(self) -> np.ndarray:
        """Fixed size for a given number of routes, so every process's result can be gathered."""
        text = np.zeros(self.ERROR_BYTES, np.float64)
        if self.error is not None:
            raw = np.frombuffer(self.error.encode()[:self.ERROR_BYTES], np.uint8)
            text[:raw.size] = raw
        head = [self.buckets, self.bytes, self.tensors, self.convert_s, self.wire_s, self.error is not None,
                self.broken]
        return np.concatenate([np.array(head, np.float64), text, np.array(self.route_buckets, np.float64)])

    @classmethod
    def from_array(cls, a) -> "SendResult":
        a = np.asarray(a, np.float64)
        text, routes = a[7:7 + cls.ERROR_BYTES], a[7 + cls.ERROR_BYTES:]
        error = bytes(text.astype(np.uint8)).rstrip(b"\0").decode(errors="replace") if a[5] else None
        return cls(int(a[0]), int(a[1]), int(a[2]), float(a[3]), float(a[4]), error, bool(a[6]),
                   tuple(int(x) for x in routes))

    @classmethod
    def combine(cls, parts: list["SendResult"], tensors: int, nbytes: int) -> "SendResult":
        """One process's result over its routes' groups (the stages ran side by side); tensors / nbytes: the
        model's, counted once (a tensor every route wants crossed the wire once per group)."""
        error = next((p.error for p in parts if p.error), None)
        return cls(sum(p.buckets for p in parts), nbytes, tensors, max(p.convert_s for p in parts),
                   max(p.wire_s for p in parts), error, any(p.broken for p in parts), tuple(p.buckets for p in parts))


class BucketSender:
    """Rank 0 of one weight group: `open` serves its rendezvous, `connect` waits for the engines, `send`
    streams one update's tensors. `send` never raises: a failure is reported in its SendResult, after the
    tensors were drained (on a multi-host trainer they may hold collectives every process must join)."""

    def __init__(self, bucket_bytes: int, depth: int = 2, timeout_s: float = 600.0, device: str = "cpu"):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: expected >= 1")
        self.bucket_bytes, self.depth, self.timeout_s = bucket_bytes, depth, timeout_s
        self.device, self.backend = device, ("nccl" if device.startswith("cuda") else "gloo")
        self.group = None
        self._slots: list = [None] * depth  # the double buffer, kept between updates

    def open(self, host: str, world: int) -> int:
        """Serve a new group's rendezvous on `host`; returns its port (the engines join it there)."""
        from rl.generation.weight_group import WeightGroup

        self.close()
        self.group = WeightGroup(host, 0, 0, world, self.backend, self.timeout_s)
        return self.group.port

    def connect(self) -> None:
        """Blocks until every engine rank has joined."""
        self.group.connect()

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def _slot(self, i: int, nbytes: int):
        import torch

        if self._slots[i] is None or self._slots[i].numel() < nbytes:
            self._slots[i] = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8, device=self.device)
        return self._slots[i]

    def send(self, named_arrays, version: int) -> SendResult:
        import torch

        out = SendResult()
        free: queue.Queue = queue.Queue()
        for i in range(self.depth):
            free.put(i)
        ready: queue.Queue = queue.Queue()
        conv = {"error": None}

        it = iter(named_arrays)

        def produce():
            try:
                slot, index, off, records = free.get(), 0, 0, []
                s = time.perf_counter()
                while (item := next(it, None)) is not None:
                    name, a = item
                    a = np.ascontiguousarray(a)
                    start = -(-off // ALIGN) * ALIGN
                    if records and start + a.nbytes > self.bucket_bytes:
                        out.convert_s += time.perf_counter() - s
                        ready.put((slot, index, records, off))
                        slot, index, off, records, start = free.get(), index + 1, 0, [], 0
                        s = time.perf_counter()
                    buf = self._slot(slot, start + a.nbytes)  # grows only for a tensor that travels alone
                    if a.nbytes:
                        buf[start:start + a.nbytes].copy_(_as_bytes(a))
                    records.append({"name": name, "shape": list(a.shape), "dtype": str(a.dtype),
                                    "checksum": checksum(a), "offset": start, "nbytes": a.nbytes})
                    off, out.tensors = start + a.nbytes, out.tensors + 1
                out.convert_s += time.perf_counter() - s
                if records:
                    ready.put((slot, index, records, off))
            except BaseException as e:  # reported below
                conv["error"] = e
                try:  # the rest is drained unsent: on a multi-host trainer it holds gathers the others wait in
                    for _ in it:
                        pass
                except BaseException:  # noqa: BLE001 - the source itself failed: nothing more to drain
                    pass
            ready.put(None)

        threading.Thread(target=produce, daemon=True, name="weight-pack").start()
        wire_ok = self.group is not None
        if not wire_ok:
            out.error, out.broken = f"trainer sender is not in a weight group (version {version})", True
        while (item := ready.get()) is not None:  # after a wire failure: drained without sending
            slot, index, records, nbytes = item
            if wire_ok:
                s = time.perf_counter()
                try:
                    meta = torch.frombuffer(bytearray(json.dumps(records).encode()), dtype=torch.uint8)
                    head = torch.tensor([BUCKET, meta.numel(), nbytes, index], dtype=torch.int64)
                    for t in (head.to(self.device), meta.to(self.device), self._slots[slot][:nbytes]):
                        self.group.broadcast(t).wait()
                    out.buckets, out.bytes = out.buckets + 1, out.bytes + sum(r["nbytes"] for r in records)
                except Exception as e:  # noqa: BLE001 - a peer died: the group is out of step
                    wire_ok, out.error, out.broken = False, f"weight group broadcast failed: {e}", True
                out.wire_s += time.perf_counter() - s
            free.put(slot)
        if conv["error"] is not None and out.error is None:
            out.error = f"converting the weights of version {version} failed: {conv['error']!r}"
        if wire_ok:
            end = ABORT if out.error is not None else END
            try:
                self.group.broadcast(torch.tensor([end, 0, 0, out.buckets], dtype=torch.int64,
                                                  device=self.device)).wait()
            except Exception as e:  # noqa: BLE001
                wire_ok, out.error, out.broken = False, out.error or f"weight group broadcast failed: {e}", True
        if not wire_ok and self.group is not None:
            self.close()  # peers blocked in this group fail now instead of at the timeout
        return out


def _as_bytes(a: np.ndarray):
    """The array's bytes as a torch uint8 tensor, without a copy (JAX hands out read-only arrays; they are
    only read from here)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a.reshape(-1).view(np.uint8))


class RoutedSender:
    """One BucketSender per route (rl.generation.weight_routes): every tensor streams into each group whose
    receivers want it, the groups side by side. With one route it is exactly one BucketSender."""

    def __init__(self, bucket_bytes: int, depth: int = 2, timeout_s: float = 600.0, device: str = "cpu"):
        BucketSender(bucket_bytes, depth, timeout_s, device)  # the argument checks, before anything is built
        self._args = (bucket_bytes, depth, timeout_s, device)
        self.backend = "nccl" if device.startswith("cuda") else "gloo"
        self.routes: list = []
        self.senders: list[BucketSender] = []

    def open(self, host: str, routes: list, worlds: list[int]) -> list[int]:
        """Serve one group per route (of `worlds[g]` ranks); returns their ports."""
        self.close()
        self.routes, self.senders = list(routes), [BucketSender(*self._args) for _ in routes]
        return [s.open(host, w) for s, w in zip(self.senders, worlds)]

    def connect(self) -> None:
        """Every group at once: a receiver joins its group of each sender in turn, so none may wait on another."""
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.senders))) as pool:
            for f in [pool.submit(s.connect) for s in self.senders]:
                f.result()

    def close(self) -> None:
        for s in self.senders:
            s.close()

    def send(self, named_arrays, version: int) -> SendResult:
        from rl.generation.weight_routes import wants

        if not self.senders:  # never opened: drained all the same (collectives), reported as not in a group
            for _ in named_arrays:
                pass
            return SendResult(error=f"trainer sender is not in a weight group (version {version})", broken=True)
        if len(self.senders) == 1:
            r = self.senders[0].send(named_arrays, version)
            r.route_buckets = (r.buckets,)
            return r
        done = object()
        feeds = [queue.Queue(maxsize=2) for _ in self.senders]
        results: list = [None] * len(self.senders)

        def stream(q):
            while (item := q.get()) is not done:
                yield item

        def run(g):
            results[g] = self.senders[g].send(stream(feeds[g]), version)

        threads = [threading.Thread(target=run, args=(g,), daemon=True, name=f"weight-route-{g}")
                   for g in range(len(self.senders))]
        for t in threads:
            t.start()
        error, tensors, nbytes = None, 0, 0
        try:
            for name, a in named_arrays:  # drained whole: on a multi-host trainer it holds collectives
                tensors, nbytes = tensors + 1, nbytes + a.nbytes
                for g, route in enumerate(self.routes):
                    if wants(route, name):
                        feeds[g].put((name, a))
        except BaseException as e:  # noqa: BLE001 - reported in the result
            error = f"converting the weights of version {version} failed: {e!r}"
        for q in feeds:
            q.put(done)
        for t in threads:
            t.join()
        out = SendResult.combine(results, tensors, nbytes)
        out.error = error or out.error
        return out
