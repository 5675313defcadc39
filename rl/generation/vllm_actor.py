"""The Ray actor of the vLLM pool (rl.generation.vllm_pool): one vLLM engine plus the receiving end of
weight updates, for both transports (Ray object-store buckets staged by `stage`, or a collective group
joined by `join_weight_group` and read by `receive_weights`), committed together by `commit`."""

from __future__ import annotations

import os
import time

from rl.generation.base import SamplingParams
from rl.generation.host_memory import TUNABLES
from rl.generation.transfer import StagedUpdate, TransferError


class EngineActor:
    """Runs inside its Ray worker process: one vLLM engine plus the staging area of weight updates.

    Wrapped by `ray.remote` in `rl.generation.vllm_pool._actor_class` with two concurrency groups: `work` (one call at a
    time: generation, scoring, weight staging/commit) and `probe` (health answers while work runs).
    """

    receiver = None  # rl.generation.collective_receiver.Receiver, once the collective transport has joined
    workers_staged: int | None = None  # the version a Ray-executor engine's workers hold staged

    def __init__(self, cfg, rank: int):  # cfg: rl.generation.vllm_pool.PoolConfig
        from rl.generation.vllm_engine import VLLMEngine  # imports vLLM: only in engine processes

        self.rank = rank
        self.engine = VLLMEngine(cfg.model_dir, dtype=cfg.dtype, seed=cfg.seed + rank,
                                 max_model_len=cfg.max_model_len, tensor_parallel=cfg.tensor_parallel,
                                 expert_parallel=cfg.expert_parallel,
                                 gpu_memory_utilization=cfg.gpu_memory_utilization,
                                 weight_apply=cfg.weight_apply, return_routes=cfg.return_routes,
                                 # the pool resolved "auto" (rl.generation.vllm_ray.choose_executor)
                                 executor=None if cfg.executor == "auto" else cfg.executor)
        self.staged = StagedUpdate()
        self.busy_since: float | None = None

    def generate(self, rows: list[int], prompts: list[list[int]], sp: SamplingParams, seeds: list[int]):
        self.busy_since = time.time()
        try:
            return rows, self.engine.version, self.engine.generate(prompts, sp, seeds)
        finally:
            self.busy_since = None

    def score(self, prompts, responses, temperature: float, top_p: float, top_k: int):
        return self.engine.score(prompts, responses, temperature=temperature, top_p=top_p, top_k=top_k)

    def stage(self, bucket) -> int:
        self.staged.stage(bucket, self.engine.check)
        return bucket.index

    def _in_workers(self) -> bool:
        """Whether the collective path reaches this engine's workers themselves (the Ray executor's, which may
        sit on other machines: rl.generation.vllm_worker_weights) rather than this process."""
        return self.engine.executor == "ray"

    def weight_receivers(self) -> list:
        return self.engine.weight_receivers()

    def join_weight_group(self, senders_by_route, placement, routes, backend: str, timeout_s: float) -> None:
        """Every receiving rank of this engine joins its route's group of every sender (`weight_routes.plan`:
        placement[j] = (route, rank in the group, group size) of rank j; senders_by_route[g] = each sender's
        [host, port])."""
        args = (senders_by_route, placement, routes, backend, timeout_s)
        if self._in_workers():
            self.engine.llm.collective_rpc("m3jax_join_weight_group", args=args)
            return
        from rl.generation.collective_receiver import Receiver  # the engine end of the collective transport

        self.receiver = self.receiver or Receiver()
        self.receiver.join_placed(senders_by_route, placement, routes, 0, backend, timeout_s)

    def leave_weight_group(self) -> None:
        if self._in_workers():
            self.engine.llm.collective_rpc("m3jax_leave_weight_group")
        elif self.receiver is not None:
            self.receiver.leave()

    def receive_weights(self, version: int) -> int:
        """Phase 1 on the collective path: every bucket received, verified and complete, or TransferError."""
        if self._in_workers():
            answers = self.engine.llm.collective_rpc(
                "m3jax_receive_weights", args=(version, dict(self.engine.manifest), self.engine.model_dir))
            errors = [a["error"] for a in answers if "error" in a]
            if errors:
                raise TransferError(f"engine {self.rank}: {errors[0]}")
            self.workers_staged = version  # each worker checked its own set complete (its route's)
            return sum(a["buckets"] for a in answers)
        if self.receiver is None:
            raise TransferError(f"engine {self.rank} is not in a weight group (version {version})")
        return self.receiver.receive(version, self.engine.check, self.engine.manifest)

    def commit(self, version: int, num_buckets: int) -> int:
        if self.workers_staged == version:
            self.workers_staged = None
            self.engine.commit_in_workers(version, num_buckets)
            self.engine.version = version
            return version
        collective = self.receiver is not None and self.receiver.version == version
        staged = self.receiver if collective else self.staged
        try:
            self.engine.load_weights(staged.tensors(version, num_buckets))
        finally:
            staged.clear()
        self.engine.version = version
        return version

    def abort(self, version: int) -> None:
        if self.workers_staged == version:
            self.workers_staged = None
            self.engine.llm.collective_rpc("m3jax_abort_weights", args=(version,))
        if self.staged.version == version:
            self.staged.clear()
        if self.receiver is not None and self.receiver.version == version:
            self.receiver.clear()

    def apply_mode(self) -> tuple[str, str | None]:
        """How this engine applies an update, and why not in place when it does not."""
        return self.engine.apply_mode, self.engine.apply_fallback

    def shutdown(self) -> None:
        """Stop the engine the orderly way before the pool kills the actor: the engine core and its executor
        release what they own (measured on CPU: a live Ray-executor engine's 167 MB segment under /dev/shm
        goes; what its workers created stays, since vLLM ends them with ray.kill: docs/vllm.md)."""
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()

    def health(self) -> dict:
        """The engine's own report (ok is False once a weight update failed part-way) plus how long the
        current call has been running."""
        # the malloc settings this process started with (rl.generation.host_memory); not /proc/self/environ,
        # where glibc 2.36's loader cuts the variable at its first ':' while parsing it
        return {**self.engine.health(), "rank": self.rank, "glibc_tunables": os.environ.get(TUNABLES),
                "busy_s": None if self.busy_since is None else time.time() - self.busy_since}


_WORK = ("generate", "score", "stage", "commit", "abort", "weight_receivers", "join_weight_group", "leave_weight_group",
         "receive_weights", "apply_mode", "shutdown")


def actor_class(base: type = EngineActor, name: str = "VLLMEngineActor"):
    """`base` (EngineActor, or a test's stand-in subclass) as a Ray actor class with the pool's two concurrency
    groups: `work` (one call at a time) and `probe` (health, answered while work runs)."""
    import ray

    def in_group(method: str, group: str):
        # ray.method marks the function object it is given: mark a wrapper, never base's own function, or a
        # class Ray starts later without these groups (inheriting the marked function) fails to start.
        fn = getattr(base, method)

        def call(self, *a, **k):
            return fn(self, *a, **k)

        # Named after this class, not base: with functools.wraps (base's qualname) Ray ran health in the work
        # group's queue, behind generate (tests/test_vllm_pool_logic.py checks that it answers meanwhile).
        call.__name__, call.__qualname__, call.__doc__ = method, f"{name}.{method}", fn.__doc__
        return ray.method(concurrency_group=group)(call)

    cls = type(name, (base,), {})
    for method in _WORK:
        setattr(cls, method, in_group(method, "work"))
    cls.health = in_group("health", "probe")
    return ray.remote(concurrency_groups={"work": 1, "probe": 1})(cls)
