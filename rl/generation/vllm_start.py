"""Where a vLLM pool's engines run: Ray's start, the executor each engine gets, and an engine actor's start.

An engine whose ranks fit one host runs vLLM's multiprocess executor inside its actor; one that does not runs
vLLM's Ray executor, and its actor starts in a placement group of its own, one bundle per rank (its workers
follow into the bundles). `rl.generation.vllm_pool.VLLMPool` holds the engines these start.
"""

from __future__ import annotations

import os
import threading

from rl.generation import host_memory, local_ray, vllm_ray
from rl.generation.pool_config import PoolConfig, PoolError
from rl.generation.vllm_results import CPU_REASON


def start_ray(cfg: PoolConfig, ranks: int) -> threading.Thread | None:
    """Join the Ray cluster at `cfg.ray_address`, or start a local one sized for the pool; returns the local
    object store's warm-up thread (join it before the first update uses the store), else None."""
    import ray

    if ray.is_initialized():
        return None
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=False)
        return None
    # A local CPU Ray advertises engine-rank slots only when the Ray executor was asked for, so that "auto"
    # keeps every engine on this host's multiprocess executor.
    slots = {vllm_ray.CPU_SLOT: ranks * cfg.servers} if cfg.executor == "ray" else {}
    store = local_ray.init_kwargs(cfg.model_dir, cfg.transport)
    ray.init(num_cpus=max(os.cpu_count() or 1, 1), include_dashboard=False, log_to_driver=False,
             resources=slots, **store)
    if store and cfg.warm_object_store:
        return local_ray.warm_in_background(store["object_store_memory"])
    return None


def engine_executor(cfg: PoolConfig, ranks: int) -> tuple[str, int, str]:
    """(what one rank takes: "GPU" or the CPU slot, such devices per host, the executor each engine runs),
    or a PoolError for what the running Ray cluster cannot host, before any engine starts."""
    import ray

    key = vllm_ray.device_key(ray.cluster_resources())
    per_host = vllm_ray.devices_per_host(ray.nodes(), key)
    if cfg.return_routes and key != "GPU":
        raise PoolError(f"MoE routes from the pool's engines (grpo.routing_replay: rollout): {CPU_REASON}")
    try:
        executor = cfg.executor if cfg.executor == "uni" else vllm_ray.choose_executor(cfg.executor, ranks, per_host)
    except ValueError as e:
        raise PoolError(str(e)) from None
    have = ray.cluster_resources().get(key, 0)
    if executor == "ray" and have < ranks:
        raise PoolError(f"a Ray-executor engine of {ranks} ranks needs {ranks} x {key!r} in the Ray cluster, which "
                        f"has {have:g}; on CPU every Ray node advertises {vllm_ray.CPU_SLOT!r} per engine rank it may "
                        "host (docs/vllm.md)")
    return key, per_host, executor


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def spawn_engine(actor_class, cfg: PoolConfig, rank: int, per_host: int, key: str):
    """Start engine `rank`'s actor: (the actor handle, its placement group or None). A Ray-executor engine gets a
    fresh placement group of its own; `cfg.executor` is the one `engine_executor` chose."""
    on_gpus = cluster_has_gpus()
    env = host_memory.engine_malloc_env() if cfg.malloc_tuning and not on_gpus else {}
    if cfg.executor != "ray":
        gpus = cfg.tensor_parallel if on_gpus else 0
        return actor_class.options(num_cpus=0, num_gpus=gpus, runtime_env={"env_vars": env}).remote(cfg, rank), None
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles, strategy = vllm_ray.placement(cfg.tensor_parallel, per_host, key)
    group = placement_group(bundles, strategy=strategy)
    # The actor takes no resources of the group; its vLLM workers take one bundle each (the executor finds the
    # group because child tasks are captured). Until the group is placed the actor waits.
    actor = actor_class.options(
        num_cpus=0, num_gpus=0, runtime_env=vllm_ray.actor_runtime_env(env),
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                             placement_group_capture_child_tasks=True),
    ).remote(cfg, rank)
    return actor, group


def remove_group(group) -> None:
    """Remove an engine's placement group (None: nothing), which ends every actor still in it: its workers too."""
    if group is None:
        return
    from ray.util.placement_group import remove_placement_group
    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001 - already removed (a Ray cluster going down)
        pass
