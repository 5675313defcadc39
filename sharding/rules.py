"""The one table mapping the model's logical axis names to mesh axes.

Model code only ever names logical axes (`("layers", "experts", None, "expert_mlp", "embed")`); this
table decides where each lands on the ("data", "context", "expert", "tensor") mesh. Changing a
layout means changing a row here, nowhere else.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

MESH_AXES = ("data", "context", "expert", "tensor")

RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("act_batch", "data"),
    ("act_seq", "context"),
    ("act_embed", None),
    ("act_vocab", "tensor"),
    # parameters
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "data"),  # FSDP: weights are sharded over the data axis and gathered per layer
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("index_heads", None),
    ("index_head_dim", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    ("norm", None),
)


def logical_to_spec(axes: tuple[str | None, ...], rules=RULES, mesh_axes=MESH_AXES) -> PartitionSpec:
    """PartitionSpec for logical axes; a mesh axis is used at most once (later uses stay replicated)."""
    table = dict(rules)
    taken: set[str] = set()
    out = []
    for name in axes:
        target = table.get(name) if name is not None else None
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        targets = tuple(t for t in targets if t in mesh_axes and t not in taken)
        taken.update(targets)
        out.append(targets[0] if len(targets) == 1 else (targets or None))
    return PartitionSpec(*out)


def _active_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return None
    return mesh


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Constrain an activation to its logical layout when an m3jax mesh is active, else identity."""
    mesh = _active_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes)))
