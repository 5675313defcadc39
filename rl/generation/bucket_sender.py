"""One trainer process's end of the collective weight path: rank 0 of its own weight group.

Every trainer process that sends (process 0 alone on one host; each process of a multi-host trainer,
`rl.generation.multihost`) owns one group whose other ranks are the engines' receivers, and broadcasts
its own tensors into it, so the senders run side by side and no process relays another's bytes.

Per bucket (fixed size `bucket_bytes`; a larger tensor travels alone) the sender broadcasts
  1. a header int64[4]: kind (BUCKET / END / ABORT), metadata bytes, payload bytes, bucket index;
  2. the metadata (JSON: name, shape, dtype, checksum and its kind, offset of every tensor);
  3. the payload: the tensors packed at 64-byte-aligned offsets.
A thread packs bucket n+1 while bucket n is on the wire: `depth` buffers, kept between updates. The checksum
(`CHECKSUMS`) is XXH3 of each source array for host buffers (gloo), and for accelerator buffers (NCCL) the
`word_checksum` of the packed bucket, computed on the device: no byte goes to the host to be hashed.

With expert parallel engines a sender has one group per route (`RoutedSender`, rl.generation.weight_routes):
a bucket holds tensors wanted by the same groups and is packed (and hashed) once, then broadcast into each
of them in turn. So the buffers do not multiply with the routes: `depth` plus one for each further bucket
being filled (`open_buckets` = 2: the tensors every route wants, and the current route's experts), 3 in all,
where a stream per route held depth x routes (8 GB per sender in the 32-node recipe: 16 routes x 2 x 256 MB,
now 768 MB), and a tensor every route wants is packed and hashed once instead of once per route.
When the receivers read tensor-parallel slices (rl.generation.weight_slices), each route's group is sent
its box of every such tensor: every route then has pieces of its own in each layer, so one bucket per
route is filled at once (depth + routes buffers: 4.6 GB per sender at 256 MB buckets with 16 routes,
1.15 GB at 64 MB), where two would close a nearly empty bucket at every piece.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time

import numpy as np

from rl.generation import word_checksum
from rl.generation.torch_arrays import device_tensor, numpy_dtype, to_numpy, torch_dtype
from rl.generation.transfer_base import checksum

BUCKET, END, ABORT = 0, 1, 2
ALIGN = 64
CHECKSUMS = ("auto", "xxh3", word_checksum.KIND)


GROUP_DEVICES = ("auto", "cpu", "cuda")


def resolve_group_device(choice: str) -> str:
    """generation.weight_group_device -> where the collective path's buckets live: "cuda" (an NCCL group) or
    "cpu" (gloo). auto: cuda when this trainer runs on GPUs (JAX's backend) and torch sees CUDA."""
    if choice not in GROUP_DEVICES:
        raise ValueError(f"weight group device {choice!r}: expected one of {', '.join(GROUP_DEVICES)}")
    if choice == "cpu":
        return "cpu"
    import torch

    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("generation.weight_group_device: cuda, but torch sees no CUDA device here; use cpu "
                             "(gloo) or auto")
        return "cuda"
    import jax

    return "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"


def resolve_checksum(checksum_kind: str, device: str) -> str:
    """"auto": XXH3 where the buckets are host memory, else the word checksum on their device."""
    if checksum_kind not in CHECKSUMS:
        raise ValueError(f"checksum {checksum_kind!r}: expected one of {', '.join(CHECKSUMS)}")
    if checksum_kind == "auto":
        return "xxh3" if device == "cpu" else word_checksum.KIND
    return checksum_kind


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
    route_bytes: tuple[int, ...] = ()  # payload bytes sent into each route's group

    ERROR_BYTES = 480  # the error text travels to process 0 in a fixed-size array

    def to_array(self) -> np.ndarray:
        """Fixed size for a given number of routes, so every process's result can be gathered."""
        text = np.zeros(self.ERROR_BYTES, np.float64)
        if self.error is not None:
            raw = np.frombuffer(self.error.encode()[:self.ERROR_BYTES], np.uint8)
            text[:raw.size] = raw
        head = [self.buckets, self.bytes, self.tensors, self.convert_s, self.wire_s, self.error is not None,
                self.broken]
        return np.concatenate([np.array(head, np.float64), text, np.array(self.route_buckets, np.float64),
                               np.array(self.route_bytes, np.float64)])

    @classmethod
    def from_array(cls, a) -> "SendResult":
        a = np.asarray(a, np.float64)
        text, routes = a[7:7 + cls.ERROR_BYTES], a[7 + cls.ERROR_BYTES:]
        error = bytes(text.astype(np.uint8)).rstrip(b"\0").decode(errors="replace") if a[5] else None
        n = len(routes) // 2  # buckets, then bytes, per route
        return cls(int(a[0]), int(a[1]), int(a[2]), float(a[3]), float(a[4]), error, bool(a[6]),
                   tuple(int(x) for x in routes[:n]), tuple(int(x) for x in routes[n:]))


class BucketSender:
    """Rank 0 of one weight group: `open` serves its rendezvous, `connect` waits for the engines, `send`
    streams one update's tensors (every one into this group). `send` never raises: a failure is reported in
    its SendResult, after the tensors were drained (on a multi-host trainer they may hold collectives every
    process must join)."""

    def __init__(self, bucket_bytes: int, depth: int = 2, timeout_s: float = 600.0, device: str = "cpu",
                 checksum_kind: str = "auto"):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: expected >= 1")
        if depth < 1:
            raise ValueError(f"depth={depth}: expected >= 1")
        self.bucket_bytes, self.depth, self.timeout_s = bucket_bytes, depth, timeout_s
        self.device, self.backend = device, ("nccl" if device.startswith("cuda") else "gloo")
        self.checksum_kind = resolve_checksum(checksum_kind, device)
        self.group = None
        self._buffers = _Buffers(bucket_bytes, device)

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

    def send(self, named_arrays, version: int) -> SendResult:
        return stream_buckets([self], lambda name, a: [((0,), None, a)], named_arrays, version, self._buffers,
                              self.depth, 1, self.checksum_kind)


class _Buffers:
    """Bucket buffers by slot, kept between updates; a slot grows only for a tensor that travels alone."""

    def __init__(self, bucket_bytes: int, device: str):
        self.bucket_bytes, self.device, self.slots = bucket_bytes, device, {}

    def get(self, slot: int, nbytes: int):
        import torch

        buf = self.slots.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self.slots[slot] = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8,
                                                 device=self.device)
        return buf


def stream_buckets(senders: list, pieces, named_arrays, version: int, buffers: _Buffers, depth: int,
                   open_buckets: int, checksum_kind: str = "xxh3") -> SendResult:
    """Pack `named_arrays` into buckets and broadcast each into the groups that want its tensors:
    `pieces(name, array)` = [(target, box, part)]: the groups (a tuple of indices into `senders`, each a
    BucketSender holding its group) that are sent `part`, which is the whole array (box None) or its box
    (rl.generation.weight_slices; the record carries the box and the full shape).

    A packing thread keeps at most `open_buckets` buckets being filled, one per target set (when a new set
    needs one, the oldest is sent as it is), and hands full ones to this thread, which broadcasts each into
    its groups in turn (header, metadata, payload; every group numbers its own buckets from 0) while the next
    fill: depth + open_buckets - 1 buffers (`depth` = 2: the double buffer of one target set; one more per
    further set being filled). Then END into every group, or ABORT after a packing failure. A
    broadcast that fails leaves the groups out of step: every one is closed (its peers fail now, not at the
    timeout) and the result says `broken`. `checksum_kind`: "xxh3" of each source array as it is packed, or
    `word_checksum.KIND` of the packed bytes, computed where the bucket lives when it is full.
    """
    import torch

    out = SendResult(route_buckets=tuple(0 for _ in senders), route_bytes=tuple(0 for _ in senders))
    group_bytes = [0] * len(senders)
    free: queue.Queue = queue.Queue()
    for i in range(depth + open_buckets - 1):
        free.put(i)
    ready: queue.Queue = queue.Queue()
    conv = {"error": None}
    it = iter(named_arrays)
    limit = buffers.bucket_bytes

    def produce():
        filling: dict = {}  # target set -> [slot, records, end offset], oldest first

        def hand_over(target):
            slot, records, end = filling.pop(target)
            if checksum_kind == word_checksum.KIND:
                s = time.perf_counter()
                sums = word_checksum.word_checksums(buffers.slots[slot][:end],
                                                    [(r["offset"], r["nbytes"]) for r in records])
                for r, v in zip(records, sums):
                    r["checksum"] = v
                out.convert_s += time.perf_counter() - s
            ready.put((slot, target, records, end))

        def add(name, target, box, a, full_shape):
            dtype = numpy_dtype(a)
            bucket = filling.get(target)
            start = 0 if bucket is None else -(-bucket[2] // ALIGN) * ALIGN
            if bucket is not None and start + a.nbytes > limit:
                hand_over(target)
                bucket, start = None, 0
            if bucket is None:
                if len(filling) >= open_buckets:
                    hand_over(next(iter(filling)))
                bucket = filling[target] = [free.get(), [], 0]
            s = time.perf_counter()
            buf = buffers.get(bucket[0], start + a.nbytes)
            packed = a
            if not isinstance(a, np.ndarray):  # a device array (hf_tensors(on_host=False)): device to device
                target = buf[start:start + a.nbytes].view(torch_dtype(dtype)).view(tuple(a.shape))
                if a.nbytes:
                    target.copy_(device_tensor(a))
                if checksum_kind == "xxh3":  # XXH3 reads host bytes: what "auto" never picks for device buckets
                    packed = to_numpy(target)
            elif a.nbytes and buf.device.type == "cpu":  # one copy into the bucket, also out of a box's strides
                packed = buf[start:start + a.nbytes].numpy().view(a.dtype).reshape(a.shape)
                np.copyto(packed, a)
            elif a.nbytes:
                packed = np.ascontiguousarray(a)
                buf[start:start + a.nbytes].copy_(_as_bytes(packed))
            record = {"name": name, "shape": list(a.shape), "dtype": str(dtype), "hash": checksum_kind,
                      "checksum": checksum(packed) if checksum_kind == "xxh3" else None,  # else: when full
                      "offset": start, "nbytes": a.nbytes}
            if box is not None:
                record.update(box=[list(ab) for ab in box], full=list(full_shape))
            bucket[1].append(record)
            bucket[2] = start + a.nbytes
            out.convert_s += time.perf_counter() - s

        try:
            while (item := next(it, None)) is not None:
                name, whole = item
                out.tensors += 1
                s = time.perf_counter()
                parts = pieces(name, whole)
                out.convert_s += time.perf_counter() - s
                for target, box, a in parts:
                    add(name, target, box, a if hasattr(a, "nbytes") else np.asarray(a), np.shape(whole))
            for target in list(filling):
                hand_over(target)
        except BaseException as e:  # reported below
            conv["error"] = e
            try:  # the rest is drained unsent: on a multi-host trainer it holds gathers the others wait in
                for _ in it:
                    pass
            except BaseException:  # noqa: BLE001 - the source itself failed: nothing more to drain
                pass
        ready.put(None)

    threading.Thread(target=produce, daemon=True, name="weight-pack").start()
    counts = [0] * len(senders)
    wire_ok = all(s.group is not None for s in senders)
    if not wire_ok:
        out.error, out.broken = f"trainer sender is not in a weight group (version {version})", True
    while (item := ready.get()) is not None:  # after a wire failure: drained without sending
        slot, target, records, nbytes = item
        if wire_ok:
            s = time.perf_counter()
            try:
                meta = torch.frombuffer(bytearray(json.dumps(records).encode()), dtype=torch.uint8)
                meta = meta.to(buffers.device)
                for g in target:
                    head = torch.tensor([BUCKET, meta.numel(), nbytes, counts[g]], dtype=torch.int64)
                    for t in (head.to(buffers.device), meta, buffers.slots[slot][:nbytes]):
                        senders[g].group.broadcast(t).wait()
                    counts[g] += 1
                    group_bytes[g] += nbytes
                out.bytes += sum(r["nbytes"] for r in records)
            except Exception as e:  # noqa: BLE001 - a peer died: the groups are out of step
                wire_ok, out.error, out.broken = False, f"weight group broadcast failed: {e}", True
            out.wire_s += time.perf_counter() - s
        free.put(slot)
    if conv["error"] is not None and out.error is None:
        out.error = f"converting the weights of version {version} failed: {conv['error']!r}"
    if wire_ok:
        end = ABORT if out.error is not None else END
        try:
            for g, sender in enumerate(senders):
                sender.group.broadcast(torch.tensor([end, 0, 0, counts[g]], dtype=torch.int64,
                                                    device=buffers.device)).wait()
        except Exception as e:  # noqa: BLE001
            wire_ok, out.error, out.broken = False, out.error or f"weight group broadcast failed: {e}", True
    if not wire_ok:
        for sender in senders:
            sender.close()
    out.buckets, out.route_buckets, out.route_bytes = sum(counts), tuple(counts), tuple(group_bytes)
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
    """One weight group per route (rl.generation.weight_routes), fed by one stream: a tensor goes into each
    group whose receivers want it (`stream_buckets`). With one route it is exactly one BucketSender."""

    def __init__(self, bucket_bytes: int, depth: int = 2, timeout_s: float = 600.0, device: str = "cpu",
                 open_buckets: int = 2, checksum_kind: str = "auto"):
        first = BucketSender(bucket_bytes, depth, timeout_s, device, checksum_kind)  # the argument checks first
        if open_buckets < 1:
            raise ValueError(f"open_buckets={open_buckets}: expected >= 1")
        self._args = (bucket_bytes, depth, timeout_s, device, checksum_kind)
        self.device, self.checksum_kind = device, first.checksum_kind
        self.depth, self.open_buckets = depth, open_buckets
        self.backend = "nccl" if device.startswith("cuda") else "gloo"
        self.routes: list = []
        self.slices: list[dict] = []  # per route: name key -> box (rl.generation.weight_slices)
        self._keys: dict[str, int] = {}  # tensor name -> its key, kept between updates
        self.senders: list[BucketSender] = []
        self._buffers = _Buffers(bucket_bytes, device)  # shared by the routes' groups, kept between updates

    def open(self, host: str, routes: list, worlds: list[int], slices: list[dict] | None = None) -> list[int]:
        """Serve one group per route (of `worlds[g]` ranks); returns their ports. slices[g]: the boxes route g's
        receivers read (name key -> box, rl.generation.weight_slices); a tensor without one goes whole."""
        self.close()
        self.routes, self.senders = list(routes), [BucketSender(*self._args) for _ in routes]
        self.slices = list(slices) if slices is not None else [{} for _ in routes]
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
        from rl.generation.weight_slices import cut, name_key

        if not self.senders:  # never opened: drained all the same (collectives), reported as not in a group
            for _ in named_arrays:
                pass
            return SendResult(error=f"trainer sender is not in a weight group (version {version})", broken=True)
        routes, slices, keys = self.routes, self.slices, self._keys
        sliced = any(slices)

        def pieces(name, a):
            """Each group is sent its route's box of the tensor; groups that want the same box share the piece."""
            targets = [g for g, route in enumerate(routes) if wants(route, name)]
            if not sliced:
                return [(tuple(targets), None, a)]
            key = keys[name] if name in keys else keys.setdefault(name, name_key(name))
            by_box: dict = {}
            for g in targets:
                by_box.setdefault(slices[g].get(key), []).append(g)
            return [(tuple(gs), box, cut(a, box)) for box, gs in by_box.items()]

        # Sliced, every route has pieces of its own in every layer: one bucket being filled per route (and
        # one for what every route wants), else each piece would close the previous route's bucket.
        open_buckets = len(routes) + 1 if sliced else min(self.open_buckets, len(routes))
        return stream_buckets(self.senders, pieces, named_arrays, version, self._buffers, self.depth, open_buckets,
                              self.checksum_kind)
