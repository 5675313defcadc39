"""The vLLM generation backend: a pool of Ray actors, each owning one vLLM engine, behind the same
`Generator` interface as the JAX engine.

Rollouts: the rows are cut into chunks; every healthy engine holding the current weight version takes
one chunk at a time (so a fast engine takes more). A chunk whose engine dies (RayActorError) or hangs
(no answer within `request_timeout_s`; the actor is then killed) goes back to the queue and is
re-sent elsewhere, and results are kept per row, first answer wins: every sample comes back exactly
once (the queue is rl.schedule.ChunkQueue). Each row carries its own sampling seed, so a re-sent row
samples the same tokens. A dead engine is replaced (up to `max_restarts` times per pool); the
replacement starts from the checkpoint on disk, so it takes no work until the next weight update has
brought it to the pool's version. A pool started from a directory of shapes alone (`m3jax.hf.shapes`: a random
model, not written to disk) holds no weights (version NO_WEIGHTS) and serves nothing until its first update.

An engine whose ranks do not fit one host runs vLLM's Ray executor (`PoolConfig.executor`,
rl.generation.vllm_ray): the pool gives it a placement group of its own, one bundle per rank, starts its
actor inside (vLLM's workers follow into the bundles) and, when it replaces the engine, removes that group
(ending any of its workers still alive) and creates a fresh one. Everything above holds for such an
engine as a unit: a dead worker fails the engine's next call, its rows are re-sent and it is replaced.

Weight updates (`set_weights`) go through `rl.generation.transfer`; generation and updates take the
same lock, so no rollout runs while weights change, and rollouts resume only once every engine has
committed the new version.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import jax
import numpy as np

from m3jax.hf.shapes import shapes_only
from rl.generation.base import Rollout, SamplingParams, check_request
from rl.generation.pool_config import NO_WEIGHTS, PoolConfig, PoolError, check_temperature
from rl.generation.transfer import TRANSPORTS, TransferError, TransferStats, make_transport, model_tensors
from rl.generation import host_memory, shared_segments, vllm_ray, vllm_start
from rl.generation.vllm_results import assemble_rollout
from rl.generation.vllm_actor import EngineActor, actor_class
from rl.schedule import ChunkQueue, Incomplete

log = logging.getLogger(__name__)


_ACTOR = None


def _actor_class():
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = actor_class()
    return _ACTOR


@dataclasses.dataclass(eq=False)  # hashed by identity: the rollout queue's key for its engine
class _Slot:
    rank: int
    actor: object
    version: int = 0
    ready: bool = False  # __init__ finished (the engine is built)
    restarts: int = 0
    probe: object = None  # an outstanding health call while the engine is starting
    group: object = None  # the engine's placement group (Ray executor only), removed when it is replaced


class VLLMPool:
    """`Generator` over a pool of vLLM engines; see the module docstring for the failure model."""

    def __init__(self, cfg: PoolConfig, graphdef=None, *, pad_id: int = 0, layout: str = "released", peers=None):
        """peers: the other processes of a multi-host trainer, which send their own tensors beside this one
        (`rl.generation.multihost.JaxPeers`; collective transport only)."""
        if cfg.transport not in TRANSPORTS:  # refused before any engine starts, not at the first update
            raise PoolError(f"weight transport {cfg.transport!r} is not built; allowed: {', '.join(TRANSPORTS)}")
        if peers is not None and cfg.transport != "collective":
            raise PoolError(f"weight transport {cfg.transport!r} sends from one process; peers need 'collective'")
        self.cfg, self.graphdef, self.pad_id, self.layout, self.peers = cfg, graphdef, pad_id, layout, peers
        # what an engine holds when it starts (a replacement too): the checkpoint's weights, or none before a push
        self.start_version = NO_WEIGHTS if shapes_only(cfg.model_dir) else 0
        self.version = self.start_version
        self.restarts = 0
        self.resent_rows = 0
        self.last_transfer: TransferStats | None = None
        self._transport, self._transport_to = None, ()  # kept across updates while the engines stay the same
        self._segments = None  # the `shm` transport's files (made below, once the config is accepted)
        self._lock = threading.Lock()
        ranks = vllm_ray.engine_ranks(cfg.tensor_parallel, cfg.expert_parallel)
        if cfg.executor not in vllm_ray.EXECUTORS + ("uni",):
            raise PoolError(f"vllm executor {cfg.executor!r}: expected one of {vllm_ray.EXECUTORS}")
        warming = vllm_start.start_ray(cfg, ranks)  # the store's warm-up, joined before the first update uses it
        self.key, self.per_host, executor = vllm_start.engine_executor(cfg, ranks)
        self.cfg = dataclasses.replace(cfg, executor=executor)
        self.slots = [_Slot(r, None) for r in range(cfg.servers)]
        if cfg.transport == "shm":  # this process's memory, kept while engines come and go
            self._segments = shared_segments.SegmentWriter(cfg.bucket_bytes)
            if cfg.warm_object_store:  # the store warm-up's counterpart: the files made while the engines start
                warming = shared_segments.reserve_in_background(self._segments, cfg.model_dir, cfg.bucket_bytes)
        try:
            for s in self.slots:
                self._spawn(s)
            self._wait_ready(self.slots)
        finally:
            if warming is not None:
                warming.join()
            if self._segments is not None and not all(s.ready for s in self.slots):
                self._segments.close()  # an engine failed to start: the files go with the pool that never was
        self._check_weight_path()
        on_cpus = not vllm_start.cluster_has_gpus()
        advice = host_memory.sender_copy_advice() if on_cpus and cfg.transport != "collective" else None
        if advice:
            log.info(advice)

    # -------------------------------------------------------------------------------- lifecycle
    def _spawn(self, slot: _Slot) -> None:
        slot.actor, slot.group = vllm_start.spawn_engine(_actor_class(), self.cfg, slot.rank, self.per_host, self.key)

    def _remove_group(self, slot: _Slot) -> None:
        group, slot.group = slot.group, None
        vllm_start.remove_group(group)

    def _wait_ready(self, slots) -> None:
        import ray

        for s in slots:
            try:
                h = ray.get(s.actor.health.remote(), timeout=max(self.cfg.request_timeout_s, 300))
            except Exception as e:
                raise PoolError(f"vLLM engine {s.rank} failed to start from {self.cfg.model_dir}: {e}") from e
            s.ready, s.version = True, h["version"]

    def _check_weight_path(self) -> None:
        """Refuse at start what every push would refuse (`vllm_ray.weight_path_problem`)."""
        if self.cfg.transport == "shm" or (self.cfg.transport == "ray" and self.cfg.executor == "ray"):
            problem = vllm_ray.weight_path_problem(self.cfg.transport, self.cfg.executor, self.health(),
                                                   vllm_ray.host_of(None)[0])
            if problem:
                self.shutdown()
                raise PoolError(problem)

    def _replace(self, slot: _Slot, why: str) -> None:
        """Kill a dead or hung engine; start a fresh one unless the pool's restart budget is spent."""
        import ray

        log.warning("vLLM engine %d %s", slot.rank, why)
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._remove_group(slot)  # a multi-host engine goes as a unit: a surviving worker must not linger
        slot.ready, slot.probe, slot.actor = False, None, None
        if self.restarts >= self.cfg.max_restarts:
            return
        self.restarts += 1
        slot.restarts += 1
        slot.version = self.start_version  # it loads the on-disk checkpoint (or vLLM's dummy weights)
        self._spawn(slot)

    def _refresh(self) -> None:
        """Mark ready the starting engines whose health probe has answered, without waiting for the
        others (a rollout loop calls this between chunks while a replacement builds its engine)."""
        import ray

        for s in self.slots:
            if s.actor is None or s.ready:
                continue
            if s.probe is None:
                s.probe = s.actor.health.remote()
            done, _ = ray.wait([s.probe], timeout=0)
            if not done:
                continue  # still building its engine
            probe, s.probe = s.probe, None
            try:
                s.ready, s.version = True, ray.get(probe)["version"]
            except Exception as e:  # noqa: BLE001 - died while starting
                self._replace(s, f"died while starting: {e}")

    def serving(self) -> list[_Slot]:
        """Engines that are up and hold the pool's current weight version."""
        self._refresh()
        return [s for s in self.slots if s.actor is not None and s.ready and s.version == self.version]

    def health(self) -> list[dict]:
        import ray

        out = []
        self._refresh()
        for s in self.slots:
            if s.actor is None:
                out.append({"rank": s.rank, "state": "dropped"})
                continue
            if not s.ready:  # a replacement still building its engine: asked, it timed out ("unreachable"), 5 s late
                out.append({"rank": s.rank, "state": f"starting (replacement {s.restarts} of the pool's "
                                                     f"{self.cfg.max_restarts})"})
                continue
            try:
                out.append({**ray.get(s.actor.health.remote(), timeout=5), "state": "up"})
            except Exception as e:  # noqa: BLE001
                out.append({"rank": s.rank, "state": f"unreachable: {type(e).__name__}"})
        return out

    def shutdown(self) -> None:
        import ray

        self._drop_transport()
        if self._segments is not None:
            self._segments.close()
        live = [s.actor.shutdown.remote() for s in self.slots if s.actor is not None and s.ready]
        if live:  # the orderly stop first (shared memory released), bounded: a hung engine is killed below
            ray.wait(live, num_returns=len(live), timeout=60)
        for s in self.slots:
            if s.actor is not None:
                try:
                    ray.kill(s.actor, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
                s.actor = None
            self._remove_group(s)

    # ------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams, key: jax.Array,
                 prompt_width: int | None = None) -> Rollout:
        """prompt_width: vLLM needs no padding; it sets the width of `Rollout.routes` as for the JAX engine."""
        import ray

        # vLLM refuses a prompt + max_tokens over max_model_len (and any id past the vocabulary): here, before
        # any engine is asked, rather than as an engine failure that would replace it
        check_request(prompts, self.cfg.vocab_size, self.cfg.max_model_len, params.max_new_tokens,
                      limit_name="the engines' max_model_len", stop_token_ids=params.stop_token_ids)
        check_temperature(params.temperature)
        self._check_weights("a rollout")
        n = len(prompts)
        seeds = np.asarray(jax.random.randint(key, (n,), 0, 2**31 - 1)).tolist()
        with self._lock:
            engines = self.serving()
            if not engines:
                raise PoolError(f"no vLLM engine serves weight version {self.version}: {self.health()}")
            work = ChunkQueue(n, -(-n // (len(engines) * self.cfg.chunks_per_engine)), self.cfg.request_timeout_s)
            inflight: dict = {}  # ref -> slot
            while work.pending or inflight:
                for s in self.serving():
                    if not work.busy(s) and (rows := work.take(s)):
                        ref = s.actor.generate.remote(rows, [prompts[r] for r in rows], params,
                                                      [seeds[r] for r in rows])
                        inflight[ref] = s
                if not inflight:
                    raise PoolError(f"no healthy vLLM engine left for {len(work.pending)} chunks: {self.health()}")
                done, _ = ray.wait(list(inflight), num_returns=1, timeout=max(0.05, work.wait_s(cap=1.0)))
                for ref in done:
                    slot = inflight.pop(ref)
                    try:
                        rows, version, outs = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - engine died mid-chunk: re-send it
                        self._resend(work, slot, f"failed during a rollout ({type(e).__name__})")
                        continue
                    if version != self.version:
                        raise PoolError(f"engine {slot.rank} answered with weight version {version}, "
                                        f"pool is at {self.version}")
                    for r, out in zip(rows, outs):
                        work.answer(slot, r, out)
                late = work.late()
                for ref, slot in list(inflight.items()):
                    if slot in late:
                        del inflight[ref]
                        self._resend(work, slot, f"hung for {self.cfg.request_timeout_s:.0f} s")
            try:
                results = work.ordered()
            except Incomplete as e:
                raise PoolError(f"rollout incomplete: rows {e.missing} missing") from e
        try:
            return assemble_rollout(prompts, results, params.max_new_tokens, prompt_width, pad_id=self.pad_id,
                                    version=self.version)
        except ValueError as e:
            raise PoolError(f"rollout routes: {e}") from None

    def _check_weights(self, what: str) -> None:
        if self.version == NO_WEIGHTS:
            raise PoolError(f"{what} before the first weight update: the engines started from {self.cfg.model_dir}, "
                            "the model's shapes alone, and hold vLLM's dummy weights; push the model first "
                            "(set_weights)")

    def _resend(self, work: ChunkQueue, slot: _Slot, why: str) -> None:
        """An engine died or hung mid-chunk: its rows go back to the queue (no row is to blame, and each
        samples with its own seed, so a re-send is exact) and the engine is replaced."""
        rows = work.lose(slot).requeued
        self.resent_rows += len(rows)
        self._replace(slot, f"{why}; re-sending {len(rows)} rows")

    def score(self, prompts, responses, params: SamplingParams) -> list[list[np.ndarray]]:
        """Per-token logprobs of fixed sequences on every serving engine (one list per engine)."""
        import ray

        # a scored sequence asks its engine for one more token (prompt logprobs come with a generation)
        check_request(prompts, self.cfg.vocab_size, self.cfg.max_model_len - 1, responses=responses,
                      limit_name="the engines' max_model_len - 1")
        self._check_weights("scoring")
        with self._lock:
            asked = {s.actor.score.remote(prompts, responses, params.temperature, params.top_p, params.top_k): s
                     for s in self.serving()}
            done, _ = ray.wait(list(asked), num_returns=len(asked), timeout=self.cfg.request_timeout_s)
            out, failed = [], []
            # An engine that dies or hangs here is replaced as in a rollout, not left serving: a bare ray.get
            # raised Ray's own error to the trainer and left a hung engine to stall the next rollout's chunk
            for ref, slot in asked.items():
                try:
                    if ref not in done:
                        raise TimeoutError(f"hung for {self.cfg.request_timeout_s:.0f} s")
                    out.append(ray.get(ref))
                except Exception as e:  # noqa: BLE001 - dead or hung: the other engines' answers still count
                    why = str(e) if isinstance(e, TimeoutError) else type(e).__name__
                    failed.append(f"engine {slot.rank}: {why}")
                    self._replace(slot, f"failed while scoring ({why})")
            if failed and not out:
                raise PoolError(f"no vLLM engine answered the scoring request ({'; '.join(failed)}): {self.health()}")
            return out

    # ---------------------------------------------------------------------------------- weights
    def set_weights(self, params, version: int, rest=None) -> TransferStats:
        """Convert the trainer's params to HF-named tensors and commit them on every live engine."""
        if self.graphdef is None:
            raise PoolError("VLLMPool needs the model graphdef to convert parameters")
        on_device = self.cfg.transport == "collective" and self.cfg.group_device != "cpu"  # D2D into the buckets
        return self.push(model_tensors(self.graphdef, params, rest, self.layout, on_device), version)

    def push(self, named_arrays, version: int) -> TransferStats:
        """Send HF-named tensors as weight `version`; on TransferError every engine keeps its version."""
        import ray

        with self._lock:
            for s in self.slots:  # a replacement still building its engine must not miss the update
                if s.actor is not None and not s.ready:
                    try:
                        s.version = ray.get(s.actor.health.remote(), timeout=self.cfg.request_timeout_s)["version"]
                        s.ready = True
                    except Exception as e:  # noqa: BLE001
                        self._replace(s, f"did not start: {e}")
            targets = [s for s in self.slots if s.actor is not None and s.ready]
            if not targets:
                raise PoolError(f"no live vLLM engine to receive weight version {version}")
            transport = self._transport_for([s.actor for s in targets])
            try:
                stats = transport.push(named_arrays, version)
            except TransferError:
                if transport.broken:
                    self._drop_transport()
                self._sync_versions(targets)  # a failed commit may have updated some engines
                raise
            for i, s in enumerate(targets):
                if i in stats.lost:
                    self._replace(s, f"died or hung while receiving weight version {version}")
                else:
                    s.version = version
            self.version = version
            self.last_transfer = stats
            return stats

    def _transport_for(self, actors):
        """The configured transport to these engines: reused while they are the same actors (the collective
        one holds a process group), rebuilt when an engine was replaced or the last push broke it."""
        key = tuple(id(a) for a in actors)
        if self._transport is None or self._transport.broken or key != self._transport_to:
            self._drop_transport()
            self._transport = make_transport(self.cfg.transport, actors, self.cfg.bucket_bytes,
                                             timeout_s=self.cfg.request_timeout_s, peers=self.peers,
                                             device=self.cfg.group_device, segments=self._segments)
            self._transport_to = key
        return self._transport

    def _drop_transport(self) -> None:
        transport, self._transport, self._transport_to = self._transport, None, ()
        if transport is not None:
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - closing a group whose engines died
                pass

    def _sync_versions(self, slots) -> None:
        import ray

        for s in slots:
            try:
                h = ray.get(s.actor.health.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001
                self._replace(s, f"unreachable after a failed update: {e}")
                continue
            if h["ok"]:
                s.version = h["version"]
            else:  # half-applied weights: only a fresh engine is trustworthy
                self._replace(s, f"unusable after a failed update: {h.get('error')}")


__all__ = ["EngineActor", "PoolConfig", "PoolError", "TransferError", "VLLMPool"]
