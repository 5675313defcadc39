"""The engine end of the collective weight path (`rl.generation.collective`): a `Receiver` joins its weight groups,
takes each sender's buckets into staging buffers it keeps between updates, verifies each bucket (XXH3 or the word
checksum of the received bytes; name / shape / dtype, and the slice its rank keeps, against the engine's manifest)
while the next one arrives, and holds the verified tensors until the commit (or drops them on abort).

Used by the engine actor (`rl.generation.vllm_actor`) and by each worker of a Ray-executor engine
(`rl.generation.vllm_worker_weights`).
"""

from __future__ import annotations

import concurrent.futures
import json
import queue
import time

import numpy as np

from rl.generation import weight_routes, word_checksum
from rl.generation.bucket_sender import ABORT, END
from rl.generation.torch_arrays import torch_dtype
from rl.generation.transfer_base import TransferError, checksum, record_dtype
from rl.generation.weight_group import WeightGroup
from rl.generation.weight_routes import wants
from rl.generation.weight_slices import expand


def receive_device(backend: str) -> str:
    """Where a receiver of a group on `backend` takes its buckets: NCCL moves CUDA tensors only (this process's
    current device: a vLLM worker's own GPU), gloo host ones."""
    if backend == "nccl":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


STAGINGS = ("auto", "device", "host")
RING = 3  # device receive buffers when an update is staged in host memory: one arriving, one being verified, a spare


class Receiver:
    """Engine side: joins every sender's group, stages verified buckets, hands them to the apply at commit.

    `staging`, for buckets received on an accelerator: "device" keeps every bucket of an update where it
    arrived until the commit (an update's worth of device memory beside the weights); "host" receives into
    `RING` device buffers, verifies each bucket there, then copies it to host memory kept between updates and
    frees the buffer for the next, so the commit is a host-to-device copy (the design for engines whose
    weights fill the GPU, docs/vllm.md); "auto": device when the update fits in the device's free memory
    with 10 % and 1 GiB to spare, else host. Buckets received in host memory are staged where they are (unless
    "host" is asked for: then through the ring all the same, which is how the tests run that path)."""

    def __init__(self, staging: str = "auto"):
        if staging not in STAGINGS:
            raise ValueError(f"staging {staging!r}: expected one of {', '.join(STAGINGS)}")
        self.staging = staging
        self.groups: list[WeightGroup] = []
        self.version: int | None = None
        self.views: list[list[tuple[str, np.ndarray]]] = []
        self._buffers: dict = {}  # (sender, bucket) -> bytes, kept between updates: no page faults after the first
        self._ring: dict = {}  # slot -> a device receive buffer (host staging)
        self._expanded: dict = {}  # name -> the full-shape array a slice is handed to the apply in, kept likewise
        self.verify_s = 0.0
        self.route, self.route_index, self.boxes = None, 0, {}
        self.device = "cpu"  # where the buckets are received: a CUDA device on an NCCL group

    def join(self, senders, rank: int, world: int, backend: str, timeout_s: float, route=None,
             route_index: int = 0) -> int:
        """Join the group of each sender ([host, port] each) as `rank`; blocks until each is complete. The
        groups are joined in order: every sender connects its own at the same time, so none waits on another.
        `route`: what this receiver reads (rl.generation.weight_routes.reads: the routed experts it holds,
        None = all, and the tensor-parallel box of each tensor it reads a slice of), whose group is number
        `route_index` of every sender."""
        self.leave()
        self.route, boxes = weight_routes.reads(route)
        self.boxes, self.route_index = dict(boxes), route_index
        self.device = receive_device(backend)
        for host, port in senders:
            self.groups.append(WeightGroup(host, int(port), rank, world, backend, timeout_s).connect())
        return rank

    def join_placed(self, senders_by_route, placement, routes, local_rank: int, backend: str,
                    timeout_s: float) -> int:
        """Join as rank `local_rank` of an engine placed by `weight_routes.plan`: placement[local_rank] =
        (route index, rank in its group, group size); senders_by_route[g] = every sender's [host, port]."""
        g, rank, world = placement[local_rank]
        return self.join(senders_by_route[g], rank, world, backend, timeout_s, routes[g], g)

    def leave(self) -> None:
        groups, self.groups = self.groups, []
        for g in groups:
            g.close()

    def _buffer(self, key, nbytes: int, device: str, kept: dict | None = None):
        import torch

        kept = self._buffers if kept is None else kept
        b = kept.get(key)
        if b is None or b.numel() < nbytes or b.device != torch.device(device):
            pin = device == "cpu" and torch.cuda.is_available()  # host staging of device buckets: fast copies
            b = kept[key] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device, pin_memory=pin)
        return b[:nbytes]

    def _stage_on_host(self, manifest) -> bool:
        """Whether this update's buckets go to host memory after verification (see the class doc)."""
        if self.staging == "host":  # also on host buffers, where it only adds a copy: how the tests run it
            return True
        if self.device == "cpu" or self.staging == "device":
            return False
        import torch

        wanted = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for name, (shape, dtype) in manifest.items()
                     if wants(self.route, name))
        free, _ = torch.cuda.mem_get_info(torch.device(self.device))
        return wanted * 1.1 + (1 << 30) > free

    def receive(self, version: int, check, manifest) -> int:
        """Phase 1 of `version`: take every bucket every sender broadcasts (one thread per group); returns the
        bucket count once every tensor arrived intact, or raises TransferError naming the first bad one (after
        draining every stream, so the groups stay in step). A bucket checked with the word checksum is verified
        where it was received and handed on as torch views of it (on the NCCL path: never copied to the host);
        an XXH3 one as numpy views of its host bytes."""
        import torch

        device = self.device
        on_host = self._stage_on_host(manifest)
        ring: queue.Queue = queue.Queue()
        for slot in range(RING if on_host else 0):
            ring.put(slot)
        if not self.groups:
            raise TransferError(f"engine is not in a weight group (version {version})")
        self.clear()
        self.version, t_verify = version, [0.0]
        verifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-verify")
        pending = []  # (sender, bucket index, future)

        def verify(sender, index, records, payload, slot=None):
            s = time.perf_counter()
            kinds = [r.get("hash", "xxh3") for r in records]
            of = f" of sender {sender}" if len(self.groups) > 1 else ""
            try:  # whatever happens, a ring buffer goes back: a stream waiting for one would hang
                unknown = sorted(set(kinds) - {"xxh3", word_checksum.KIND})
                if unknown:
                    raise TransferError(f"bucket {index}{of} of version {version}: checksum kind {unknown[0]!r}, "
                                        f"expected xxh3 or {word_checksum.KIND}")
                on_device = [(r["offset"], r["nbytes"]) for r, k in zip(records, kinds) if k != "xxh3"]
                try:
                    sums = iter(word_checksum.word_checksums(payload, on_device))
                except ValueError as e:  # a record pointing outside the payload or off a word boundary
                    raise TransferError(f"bucket {index}{of} of version {version}: {e}") from None
                if slot is not None:  # verified where it arrived; the apply reads the host copy
                    payload = self._buffer((sender, index), payload.numel(), "cpu").copy_(payload)
            finally:
                if slot is not None:
                    ring.put(slot)
            host = None
            if "xxh3" in kinds:
                host = payload.cpu().numpy() if payload.device.type != "cpu" else payload.numpy()
            out = []
            for r, kind in zip(records, kinds):
                where = f"tensor {r['name']!r} (bucket {index}{of}, version {version})"
                if kind == "xxh3":
                    a = host[r["offset"]:r["offset"] + r["nbytes"]]
                    got = checksum(a)
                else:
                    a, got = payload[r["offset"]:r["offset"] + r["nbytes"]], next(sums)
                if got != r["checksum"]:
                    raise TransferError(f"{where}: checksum mismatch ({kind} {got:#018x}, expected "
                                        f"{r['checksum']:#018x}): the bytes were corrupted in transit")
                box = None if r.get("box") is None else tuple(tuple(ab) for ab in r["box"])
                try:
                    check(r["name"], tuple(r["full"] if box else r["shape"]), record_dtype(r["dtype"]))
                    if box is not None:
                        self._check_box(r["name"], box, r["shape"])
                except (KeyError, ValueError) as e:
                    raise TransferError(f"{where}: rejected by the engine: {e}") from None
                if kind == "xxh3":
                    piece = a.view(record_dtype(r["dtype"])).reshape(r["shape"])
                else:
                    piece = a.view(torch_dtype(record_dtype(r["dtype"]))).reshape(r["shape"])
                out.append((r["name"], piece) if box is None else (r["name"], piece, box, tuple(r["full"])))
            t_verify[0] += time.perf_counter() - s
            return out

        def drain(sender: int, group: WeightGroup) -> TransferError | None:
            head = torch.empty(4, dtype=torch.int64, device=device)
            while True:
                group.broadcast(head).wait()
                kind, n_meta, n_payload, index = (int(x) for x in head.tolist())
                if kind == ABORT:
                    return TransferError(f"sender {sender} aborted version {version}")
                if kind == END:
                    return None
                meta = torch.empty(n_meta, dtype=torch.uint8, device=device)
                group.broadcast(meta).wait()
                slot = ring.get() if on_host else None
                payload = (self._buffer(slot, n_payload, device, self._ring) if on_host
                           else self._buffer((sender, index), n_payload, device))
                group.broadcast(payload).wait()
                records = json.loads(meta.cpu().numpy().tobytes())
                pending.append((sender, index, verifier.submit(verify, sender, index, records, payload, slot)))

        error = None
        try:
            with concurrent.futures.ThreadPoolExecutor(len(self.groups), thread_name_prefix="weight-recv") as readers:
                ended = [readers.submit(drain, i, g) for i, g in enumerate(self.groups)]
            for f in ended:  # a broken group raises here (after every other stream ended)
                error = error or f.result()
            for _, _, f in sorted(pending, key=lambda p: p[:2]):
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

    def _check_box(self, name: str, box, shape) -> None:
        """A slice must be the one this receiver reads (rl.generation.weight_slices); a whole tensor always does."""
        want = self.boxes.get(name)
        if want is None:
            raise ValueError(f"got the slice {[list(ab) for ab in box]} of a tensor this receiver reads whole")
        if box != want:
            raise ValueError(f"got the slice {[list(ab) for ab in box]}, this receiver reads "
                             f"{[list(ab) for ab in want]}")
        if tuple(shape) != tuple(b - a for a, b in box):
            raise ValueError(f"a slice of shape {tuple(shape)} for the box {[list(ab) for ab in box]}")

    def _complete(self, version: int, manifest) -> TransferError | None:
        seen = set()
        for bucket in self.views:
            for name, *_ in bucket:
                if name in seen:
                    return TransferError(f"tensor {name!r} sent twice in version {version}")
                seen.add(name)
        missing = sorted(n for n in manifest if n not in seen and wants(self.route, n))
        if missing:
            return TransferError(f"tensor {missing[0]!r} missing from version {version} (partial update: "
                                 f"{len(missing)} of {len(manifest)} tensors never arrived)")
        return None

    def tensors(self, version: int, num_buckets):
        """The staged tensors, each whole: a slice comes as a full-shape array holding it at its box (the rest
        never written: the loader reads only the box, rl.generation.weight_slices); num_buckets: the
        update's bucket count, or one per route (into each group)."""
        if not isinstance(num_buckets, int):
            num_buckets = num_buckets[self.route_index]
        if self.version != version or len(self.views) != num_buckets:
            raise TransferError(f"commit of version {version} with {num_buckets} buckets, but version "
                                f"{self.version} staged {len(self.views)}")
        for bucket in self.views:
            for name, piece, *sliced in bucket:
                if sliced:
                    piece = self._expanded[name] = expand(piece, *sliced, out=self._expanded.get(name))
                yield name, piece

    def clear(self) -> None:
        self.version, self.views = None, []
