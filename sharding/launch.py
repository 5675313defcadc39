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
    if _launcher_detected(env):
        return {}
    return None


# What a multi-host job's process must know, with the config key and the environment variable that give it.
_JOB_SETTINGS = (("coordinator_address", "mesh.coordinator_address", "JAX_COORDINATOR_ADDRESS"),
                 ("num_processes", "mesh.num_processes", "JAX_NUM_PROCESSES"),
                 ("process_id", "mesh.process_id", "JAX_PROCESS_ID"))


def launch_problem(mesh, environ=None) -> str | None:
    """Why this process cannot join the job its config and environment describe, or None: a job named by some of
    coordinator address / process count / process index but not all three, where no multi-task launcher gives jax
    the rest (jax then stopped the process with a ValueError traceback naming one of them)."""
    env = os.environ if environ is None else environ
    try:
        args, launched = distributed_args(mesh, env), _launcher_detected(env)
    except EnvIntError as e:
        return str(e)
    if not args or launched:
        return None
    missing = [f"{name} ({key} or ${var})" for name, key, var in _JOB_SETTINGS if args[name] is None]
    if not missing:
        return None
    given = ", ".join(f"{name} = {args[name]}" for name, _, _ in _JOB_SETTINGS if args[name] is not None)
    one = len(missing) == 1
    return (f"a multi-host job is described ({given}, from the mesh section or the JAX_* variables), but its "
            f"{' and '.join(missing)} {'is' if one else 'are'} not set, and no multi-task launch (srun, mpirun) in "
            f"the environment gives {'it' if one else 'them'}; allowed: all three of mesh.coordinator_address, "
            "mesh.num_processes and mesh.process_id (or their JAX_* variables) for each process, or none of them for "
            "one process")


def _launcher_detected(env) -> bool:
    """A multi-task srun step or mpirun launch, from which jax detects all three itself."""
    return _env_int(env, "SLURM_STEP_NUM_TASKS", 1) > 1 or _env_int(env, "OMPI_COMM_WORLD_SIZE", 1) > 1


class EnvIntError(ValueError):
    """A launch variable that is not an integer (int() raised a traceback naming no variable)."""


def _env_int(env, name: str, default: int | None = None) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise EnvIntError(f"${name} = {value!r} in the environment is not an integer; allowed: a whole number (a "
                          "process count or index), or unset") from None
