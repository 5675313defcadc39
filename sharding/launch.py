"""How this process was launched: `distributed_args`, the jax.distributed.initialize arguments a config and the
launcher's environment give. Free of jax, so `python -m m3jax.train` can check a config against its launch before the
heavy imports (a process of a job must join it before anything starts jax's backend: `sharding.mesh.init_distributed`).
"""

from __future__ import annotations

import os


def distributed_args(mesh, environ=None) -> dict | None:
    """jax.distributed.initialize arguments, or None for a single process. `mesh`: a MeshConfig or the run
    config's mesh section (coordinator_address, num_processes, process_id).

    Each of coordinator address / process count / process index comes from the config, else from
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (jax itself reads only the first).
    With none of them but a multi-task `srun` step or `mpirun` launch, {} lets jax detect all three
    (the step's task count, not the allocation's: a batch script run once must not wait for peers).
    """
    env = os.environ if environ is None else environ
    addr = mesh.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    n = mesh.num_processes if mesh.num_processes is not None else _env_int(env, "JAX_NUM_PROCESSES")
    pid = mesh.process_id if mesh.process_id is not None else _env_int(env, "JAX_PROCESS_ID")
    if addr or n:
        return {"coordinator_address": addr, "num_processes": n, "process_id": pid}
    if _env_int(env, "SLURM_STEP_NUM_TASKS", 1) > 1 or _env_int(env, "OMPI_COMM_WORLD_SIZE", 1) > 1:
        return {}
    return None


def _env_int(env, name: str, default: int | None = None) -> int | None:
    value = env.get(name)
    return default if value in (None, "") else int(value)
