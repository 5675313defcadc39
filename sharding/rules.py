"""The one table mapping the model's logical axis names to mesh axes.

Model code only ever names logical axes (`("layers", "experts", None, "expert_mlp", "embed")`); this
table decides where each lands on the ("data", "context", "expert", "tensor") mesh. Changing a
layout means changing a row here, nowhere else. The only row a run may change is where the experts
live (`MeshConfig.expert_axes`), through `rules_for`. The table travels with its mesh as a
`sharding.layout.Layout`; nothing here is process-wide state.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

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


def rules_for(expert_axes: tuple[str, ...]) -> tuple:
    """RULES with the experts placed on `expert_axes`."""
    return tuple((k, tuple(expert_axes) if k == "experts" else v) for k, v in RULES)


def expert_axes_of(rules) -> tuple[str, ...]:
    """The mesh axes a rules table puts the experts on (the inverse of `rules_for`)."""
    return mesh_axes_of("experts", rules)


def mesh_axes_of(name: str, rules=RULES) -> tuple[str, ...]:
    table = dict(rules)
    if name not in table:
        # A misspelt or new logical name would otherwise be replicated silently, on every mesh.
        raise KeyError(f"logical axis {name!r} has no row in the sharding rules table (sharding/rules.py); "
                       "add one (None = replicated)")
    target = table[name]
    return (target,) if isinstance(target, str) else tuple(target or ())


def logical_to_spec(axes: tuple[str | None, ...], rules=RULES, mesh_shape: dict | None = None) -> PartitionSpec:
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
