"""A vLLM pool behind a multi-host trainer: process 0 owns the pool, every process sees its results.

The trainer is SPMD: every training process runs the same step on the same prompts. Only one of them
may talk to the engines (one pool, not one per host), but all of them need the rollout. So process 0
generates / scores and broadcasts what came back; the others receive the broadcasts.

Weights: on the `ray` transport process 0 sends everything, so every tensor is gathered to it (`hf_tensors`
is a collective every process iterates). On the `collective` transport every process sends the tensors its
own devices hold (`m3jax.hf.owned`) through its own weight group (`rl.generation.bucket_sender`), side by
side: process 0's `CollectiveTransport` talks to the engines, the others run `follow_push`, and both
sides take the same collective steps (`JaxPeers`) in the same order.
"""

from __future__ import annotations

import numpy as np
from jax.experimental import multihost_utils

from rl.generation.base import Rollout
from rl.generation.bucket_sender import RoutedSender
from rl.generation.collective import agree_routes, decode_address, encode_address, setup_message
from rl.generation.pool_config import PoolError
from m3jax.hf.tensors import host_views
from rl.generation.transfer import TransferError, TransferStats, model_tensors
from sharding.host_values import broadcast_from_first_process


def _from_zero(value):
    return broadcast_from_first_process(value)


def started_on_zero(start, is_zero: bool):
    """`start()` (the pool) on process 0, None on the others; its failure raised on every process (a collective:
    every process calls it). A pool that failed to start on process 0 (Ray unreachable, a bad model directory) left
    the others in their next collective until jax's shutdown barrier aborted both minutes later, the cause named
    nowhere but in process 0's log."""
    pool, error = None, None
    if is_zero:
        try:
            pool = start()
        except Exception as e:  # noqa: BLE001 - raised on every process by agree_outcome
            error = e
    agree_outcome(error, is_zero, "process 0 could not start the vLLM pool")
    return pool


def agree_outcome(error: BaseException | None, is_zero: bool, failed: str) -> None:
    """Process 0's success, or its `error`, on every process (a collective: every process calls it). A failure on
    process 0 alone used to skip the collective the others waited in: they hung until jax's distributed timeout and
    failed with an unrelated message. Every process raises, process 0 its own error, the others PoolError(`failed`)."""
    if int(np.asarray(_from_zero(np.int32(error is not None if is_zero else 0)))):
        if error is not None:
            raise error
        raise PoolError(f"{failed}; process 0's log names the cause")


class JaxPeers:
    """The trainer processes as seen by the collective weight path: `agree` = process 0's value everywhere,
    `gather` = every process's value stacked [processes, ...]. `engaged` records whether this update has
    taken its first step, so that process 0 can release the others when it fails before the transport."""

    engaged = False

    def agree(self, value) -> np.ndarray:
        self.engaged = True
        return np.asarray(_from_zero(np.asarray(value)))

    def gather(self, value) -> np.ndarray:
        return np.asarray(multihost_utils.process_allgather(np.asarray(value)))


def routable_ip(toward: str) -> str:
    """This host's address on the interface that reaches `toward` (no packet is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, 9))
        return s.getsockname()[0]


def follow_push(sender: RoutedSender, peers, named_arrays, version: int) -> None:
    """A non-zero process's part of one collective update, step for step with process 0's
    `CollectiveTransport.connect` / `push`: (re)build its groups (one per route) when process 0 says so,
    send this process's tensors, report how it went. Never raises: process 0 decides and broadcasts the
    outcome."""
    message = peers.agree(setup_message(0))
    status, leader, n_routes = int(message[0]), [int(x) for x in message[1:5]], int(message[5])
    if status < 0:  # process 0 failed before the update began: nothing is iterated anywhere
        return
    if status > 0:
        routes, worlds, slices = agree_routes(peers, message)
        error = None
        try:
            host = routable_ip(decode_address([*leader, 0])[0])
            ports = sender.open(host, routes, worlds, slices)
        except Exception as e:  # noqa: BLE001 - process 0 sees port 0 and fails the build
            host, ports, error = "0.0.0.0", [0] * n_routes, e
        addresses = peers.gather(np.stack([encode_address(host, p) for p in ports]))
        if error is None and np.any(addresses[..., 4] == 0):  # a sender could not open: process 0 starts no join
            error = "a trainer process could not open its weight groups"
        if error is None:
            try:
                sender.connect()
            except Exception as e:  # noqa: BLE001
                error = e
        if not np.all(peers.gather(np.array([error is None], np.int64))):
            sender.close()
            return
    peers.gather(sender.send(named_arrays, version).to_array())


def owned_model_tensors(graphdef, params, rest=None, layout: str = "released", on_device: bool = False):
    """The HF tensors this process sends on the collective path (`m3jax.hf.owned.owned_hf_tensors`); on_device:
    left where they live, for buckets on the accelerator."""
    from flax import nnx

    from m3jax.hf.owned import owned_hf_tensors

    if not on_device:
        params, rest = host_views(params), host_views(rest)
    model = nnx.merge(graphdef, params, rest) if rest is not None else nnx.merge(graphdef, params)
    return owned_hf_tensors(model, layout, on_host=not on_device)


class ProcessZeroPool:
    """`peers` / `sender`: given on the collective transport, where every process sends its own tensors
    (process 0's pool holds the same `peers`; the others send through `sender`); `group_device`: where
    that transport's buckets live ("cuda": the tensors are handed over where they live, not via the host)."""

    def __init__(self, pool, graphdef, *, is_zero: bool, layout: str = "released", peers: JaxPeers | None = None,
                 sender: RoutedSender | None = None, group_device: str = "cpu"):
        self.pool, self.graphdef, self.is_zero, self.layout = pool, graphdef, is_zero, layout
        self.peers, self.sender, self.group_device = peers, sender, group_device
        self.resent_rows = self.restarts = 0

    def generate(self, prompts, params, key, prompt_width=None) -> Rollout:
        r, error = None, None
        if self.is_zero:
            try:
                r = self.pool.generate(prompts, params, key, prompt_width)
            except Exception as e:  # noqa: BLE001 - raised on every process by agree_outcome
                error = e
        agree_outcome(error, self.is_zero, "process 0's vLLM pool failed generating the rollout")
        return self.share(r, prompts, params.max_new_tokens)

    def share(self, r: Rollout | None, prompts, max_new_tokens: int) -> Rollout:
        """Process 0's rollout `r` of `prompts` on every process (a collective: every process calls it, the others
        with r None). The pool's counters come along."""
        n, t = len(prompts), max_new_tokens
        if self.is_zero:
            arrays = (r.tokens, r.logprobs, r.lengths, r.truncated, np.int32(r.weight_version))
        else:
            arrays = (np.zeros((n, t), np.int32), np.zeros((n, t), np.float32), np.zeros(n, np.int32),
                      np.zeros(n, bool), np.int32(0))
        tokens, logprobs, lengths, truncated, version = (np.asarray(a) for a in _from_zero(arrays))
        # MoE routes (engines started with return_routes): their shape first, so the others can take part
        routes_shape = np.array(r.routes.shape if self.is_zero and r.routes is not None else (0, 0, 0, 0), np.int32)
        routes_shape = tuple(int(x) for x in np.asarray(_from_zero(routes_shape)))
        routes = None
        if routes_shape[0]:
            routes = np.asarray(_from_zero(r.routes if self.is_zero else np.zeros(routes_shape, np.int16)))
        self._counters()
        return Rollout([list(p) for p in prompts], tokens, logprobs, lengths, truncated.astype(bool), int(version),
                       routes=routes)

    def local(self):
        """Process 0's pool itself, whose generate holds no collective: what a draw on process 0 alone samples from
        (rl.shared_draw), while the other processes run the train step's collectives."""
        assert self.is_zero, "only process 0 holds the pool"
        return self.pool

    def set_weights(self, params, version: int, rest=None) -> TransferStats:
        if self.peers is not None:
            return self._push_owned(params, version, rest)
        tensors = model_tensors(self.graphdef, params, rest, self.layout)  # a collective: everyone iterates
        figures, error = np.zeros(8, np.float64), None
        if self.is_zero:
            try:
                s = self.pool.push(tensors, version)
                figures[:7] = [s.bytes, s.buckets, s.tensors, s.convert_s, s.send_s, s.apply_s, s.total_s]
            except Exception as e:  # noqa: BLE001 - re-raised below, once the others know
                error, figures[7] = e, 1
        # Every process iterates every tensor, process 0 what a failed push left unread (the transport's converter
        # has stopped by then): a process that stopped early would leave the others in a gather.
        for _ in tensors:
            pass
        f = np.asarray(_from_zero(figures))
        self._counters()
        if f[7]:
            raise error if error is not None else TransferError(f"weight version {version} was refused; process 0 "
                                                                "names the cause")
        return TransferStats(version, int(f[0]), int(f[1]), int(f[2]), *map(float, f[3:7]))

    def _push_owned(self, params, version: int, rest) -> TransferStats:
        """Every process sends its own tensors; process 0 then broadcasts the figures, or the failure that
        every process raises."""
        tensors = owned_model_tensors(self.graphdef, params, rest, self.layout, on_device=self.group_device != "cpu")
        figures, error = np.zeros(9, np.float64), None
        if self.is_zero:
            self.peers.engaged = False
            try:
                s = self.pool.push(tensors, version)
                figures[:8] = [s.bytes, s.buckets, s.tensors, s.convert_s, s.send_s, s.apply_s, s.total_s, s.senders]
            except Exception as e:  # noqa: BLE001 - re-raised below, once the others know
                error, figures[8] = e, 1
                if not self.peers.engaged:  # failed before the transport's first step: release the others
                    self.peers.agree(setup_message(-1))
        else:
            follow_push(self.sender, self.peers, tensors, version)
        f = np.asarray(_from_zero(figures))
        self._counters()
        if f[8]:
            raise error if error is not None else TransferError(f"weight version {version} was refused; process 0 "
                                                                "names the cause")
        return TransferStats(version, int(f[0]), int(f[1]), int(f[2]), *map(float, f[3:7]), senders=int(f[7]))

    def score(self, prompts, responses, params) -> list[list[np.ndarray]]:
        lengths = [len(r) for r in responses]
        width = max(lengths)
        per_engine, count, error = [], np.int32(0), None
        if self.is_zero:
            try:
                per_engine = self.pool.score(prompts, responses, params)
                count = np.int32(len(per_engine))
            except Exception as e:  # noqa: BLE001 - raised on every process by agree_outcome
                error = e
        agree_outcome(error, self.is_zero, "process 0's vLLM pool failed scoring the probe sequences")
        count = int(_from_zero(count))
        table = np.zeros((count, len(responses), width), np.float32)
        for e, lps in enumerate(per_engine):
            for i, lp in enumerate(lps):
                table[e, i, :len(lp)] = lp
        table = np.asarray(_from_zero(table))
        return [[table[e, i, :lengths[i]] for i in range(len(responses))] for e in range(count)]

    def _counters(self) -> None:
        mine = np.array([self.pool.resent_rows, self.pool.restarts] if self.is_zero else [0, 0], np.int64)
        self.resent_rows, self.restarts = (int(x) for x in np.asarray(_from_zero(mine)))

    def shutdown(self) -> None:
        if self.is_zero:
            self.pool.shutdown()
        elif self.sender is not None:
            self.sender.close()
