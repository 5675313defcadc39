"""The one table mapping the model's logical axis names to mesh axes.

Model code only ever names logical axes (`("layers", "experts", None, "expert_mlp", "embed")`); this
table decides where each lands on the ("data", "context", "expert", "tensor") mesh. Changing a
layout means changing a row here, nowhere else. The rows a run may change are where the experts
live (`MeshConfig.expert_axes`) and which axes shard the other weights (FSDP, `MeshConfig.fsdp_axes`), through
`rules_for`. The table travels with its mesh as a
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
    ("embed", "data"),  # FSDP: weights sharded over data (`MeshConfig.fsdp_axes`), gathered per layer
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


def rules_for(expert_axes: tuple[str, ...], fsdp_axes: tuple[str, ...] = ("data",)) -> tuple:
    """RULES with the experts placed on `expert_axes` and the non-expert weights' `embed` dimension sharded
    over `fsdp_axes` (FSDP; () = replicated)."""
    rows = {"experts": tuple(expert_axes), "embed": _target(fsdp_axes)}
    return tuple((k, rows.get(k, v)) for k, v in RULES)


def _target(axes) -> str | tuple[str, ...] | None:
    """A row's mesh axes as the table spells them: one name, a tuple of several, or None for none."""
    axes = tuple(axes)
    return axes[0] if len(axes) == 1 else (axes or None)


def without_axes(rules, axes) -> tuple:
    """The rules table with the mesh axes `axes` taken out of the FSDP row (`embed`, the dimension `fsdp_axes`
    shards): the layout of a step's copy of the weights (`MeshConfig.fsdp_step_axes`), gathered once over `axes`
    and then read by every micro-batch. Every other row stays: the experts (tokens travel to them), the
    embedding table's rows (a lookup reads its own rows; it never gathers the table) and the activations."""
    kept = _target(a for a in mesh_axes_of("embed", rules) if a not in set(axes))
    return tuple((name, kept if name == "embed" else target) for name, target in rules)


def step_copy_rules(rules, step_axes, sizes: dict) -> tuple | None:
    """The rules of a step's copy of the weights (`without_axes`) on a mesh of `sizes`; None when no step axis
    has more than one device (there is nothing to gather once)."""
    if not any(sizes[a] > 1 for a in step_axes):
        return None
    return without_axes(rules, step_axes)


def expert_axes_of(rules) -> tuple[str, ...]:
    """The mesh axes a rules table puts the experts on (the inverse of `rules_for`)."""
    return mesh_axes_of("experts", rules)


def fsdp_axes_of(rules) -> tuple[str, ...]:
    """The mesh axes a rules table shards the non-expert weights over (the inverse of `rules_for`)."""
    return mesh_axes_of("embed", rules)


def rules_problem(rules, extra=(), mesh_axes=MESH_AXES) -> str | None:
    """Why `rules` + `extra` rows cannot place logical axes on a mesh with `mesh_axes`, or None: a row that is not
    (name, target), a name given twice, or a target other than a mesh axis, a tuple of them, or None."""
    names = {row[0] for row in rules if isinstance(row, tuple) and len(row) == 2}
    for row in (*rules, *extra):
        if not (isinstance(row, tuple) and len(row) == 2 and isinstance(row[0], str)):
            return f"rules row {row!r}: expected (logical axis name, mesh axes)"
        target = (row[1],) if isinstance(row[1], str) else row[1]
        if target is not None and not (isinstance(target, tuple) and all(a in mesh_axes for a in target)):
            return (f"rules row {row!r}: its target {row[1]!r} is not a mesh axis; allowed: one of {mesh_axes}, a "
                    "tuple of them, or None (replicated)")
    for name, _ in extra:
        if name in names:
            return f"logical axis {name!r} has a row in the rules table already (sharding/rules.py)"
        names.add(name)
    return None


def mesh_axes_of(name: str, rules=RULES) -> tuple[str, ...]:
    table = dict(rules)
    if name not in table:
        # A misspelt or new logical name would otherwise be replicated silently, on every mesh.
        raise KeyError(f"logical axis {name!r} has no row in the sharding rules table (sharding/rules.py); "
                       "a model of your own adds rows for its names: MeshConfig(extra_rules=((name, mesh axes), "
                       "...)), mesh axes None = replicated")
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
