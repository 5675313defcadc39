"""The one table mapping the model's logical axis names to mesh axes.

Model code only ever names logical axes (`("layers", "experts", None, "expert_mlp", "embed")`); this
table decides where each lands on the ("data", "context", "expert", "tensor") mesh. Changing a
layout means changing a row here, nowhere else. The only row a run may change is where the experts
live (`MeshConfig.expert_axes`), through `rules_for`.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import NamedSharding, PartitionSpec

MESH_AXES = ("data", "context", "expert", "tensor")
TOKEN_AXES = ("data", "context", "expert")  # axes over which devices hold distinct tokens

RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("act_batch", ("data", "expert")),
    ("act_seq", "context"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
    # parameters
    ("layers", None),
    ("vocab", "tensor"),
    # The embedding table is sharded on rows only: sharding both of its dims made the partitioner
    # replicate it around the lookup (stack-notes §2).
    ("table_vocab", ("data", "tensor")),
    ("embed", "data"),  # FSDP: weights sharded over data, gathered per layer by the partitioner
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("index_heads", None),
    ("index_head_dim", None),
    ("mlp", "tensor"),
    ("experts", TOKEN_AXES),  # expert parallelism over every device holding distinct tokens
    ("expert_mlp", "tensor"),
    ("norm", None),
)

_active: contextvars.ContextVar = contextvars.ContextVar("m3jax_rules", default=RULES)


def rules_for(expert_axes: tuple[str, ...]) -> tuple:
    """RULES with the experts placed on `expert_axes`."""
    return tuple((k, tuple(expert_axes) if k == "experts" else v) for k, v in RULES)


@contextlib.contextmanager
def use_rules(rules):
    token = _active.set(tuple(rules))
    try:
        yield
    finally:
        _active.reset(token)


def set_rules(rules) -> None:
    """Make `rules` the table for the rest of this context (a run's process: its mesh config decides)."""
    _active.set(tuple(rules))


def active_rules() -> tuple:
    return _active.get()


def mesh_axes_of(name: str, rules=None) -> tuple[str, ...]:
    table = dict(rules or active_rules())
    if name not in table:
        # A misspelt or new logical name would otherwise be replicated silently, on every mesh.
        raise KeyError(f"logical axis {name!r} has no row in the sharding rules table (sharding/rules.py); "
                       "add one (None = replicated)")
    target = table[name]
    return (target,) if isinstance(target, str) else tuple(target or ())


def logical_to_spec(axes: tuple[str | None, ...], rules=None, mesh_shape: dict | None = None) -> PartitionSpec:
    """PartitionSpec for logical axes. A mesh axis is used at most once (later uses stay replicated);
    with `mesh_shape`, axes of size 1 are dropped."""
    taken: set[str] = set()
    out = []
    for name in axes:
        targets = mesh_axes_of(name, rules) if name is not None else ()
        targets = tuple(t for t in targets if t not in taken and (mesh_shape is None or mesh_shape[t] > 1))
        taken.update(targets)
        out.append(targets[0] if len(targets) == 1 else (targets or None))
    return PartitionSpec(*out)


def active_mesh():
    """The abstract mesh in context if it has m3jax's axes, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return None
    return mesh


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Constrain an activation to its logical layout when an m3jax mesh is active, else identity."""
    mesh = active_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes)))


def named_sharding(mesh, axes: tuple[str | None, ...]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes))
