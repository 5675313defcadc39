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
from typing import Protocol

import jax
from jax.sharding import AxisType

from sharding.launch import distributed_args  # noqa: F401  (its home before; jax-free there)
from sharding.layout import Layout, MeshError
from sharding.rules import (MESH_AXES, TOKEN_AXES, expert_axes_of, fsdp_axes_of, logical_to_spec, mesh_axes_of,
                            rules_for, rules_problem)


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
    # FSDP: the token axes that shard the non-expert weights (gathered per layer, gradients reduce-scattered);
    # () = replicated (pure data parallelism)
    fsdp_axes: tuple[str, ...] = ("data",)
    # Of fsdp_axes, those a step gathers once, into a copy of the weights cut over the other fsdp axes only, which
    # every micro-batch (of the train step and of the logprob pass) then reads: ZeRO++'s hierarchical partitioning,
    # FSDP2's reshard_after_forward to a node. With the nodes on these axes, the per-micro-batch gathers stay on
    # NVLink. They must be the last entries of fsdp_axes (the shards of one copy are then whole runs of the full
    # cut); () = every micro-batch gathers over all of fsdp_axes.
    fsdp_step_axes: tuple[str, ...] = ()
    # Causal load balance of context-parallel attention: mirror shards swap their queries' second halves
    # (`sharding.context.mirror_second_halves`); False = contiguous shards, the last doing the most work
    context_balance: bool = True
    # Rows a model of your own adds to the rules table for its own logical axis names: ((name, mesh axes), ...),
    # mesh axes a name of MESH_AXES, a tuple of them, or None (replicated). m3jax's names are the table's already.
    extra_rules: tuple = ()

    def __post_init__(self):
        rows = self.extra_rules if isinstance(self.extra_rules, (tuple, list)) else (
            () if self.extra_rules is None else (self.extra_rules,))  # validate names what is not a row
        rows = tuple((row[0], tuple(row[1]) if isinstance(row[1], list) else row[1])
                     if isinstance(row, (tuple, list)) and len(row) == 2 else row for row in rows)
        object.__setattr__(self, "extra_rules", rows)

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

    @property
    def rules(self) -> tuple:
        """The rules table of this mesh: experts on `expert_axes`, FSDP over `fsdp_axes`, and `extra_rules`."""
        return rules_for(self.expert_axes, self.fsdp_axes) + self.extra_rules


def sequence_multiple(mesh, model=None) -> int:
    """What a sequence length must be a multiple of on `mesh` (anything with `.context`): mesh.context, times
    the model's `context_block_size()` when the sequence is split (each context shard holds whole blocks)."""
    block_size = getattr(model, "context_block_size", None)
    return mesh.context * (block_size() if block_size is not None and mesh.context > 1 else 1)


def row_positions(slots: int, mesh, model=None) -> int:
    """Input positions of a training row of `slots` prompt + response slots on `mesh`:
    P = ceil((slots - 1) / m) x m with m = `sequence_multiple(mesh, model)`. Position t predicts token t + 1,
    so the slots need one position fewer; the rounded-up tail is padding (attention and loss masks 0)."""
    multiple = sequence_multiple(mesh, model)
    return -(-(slots - 1) // multiple) * multiple


def validate(mesh: MeshConfig, model=None, *, num_devices: int | None = None, seq_len: int | None = None,
             batch: int | None = None, platform: str | None = None) -> None:
    """Raise MeshError for the first violated rule (each rule has its own message).

    `model` (optional) is anything describing its parameters to the mesh (`ShardedModel`, e.g. an
    m3jax `M3Config`): its named fields and then every parameter dimension must divide into the
    shards the rules table gives them.
    """
    for name, size in zip(MESH_AXES, mesh.shape):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MeshError(f"mesh axis {name!r} = {size!r}: expected a positive integer")
    bad = [a for a in mesh.expert_axes if a not in TOKEN_AXES]
    if bad or len(set(mesh.expert_axes)) != len(mesh.expert_axes):
        raise MeshError(f"mesh.expert_axes = {mesh.expert_axes}: expected distinct axes from {TOKEN_AXES} "
                        "(experts exchange tokens over axes that hold distinct tokens)")
    bad = [a for a in mesh.fsdp_axes if a not in TOKEN_AXES]
    if bad or len(set(mesh.fsdp_axes)) != len(mesh.fsdp_axes):
        raise MeshError(f"mesh.fsdp_axes = {tuple(mesh.fsdp_axes)}: expected distinct axes from {TOKEN_AXES}, or "
                        "none (tensor shards the same weights' other dimensions)")
    step = tuple(mesh.fsdp_step_axes)
    if step and (len(set(step)) != len(step) or tuple(mesh.fsdp_axes)[len(mesh.fsdp_axes) - len(step):] != step
                 or len(step) == len(mesh.fsdp_axes)):
        raise MeshError(f"mesh.fsdp_step_axes = {step}: expected a proper tail of mesh.fsdp_axes = "
                        f"{tuple(mesh.fsdp_axes)} (the copy a step gathers over them stays cut over the fsdp axes "
                        "before them; list the axes gathered once per step last)")
    problem = rules_problem(rules_for(mesh.expert_axes, mesh.fsdp_axes), mesh.extra_rules)
    if problem:
        raise MeshError(f"mesh extra_rules: {problem}")
    if num_devices is not None and mesh.num_devices != num_devices:
        # too few of the devices that `platform` (that of the devices counted) can simulate: say how
        simulate = (f"; on CPU, simulate them: XLA_FLAGS=--xla_force_host_platform_device_count={mesh.num_devices} "
                    "in the environment before jax starts") if platform == "cpu" and num_devices < mesh.num_devices \
            else ""
        raise MeshError(f"mesh data x context x expert x tensor = {' x '.join(map(str, mesh.shape))} = "
                        f"{mesh.num_devices} devices, but {num_devices} {'is' if num_devices == 1 else 'are'} "
                        f"available{simulate or f'; expected a product of {num_devices}'}")
    if model is not None:
        problem = undivided_field(mesh, model) or undivided_parameter(mesh, model)
        if problem:
            raise MeshError(problem)
    if seq_len is not None:
        multiple = sequence_multiple(mesh, model)
        block = multiple // mesh.context
        if seq_len % multiple:
            raise MeshError(f"sequence length {seq_len} is not divisible by mesh.context={mesh.context}"
                            + (f" x {block} (the model's block size)" if block != 1 else ""))
    if batch is not None and batch % (mesh.data * mesh.expert):
        raise MeshError(f"batch {batch} is not divisible by mesh.data x mesh.expert = {mesh.data * mesh.expert}")


class ShardedModel(Protocol):
    """What the mesh checks need to know of a model (this package never imports one).

    param_specs():         {name: spec with .shape and .axes (logical axis names, one per dimension)}
    mesh_fields():         [(config field, its value, logical axis)]: a field that must divide into the
                           shards of that logical axis, reported by name (e.g. num_local_experts, "experts")
    context_block_size():  optional; with context parallelism each context shard holds whole blocks of
                           this many tokens
    """

    def param_specs(self) -> dict: ...

    def mesh_fields(self) -> list[tuple[str, int, str]]: ...


def _shards(mesh: MeshConfig, logical: str) -> tuple[tuple[str, ...], int]:
    sizes = dict(zip(MESH_AXES, mesh.shape))
    axes = tuple(a for a in mesh_axes_of(logical, mesh.rules) if sizes[a] > 1)
    return axes, math.prod(sizes[a] for a in axes)


def undivided_field(mesh: MeshConfig, model: ShardedModel) -> str | None:
    """The first of the model's named fields that its logical axis's shards do not divide, or None."""
    for field, value, logical in model.mesh_fields():
        axes, n = _shards(mesh, logical)
        if value % n:
            where = " x ".join(f"mesh.{a}={dict(zip(MESH_AXES, mesh.shape))[a]}" for a in axes)
            hint = (f"; mesh.expert_axes={tuple(mesh.expert_axes)} decides which axes hold the experts"
                    if logical == "experts" else "")
            return f"{field}={value} is not divisible by {where} = {n} (the shards of {logical!r}){hint}"
    return None


def undivided_parameter(mesh: MeshConfig, model: ShardedModel) -> str | None:
    """The first parameter dimension that its mesh axes (per the rules table) do not divide, or None.

    jit refuses uneven parameter shards, and the named fields do not cover every row of the table
    (the embedding's rows lie on data x tensor), so every parameter is checked.
    """
    sizes = dict(zip(MESH_AXES, mesh.shape))
    rules = mesh.rules
    for name, spec in model.param_specs().items():
        if len(spec.axes) != len(spec.shape):  # jax takes a short spec as replicated trailing dimensions
            return (f"parameter {name} of shape {tuple(spec.shape)} names {len(spec.axes)} logical axes "
                    f"{tuple(spec.axes)}: expected one per dimension (None = replicated)")
        for dim, logical, axes in zip(spec.shape, spec.axes, logical_to_spec(spec.axes, rules, sizes)):
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            n = math.prod(sizes[a] for a in axes)
            if dim % n:
                return (f"parameter {name} axis {logical!r} = {dim} is not divisible by mesh "
                        f"{' x '.join(axes)} = {n}")
    return None


JAX_DEFAULT_MEMORY_FRACTION = 0.75  # what XLA's GPU client preallocates of each device when told nothing
MEMORY_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def set_memory_fraction(fraction: float | None, environ=None) -> str | None:
    """Have JAX take `fraction` of each accelerator's memory (XLA_PYTHON_CLIENT_MEM_FRACTION), before its
    backend starts: the command-line entry points call this with mesh.device_memory_fraction. None leaves JAX's
    default (0.75). A value already in the environment wins; the returned text says so when it differs."""
    env = os.environ if environ is None else environ
    if fraction is None:
        return None
    current = env.get(MEMORY_FRACTION_ENV)
    if current not in (None, ""):
        if float(current) != float(fraction):
            return (f"{MEMORY_FRACTION_ENV}={current} from the environment is used, not mesh.device_memory_fraction "
                    f"{fraction}")
        return None
    env[MEMORY_FRACTION_ENV] = f"{fraction:g}"
    return None


def init_distributed(mesh: MeshConfig, timeout_s: int = 300) -> None:
    """Join a multi-host job (`distributed_args`); a no-op for one process or when already joined.
    Must run before anything asks jax for its devices. `timeout_s`: how long to wait for every process to join
    (jax's default), after which jax ends this process."""
    if jax.distributed.is_initialized():
        return
    args = distributed_args(mesh)
    if args is None:
        return
    # Cross-process collectives on CPU hosts (tests, CPU clusters) need gloo; GPUs ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**args, initialization_timeout=timeout_s)


def key_value_client():
    """jax's distributed key-value store of a joined job, or None: it has no public handle (orbax and
    multihost_utils reach it the same way)."""
    from jax._src import distributed
    return distributed.global_state.client


def joined_process() -> tuple[int, int]:
    """(this process's index, the job's process count) of a joined job, read without starting the backend
    (jax.process_index() starts it, which on a CPU job waits for every process's backend: a process that only
    joined to say why it stops would wait for the others forever)."""
    from jax._src import distributed
    return distributed.global_state.process_id, distributed.global_state.num_processes


def from_process_zero(key: str, text: str | None, timeout_s: float = 300.0) -> str:
    """Process 0's `text` on every process of a joined job (`init_distributed`): process 0 passes it, the others
    None, and wait for it up to `timeout_s` (what jax gives the processes to join). Through jax's distributed
    key-value store: no device and no collective, so it may run before the backend starts, and a process 0 about to
    exit leaves no one waiting in a collective. Each key is written once per job."""
    client = key_value_client()
    if client is None:
        raise RuntimeError(f"from_process_zero({key!r}): this process has not joined a multi-host job")
    if text is not None:
        client.key_value_set(key, text)
        return text
    return client.blocking_key_value_get(key, int(timeout_s * 1000))


def build_mesh(mesh: MeshConfig, model: ShardedModel | None = None, *, seq_len: int | None = None,
               batch: int | None = None, devices=None) -> Layout:
    """Validate and build the layout: the Mesh (Auto axis types: the partitioner places what the rules
    leave open) with the rules table that puts the experts on `mesh.expert_axes` and FSDP on `mesh.fsdp_axes`."""
    init_distributed(mesh)
    devices = list(devices) if devices is not None else jax.devices()
    validate(mesh, model, num_devices=len(devices), seq_len=seq_len, batch=batch,
             platform=devices[0].platform if devices else None)
    return Layout(jax.make_mesh(mesh.shape, MESH_AXES, axis_types=(AxisType.Auto,) * 4, devices=devices),
                  mesh.rules, tuple(mesh.fsdp_step_axes), context_balance=mesh.context_balance)


def mesh_config_of(mesh) -> MeshConfig:
    """The MeshConfig describing a Layout (or a Mesh with m3jax's axis names and the default rules)."""
    layout = mesh if isinstance(mesh, Layout) else Layout(mesh)  # a bare Mesh lacking m3jax's axes: MeshError
    if layout.mesh is None:
        return MeshConfig(expert_axes=expert_axes_of(layout.rules), fsdp_axes=fsdp_axes_of(layout.rules),
                          fsdp_step_axes=layout.fsdp_step_axes, context_balance=layout.context_balance)
    missing = [a for a in MESH_AXES if a not in layout.mesh.shape]
    if missing:
        raise MeshError(f"mesh axes {tuple(layout.mesh.axis_names)} lack {missing}: expected {MESH_AXES}")
    return MeshConfig(*(layout.mesh.shape[a] for a in MESH_AXES), expert_axes=expert_axes_of(layout.rules),
                      fsdp_axes=fsdp_axes_of(layout.rules), fsdp_step_axes=layout.fsdp_step_axes,
                      context_balance=layout.context_balance)
