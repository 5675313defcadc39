"""A layout: one device mesh and the rules table that places logical axes on it, as one value.

Everything that places or partitions arrays (the model's activation constraints and expert exchange,
parameter loading, the train step, the logprob pass, generation) takes a `Layout` rather than reading
process-wide state, so two layouts can live in one process and a loaded model keeps its placement
whatever mesh context it is later called under. `Layout()` (no mesh) is one device: constraints are
identities and the experts run locally.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import MESH_AXES, RULES, logical_to_spec, mesh_axes_of, rules_problem, step_copy_rules

GPU_PLATFORMS = ("gpu", "cuda")  # jax names a CUDA device's platform "gpu"; a caller may name it "cuda"


def platform(backend: str | None = None) -> str:
    """The platform a program is built for: `backend` (a layout's `backend`), else jax's default backend."""
    return backend or jax.default_backend()


def on_gpu(backend: str | None = None) -> bool:
    """Whether `platform(backend)` is a GPU."""
    return platform(backend) in GPU_PLATFORMS


class MeshError(ValueError):
    """A mesh that cannot run this model: names the axis, its size and the rule it breaks."""


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh: Mesh | None = None
    rules: tuple = RULES
    # FSDP axes whose gather a step does once, into a copy of the weights that all its micro-batches read
    # (`MeshConfig.fsdp_step_axes`); () = every micro-batch gathers over every FSDP axis
    fsdp_step_axes: tuple[str, ...] = ()
    # The platform the model's programs are built for ("cpu", "gpu", "tpu"); None = the mesh's devices', or
    # jax's default backend without a mesh. Set it to build for devices jax does not run on here (XLA's GPU
    # compiler on compile-only devices, `m3jax.plan.compile.compile_only_gpus`, for a layout without a mesh).
    platform: str | None = None
    # Context-parallel attention swaps the shards' second halves of queries between mirror shards, so that
    # every shard does the same causal work (`sharding.context.mirror_second_halves`); False = contiguous
    # shards, the last doing 2n - 1 times the first's work (`MeshConfig.context_balance`)
    context_balance: bool = True

    def __post_init__(self):
        if isinstance(self.mesh, Mesh):  # a row naming no axis of the mesh failed in jax, at the first sharding
            problem = rules_problem(self.rules, mesh_axes=tuple(self.mesh.axis_names))
            missing = [a for a in MESH_AXES if a not in self.mesh.shape]
            if problem and missing and self.rules == RULES:  # another program's mesh, given where m3jax's is expected
                raise MeshError(f"mesh axes {tuple(self.mesh.axis_names)} lack {missing}: expected {MESH_AXES}")
            if problem:
                raise MeshError(f"Layout: {problem}")

    @property
    def backend(self) -> str:
        """Where this layout's programs run, which decides the model's platform-dependent choices ("auto"
        kernels, the sparse path, the expert exchange): `platform`, else the mesh's devices' platform, else
        jax's default backend. Read from the layout, not from the process, so that a program built for other
        devices than the process's default (compile-only GPUs) makes their choices."""
        if self.platform is not None:
            return self.platform
        if isinstance(self.mesh, Mesh):
            return self.mesh.devices.flat[0].platform
        return jax.default_backend()

    @property
    def shape(self) -> dict[str, int]:
        return {} if self.mesh is None else dict(self.mesh.shape)

    @property
    def num_devices(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    def axes(self, logical: str) -> tuple[str, ...]:
        """Mesh axes (of size > 1) that hold the logical axis `logical`."""
        if self.mesh is None:
            mesh_axes_of(logical, self.rules)  # an unknown name is an error on every layout
            return ()
        return tuple(a for a in mesh_axes_of(logical, self.rules) if self.mesh.shape[a] > 1)

    def size(self, logical: str) -> int:
        """How many shards the logical axis `logical` is cut into (1 without a mesh)."""
        return math.prod(self.mesh.shape[a] for a in self.axes(logical))

    def batch_problem(self, rows: int, positions: int | None = None) -> str | None:
        """Why a batch of `rows` x `positions` cannot be placed on this layout's token axes, or None: jax's
        IndivisibleError named no setting."""
        for what, size, axis in (("rows", rows, "act_batch"), ("positions", positions, "act_seq")):
            if size is not None and size % self.size(axis):
                return (f"{size} {what} on mesh axes {'x'.join(self.axes(axis)) or '()'} of {self.size(axis)} "
                        f"shards: expected a multiple of {self.size(axis)} (pad the batch; "
                        "sharding.mesh.row_positions gives a row's positions on a mesh)")
        return None

    def spec(self, logical_axes: tuple[str | None, ...], drop_trivial: bool = False) -> PartitionSpec:
        """PartitionSpec for logical axes; with `drop_trivial`, mesh axes of size 1 are left out."""
        return logical_to_spec(logical_axes, self.rules, self.shape if drop_trivial and self.mesh else None)

    def sharding(self, logical_axes: tuple[str | None, ...]) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, self.spec(logical_axes))

    def replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

    def constrain(self, x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
        """Constrain an activation to its logical layout (identity without a mesh)."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(logical_axes)))

    def step_copy(self) -> "Layout | None":
        """The layout of a step's copy of the weights: this one with `fsdp_step_axes` out of the parameter rows
        (`sharding.rules.without_axes`); None when there is no such copy (no step axes of size > 1, or no mesh)."""
        rules = None if self.mesh is None else step_copy_rules(self.rules, self.fsdp_step_axes, self.mesh.shape)
        return None if rules is None else dataclasses.replace(self, rules=rules, fsdp_step_axes=())

    def with_rule(self, logical: str, mesh_axes) -> "Layout":
        """This layout with one row of the rules table changed (e.g. `("act_seq", None)` for decoding)."""
        mesh_axes_of(logical, self.rules)
        target = tuple(mesh_axes) if isinstance(mesh_axes, (list, tuple)) else mesh_axes
        return dataclasses.replace(self, rules=tuple((k, target if k == logical else v) for k, v in self.rules))


def as_layout(mesh_or_layout) -> Layout:
    """A Layout from None (one device), a jax Mesh (the default rules) or a Layout (itself)."""
    if mesh_or_layout is None:
        return Layout()
    if isinstance(mesh_or_layout, Layout):
        return mesh_or_layout
    if isinstance(mesh_or_layout, Mesh):
        return Layout(mesh_or_layout)
    raise TypeError(f"expected a sharding.layout.Layout (from sharding.mesh.build_mesh), a jax Mesh or None, "
                    f"got {type(mesh_or_layout).__name__}")
