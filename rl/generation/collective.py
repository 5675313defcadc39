"""The collective weight path (`generation.weight_transport: collective`, issue 12 item 2).

The data plane leaves the Ray object store. Each sending trainer process (process 0 of a one-host
trainer; every process of a multi-host one, each sending the tensors its own devices hold:
`m3jax.hf.owned`) is rank 0 of its own weight group, whose other ranks are the engines (one rank, or one
per worker of a Ray-executor engine: rl.generation.vllm_worker_weights). A group is *not* the
process-global default group (vLLM owns that one in each engine process, and the trainer must not need a
global init): a TCPStore rendezvous plus a `ProcessGroupGloo` (CPU tensors) or `ProcessGroupNCCL` (CUDA
tensors) object built directly on it, the way NeMo-RL's stateless group does. The same code runs both
backends; only the buffers' device differs.

vLLM 0.32's own weight-transfer API (`LLM.init_weight_transfer_engine` / `update_weights`) was the first
choice, but none of its backends (nccl, ipc, sparse_nccl, sharded_rdt, ...) runs on a CPU (stack-notes
§8b), and a custom backend would still need this group; the engine keeps vLLM's `load_weights` for the
apply (rl.generation.inplace), so only the wire is ours.

Each sender streams its buckets (`rl.generation.bucket_sender`: header, metadata, payload, double
buffered), one group per route (`rl.generation.weight_routes`: a worker of an expert-parallel engine is
in the group of the experts it holds, and receives only those experts and every other tensor). Each
engine (`rl.generation.collective_receiver.Receiver`) receives every group in its own thread into staging buffers
it keeps between updates and verifies bucket n (XXH3 of the received bytes, name / shape / dtype against its checkpoint
manifest) while bucket n+1 arrives; once every sender has ended it checks that every tensor of the
checkpoint came exactly once. This is phase 1; process 0 then commits on every engine only if every engine
accepted and every sender finished (phase 2 = the apply), else aborts everywhere: a corrupted, refused or
partial update leaves every engine on its old version, with the tensor named.

A failure inside a group (an engine dies mid-broadcast) fails the whole update, all engines keep the
old version, the pool replaces the dead engine, and the next update builds new groups.
"""

from __future__ import annotations

import socket
import time

import numpy as np

from rl.generation import weight_routes, weight_slices
from rl.generation.bucket_sender import RoutedSender, SendResult
from rl.generation.transfer_base import TransferError, TransferStats, abort_staged, as_transfer_error


class Alone:
    """The peers of a trainer that is one process (rl.generation.multihost.JaxPeers is the other kind):
    `agree` hands out process 0's value, `gather` stacks every process's."""

    def agree(self, value) -> np.ndarray:
        return np.asarray(value)

    def gather(self, value) -> np.ndarray:
        return np.asarray(value)[None]


def encode_address(host: str, port: int) -> np.ndarray:
    """An IPv4 address and port as int64[5], the form the senders exchange them in."""
    try:
        return np.array([*socket.inet_aton(host), port], np.int64)
    except OSError:
        raise ValueError(f"weight group address {host!r}: expected an IPv4 address") from None


def decode_address(a) -> tuple[str, int]:
    a = [int(x) for x in np.asarray(a)]
    return socket.inet_ntoa(bytes(a[:4])), a[4]


def setup_message(status: int, ip=(0, 0, 0, 0), routes: int = 0, experts: int = 0, boxes: int = 0) -> np.ndarray:
    """The first step every sender takes in an update, process 0's value agreed by all (int64[8]): status
    (1 = build the groups, 0 = keep them, -1 = no update), process 0's IPv4 address, the number of routes and
    of experts (the shape of the routes table agreed next) and of boxes (the rows of the slices table,
    rl.generation.weight_slices, agreed after it when there are any)."""
    return np.array([status, *ip, routes, experts, boxes], np.int64)


def agree_routes(peers, message, table=None, boxes=None) -> tuple[list, list[int], list[dict]]:
    """The routes table and the slices table (rl.generation.weight_slices) agreed by every sender, after
    process 0's `setup_message`: process 0 passes its tables, the others None (the shapes are in the
    message). Returns the routes, each group's size, and per route name key -> box."""
    n_routes, n_experts, n_boxes = (int(x) for x in np.asarray(message)[5:8])
    if table is None:
        table = np.zeros((n_routes, 2 + n_experts), np.int64)
    routes, worlds = weight_routes.decode(peers.agree(table))
    if not n_boxes:
        return routes, worlds, [{} for _ in routes]
    mine = boxes is not None
    if not mine:
        boxes = np.zeros((n_boxes, weight_slices.WIDTH), np.int64)
    agreed = np.asarray(peers.agree(boxes), np.int64)
    if mine and not np.array_equal(agreed, boxes):  # every process would cut other boxes than the receivers read
        raise TransferError("the slices table changed on its way to the trainer processes")
    return routes, worlds, weight_slices.decode(agreed, n_routes)


class CollectiveTransport:
    """Process 0's side of the collective path over engine actors exposing weight_receivers / join_weight_group /
    receive_weights / commit / abort: it sends its own tensors like every other sender and alone talks to
    the engines. Kept by the pool across updates (the groups cost a rendezvous) until the engines change or
    a push fails inside a group (`broken`). `peers`: the other trainer processes (each a RoutedSender run by
    `rl.generation.multihost.follow_push`, in the same collective steps), or none."""

    def __init__(self, engines, bucket_bytes: int, depth: int = 2, timeout_s: float = 600.0, device: str = "cpu",
                 peers=None, checksum_kind: str = "auto"):
        self.engines, self.timeout_s = list(engines), timeout_s
        self.sender = RoutedSender(bucket_bytes, depth, timeout_s, device, checksum_kind=checksum_kind)
        self.peers = peers or Alone()
        self.connected = self.broken = False

    def connect(self) -> float:
        """The steps every sender takes together before an update (`rl.generation.multihost.follow_push` is
        the other processes' side): agree whether to (re)build the groups, and if so the routes
        (`weight_routes.plan`: one group per set of experts the receivers hold) and the leader's address;
        gather every sender's ports, have every engine rank join its route's group of each sender, and
        agree that every group connected. Returns the seconds it took (0 when kept)."""
        import ray

        if self.connected:
            self.peers.agree(setup_message(0))
            return 0.0
        t = time.perf_counter()
        ip = encode_address(ray.util.get_node_ip_address(), 0)[:4]
        try:  # one entry per receiving rank: the experts it holds (an engine on vLLM's Ray executor: per worker)
            receivers = ray.get([e.weight_receivers.remote() for e in self.engines], timeout=self.timeout_s)
            routes, placement, slices = weight_routes.plan(receivers)
            worlds = [1 + sum(1 for p in placement for g, _, _ in p if g == r) for r in range(len(routes))]
            experts = 1 + max([e for r in routes for e in (r or ())], default=-1)
            table, boxes = weight_routes.encode(routes, worlds, experts), weight_slices.encode(slices)
        except Exception as e:  # noqa: BLE001 - a dead engine: no update, fresh groups next time
            self.peers.agree(setup_message(-1, ip))
            self.broken = True
            raise TransferError(f"asking {len(self.engines)} engines for their weight receivers failed: {e}") from None
        message = self.peers.agree(setup_message(1, ip, len(routes), experts, len(boxes)))
        _, _, keyed = agree_routes(self.peers, message, table, boxes)
        host = decode_address([*ip, 0])[0]
        error = None
        try:
            ports = self.sender.open(host, routes, worlds, keyed)
        except Exception as e:  # noqa: BLE001 - the peers still wait for these addresses
            ports, error = [0] * len(routes), e
        addresses = self.peers.gather(np.stack([encode_address(host, p) for p in ports]))  # [senders, routes, 5]
        by_route = [[decode_address(a) for a in addresses[:, g]] for g in range(len(routes))]
        try:
            if error is not None:
                raise error
            if any(port == 0 for group in by_route for _, port in group):
                raise TransferError("a trainer process could not open its weight groups")
            wire_routes = [{"experts": None if r is None else sorted(r),
                            "slices": {n: [list(ab) for ab in box] for n, box in sl.items()}}
                           for r, sl in zip(routes, slices)]
            joins = [e.join_weight_group.remote(by_route, p, wire_routes, self.sender.backend, self.timeout_s)
                     for e, p in zip(self.engines, placement)]
            self.sender.connect()
            ray.get(joins, timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - an engine that died or never joined
            error = e
        if error is not None or not np.all(self.peers.gather(np.array([error is None], np.int64))):
            self.sender.close()
            self.broken = True
            raise TransferError(f"building the weight groups of {len(self.engines)} engines failed: "
                                f"{error or 'another trainer process could not connect its groups'}") from None
        self.connected = True
        return time.perf_counter() - t

    def close(self) -> None:
        import ray

        if self.connected:
            for ref in [e.leave_weight_group.remote() for e in self.engines]:
                try:
                    ray.get(ref, timeout=10)
                except Exception:  # noqa: BLE001 - a dead engine has no group to leave
                    pass
        self.sender.close()
        self.connected = False

    def push(self, named_arrays, version: int) -> TransferStats:
        t0 = time.perf_counter()
        setup_s = self.connect()  # TransferError: nothing was sent, every sender was told
        receives = {i: e.receive_weights.remote(version) for i, e in enumerate(self.engines)}
        results = [SendResult.from_array(a) for a in self.peers.gather(
            self.sender.send(named_arrays, version).to_array())]
        if any(r.broken for r in results):
            self.broken = True  # the next update builds every group afresh
        s = time.perf_counter()
        try:
            refused = None
            try:
                self._collect(receives, version, "receive")
            except TransferError as e:
                refused = e
            failed = [(p, r.error) for p, r in enumerate(results) if r.error]
            if failed:  # the cause; the engines only saw an abort or a broken stream
                raise TransferError(f"trainer process {failed[0][0]}: {failed[0][1]}")
            if refused is not None:
                raise refused
        except Exception as e:
            self.abort(version)
            raise as_transfer_error(e) from None
        wire_s = max(r.wire_s for r in results) + time.perf_counter() - s
        n_buckets = sum(r.buckets for r in results)
        per_route = [sum(r.route_buckets[g] for r in results) for g in range(len(self.sender.routes))]
        s = time.perf_counter()
        self._collect({i: e.commit.remote(version, per_route) for i, e in enumerate(self.engines)}, version,
                      "commit", expect=version)
        end_t = time.perf_counter()
        return TransferStats(version, sum(r.bytes for r in results), n_buckets, sum(r.tensors for r in results),
                             max(r.convert_s for r in results), wire_s, end_t - s, end_t - t0, setup_s=setup_s,
                             senders=sum(r.bytes > 0 for r in results),
                             route_bytes=tuple(sum(r.route_bytes[g] for r in results) for g in range(len(per_route))))

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
