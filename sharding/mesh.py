"""MeshConfig -> jax.sharding.Mesh over ("data", "context", "expert", "tensor"), with its checks.

- data:    batch and FSDP of the non-expert weights
- context: sequence (context-parallel attention; the indexer sees every causal key block)
- expert:  more batch, never FSDP; with data and context it forms the expert-parallel group
- tensor:  attention heads and MLP width

Expert parallelism runs over `expert_axes` (default all three token axes: every device that holds
distinct tokens holds distinct experts, which is how the production recipe lays EP128 over its
data x context devices). Every rule violation gets its own one-line error before a mesh exists.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
from jax.sharding import AxisType, Mesh

from sharding.rules import MESH_AXES, TOKEN_AXES


class MeshError(ValueError):
    """A mesh that cannot run this model: names the axis, its size and the rule it breaks."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    context: int = 1
    expert: int = 1
    tensor: int = 1
    expert_axes: tuple[str, ...] = TOKEN_AXES
    # Multi-host: jax.distributed.initialize arguments; None = single process, or taken from the
    # environment (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or a SLURM / Open MPI
    # launch); see `distributed_args` and docs/multihost.md.
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.data, self.context, self.expert, self.tensor)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axes) -> int:
        return math.prod(dict(zip(MESH_AXES, self.shape))[a] for a in axes)

    @property
    def expert_parallel(self) -> int:
        return self.axis_size(self.expert_axes)


def validate(mesh: MeshConfig, model_cfg=None, *, num_devices: int | None = None, seq_len: int | None = None,
             batch: int | None = None) -> None:
    """Raise MeshError for the first violated rule (each rule has its own message)."""
    for name, size in zip(MESH_AXES, mesh.shape):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MeshError(f"mesh axis {name!r} = {size!r}: expected a positive integer")
    bad = [a for a in mesh.expert_axes if a not in TOKEN_AXES]
    if bad or len(set(mesh.expert_axes)) != len(mesh.expert_axes):
        raise MeshError(f"mesh.expert_axes = {mesh.expert_axes}: expected distinct axes from {TOKEN_AXES} "
                        "(experts exchange tokens over axes that hold distinct tokens)")
    if num_devices is not None and mesh.num_devices != num_devices:
        raise MeshError(f"mesh data x context x expert x tensor = {' x '.join(map(str, mesh.shape))} = "
                        f"{mesh.num_devices} devices, but {num_devices} are available")
    if model_cfg is not None:
        c = model_cfg
        if c.has_moe and c.num_local_experts % mesh.expert_parallel:
            raise MeshError(f"num_local_experts={c.num_local_experts} is not divisible by the expert-parallel "
                            f"size {mesh.expert_parallel} (= product of {mesh.expert_axes})")
        if c.num_key_value_heads % mesh.tensor:  # implies the query heads divide too (KV | H)
            raise MeshError(f"num_key_value_heads={c.num_key_value_heads} is not divisible by mesh.tensor="
                            f"{mesh.tensor}")
        for name in ("intermediate_size", "dense_intermediate_size", "shared_intermediate_size"):
            if getattr(c, name) % mesh.tensor:
                raise MeshError(f"{name}={getattr(c, name)} is not divisible by mesh.tensor={mesh.tensor}")
        if c.vocab_size % mesh.tensor:
            raise MeshError(f"vocab_size={c.vocab_size} is not divisible by mesh.tensor={mesh.tensor}")
        if c.hidden_size % mesh.data:
            raise MeshError(f"hidden_size={c.hidden_size} is not divisible by mesh.data={mesh.data} (FSDP)")
        undivided = undivided_parameter(mesh, c)
        if undivided:
            raise MeshError(undivided)
    if seq_len is not None:
        unit = mesh.context * (model_cfg.index_block_size if model_cfg is not None and
                               model_cfg.has_sparse_attention and mesh.context > 1 else 1)
        if seq_len % unit:
            raise MeshError(f"sequence length {seq_len} is not divisible by mesh.context={mesh.context}"
                            + (f" x index_block_size={model_cfg.index_block_size}" if unit != mesh.context else ""))
    if batch is not None and batch % (mesh.data * mesh.expert):
        raise MeshError(f"batch {batch} is not divisible by mesh.data x mesh.expert = {mesh.data * mesh.expert}")


def undivided_parameter(mesh: MeshConfig, model_cfg) -> str | None:
    """The first parameter dimension that its mesh axes (per the rules table) do not divide, or None.

    jit refuses uneven parameter shards, and the named rules above do not cover every row of the
    table (the embedding's rows lie on data x tensor), so every parameter is checked here.
    """
    from m3jax.model.decoder import layer_param_specs, top_param_specs  # lazy: the model imports sharding
    from sharding.rules import logical_to_spec, rules_for

    sizes = dict(zip(MESH_AXES, mesh.shape))
    rules = rules_for(mesh.expert_axes)
    specs = list(top_param_specs(model_cfg).items())
    for attn, mlp, _ in model_cfg.segments():
        specs += [(f"{attn}/{mlp}/{n}", s) for n, s in layer_param_specs(model_cfg, attn, mlp).items()]
    for name, spec in specs:
        for dim, logical, axes in zip(spec.shape, spec.axes, logical_to_spec(spec.axes, rules, sizes)):
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            n = math.prod(sizes[a] for a in axes)
            if dim % n:
                return (f"parameter {name} axis {logical!r} = {dim} is not divisible by mesh "
                        f"{' x '.join(axes)} = {n}")
    return None


def distributed_args(mesh: MeshConfig, environ=None) -> dict | None:
    """jax.distributed.initialize arguments, or None for a single process.

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


def init_distributed(mesh: MeshConfig) -> None:
    """Join a multi-host job (`distributed_args`); a no-op for one process or when already joined.
    Must run before anything asks jax for its devices."""
    if jax.distributed.is_initialized():
        return
    args = distributed_args(mesh)
    if args is None:
        return
    # Cross-process collectives on CPU hosts (tests, CPU clusters) need gloo; GPUs ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**args)


def build_mesh(mesh: MeshConfig, model_cfg=None, *, seq_len: int | None = None, batch: int | None = None,
               devices=None) -> Mesh:
    """Validate and build the Mesh (Auto axis types: the partitioner places what the rules leave open)."""
    init_distributed(mesh)
    devices = list(devices) if devices is not None else jax.devices()
    validate(mesh, model_cfg, num_devices=len(devices), seq_len=seq_len, batch=batch)
    return jax.make_mesh(mesh.shape, MESH_AXES, axis_types=(AxisType.Auto,) * 4, devices=devices)


def mesh_config_of(mesh: Mesh, expert_axes=TOKEN_AXES) -> MeshConfig:
    """The MeshConfig describing an existing Mesh with m3jax's axis names."""
    missing = [a for a in MESH_AXES if a not in mesh.shape]
    if missing:
        raise MeshError(f"mesh axes {tuple(mesh.axis_names)} lack {missing}: expected {MESH_AXES}")
    return MeshConfig(*(mesh.shape[a] for a in MESH_AXES), expert_axes=tuple(expert_axes))
