"""What a step's checkpoint holds of the train state, and how it becomes this run's state again (`rl.checkpoint`).

A checkpoint keeps the fp32 master of the params rather than the precision mode's (params, remainder), so it is
independent of the mode and of the mesh: `portable_state` is what a save writes, `restore_target` the abstract tree
a restore reads it into (on this run's shardings), `state_mismatch` how a saved tree differs from it, and
`rebuild_state` this run's layout made from what was read (fp32 params <-> bf16 + fp32 master <-> bf16 + remainder).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from sharding import precision
from sharding.train_step import TrainState

_joined_master = jax.jit(precision.master_of)


def portable_state(state: TrainState) -> dict:
    # A compact master is computed (params joined with their remainders): one program for the whole tree, since
    # eagerly each leaf's ops compile one by one (~20 s of the 32-node miniature's first checkpoint, 2026-12-03).
    # Otherwise the master is the arrays themselves, which a jitted copy would hold twice.
    compact = any(x.dtype == jnp.int16 for x in jax.tree.leaves(state.opt_state.master))
    master = (_joined_master if compact else precision.master_of)(state.params, state.opt_state)
    return {"master": nnx.to_pure_dict(master), "rest": nnx.to_pure_dict(state.rest),
            "inner": state.opt_state.inner, "step": state.step, "skipped": state.skipped}


def abstract_tree(tree, dtype=None):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype,
                                                       sharding=getattr(x, "sharding", None)), tree)


def restore_target(like: TrainState) -> dict:
    """The abstract `portable_state(like)`, without computing a master just to learn its shapes."""
    return {"master": nnx.to_pure_dict(abstract_tree(like.params, jnp.float32)),
            "rest": nnx.to_pure_dict(abstract_tree(like.rest)), "inner": abstract_tree(like.opt_state.inner),
            "step": abstract_tree(like.step), "skipped": abstract_tree(like.skipped)}


def _empty(x) -> bool:
    """An empty node: None, or an optimizer's empty state (a namedtuple without fields), which a checkpoint's
    metadata holds as None."""
    return x is None or (isinstance(x, tuple) and hasattr(x, "_fields") and not x._fields)


def _leaves(tree) -> dict[tuple[str, ...], object]:
    """{path as plain names: shape, or "empty"} of a state, read alike from this run's abstract state and from a
    checkpoint's metadata (a Variable's or a namedtuple's field and a saved dict's key give the same name)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_empty)[0]
    return {tuple(jax.tree_util.keystr((e,), simple=True) for e in path): "empty" if _empty(leaf) else tuple(leaf.shape)
            for path, leaf in flat}


def state_mismatch(path: str, target: dict) -> str | None:
    """How the state saved at `path` (a step's `state` item: its metadata, the tree and every array's shape)
    differs from `target` (`restore_target` of this run's state); None when they match, or when the metadata
    cannot be read (a damaged checkpoint: the restore decides)."""
    try:
        saved = _leaves(ocp.StandardCheckpointHandler().metadata(epath.Path(path)))
    except Exception:  # noqa: BLE001 - unreadable metadata is the restore's to report
        return None
    want = _leaves(target)
    for key in sorted(set(saved) | set(want)):
        where = "/".join(key)
        if key not in saved:
            return f"it has no {where} {want[key]} (this run's state has)"
        if key not in want:
            return f"it holds {where} {saved[key]}, which this run's state has not"
        if saved[key] != want[key]:
            return f"{where} is {saved[key]} there, {want[key]} in this run's state"
    return None


def state_restore_args(target: dict, params_only: bool):
    """The restore of a step's `state` item: whole, or (params_only) without the optimizer's inner state, which
    is then not read (orbax's partial restore)."""
    if not params_only:
        return ocp.args.StandardRestore(target)
    part = {k: v for k, v in target.items() if k != "inner"}
    return ocp.args.PyTreeRestore(part, restore_args=ocp.checkpoint_utils.construct_restore_args(part),
                                  partial_restore=True)


def rebuild_state(like: TrainState, saved: dict) -> TrainState:
    master = jax.tree.map(lambda x: x, like.params)  # a fresh State to fill
    nnx.replace_by_pure_dict(master, saved["master"])
    master = jax.tree.map(lambda m: m.astype(jnp.float32), master)
    params = precision.params_from_master(master, like.params)
    rest = jax.tree.map(lambda x: x, like.rest)
    nnx.replace_by_pure_dict(rest, saved["rest"])
    if "inner" not in saved:  # params_only: the optimizer state stays `like`'s (a reader's, by shape)
        return TrainState(params, rest, like.opt_state, jnp.asarray(saved["step"]), jnp.asarray(saved["skipped"]))
    if like.opt_state.master == ():  # mode "none"
        store = ()
    else:  # "fp32": the master itself; "compact": int16 remainders where the layout has them
        # An fp32 param (the router) is its own master, the same array: the train step donates the whole
        # state, and a buffer donated twice fails it (PJRT "donate the same buffer twice", then a segfault),
        # so such a leaf's master is a copy, as `precision.with_master_weights` makes it at init.
        store = jax.tree.map(lambda m, p, s: precision.remainder(m, p) if s.dtype == jnp.int16
                             else jnp.array(m, copy=True) if p is m else m, master, params, like.opt_state.master)
    inner = jax.tree.map(lambda s, ref: s.astype(ref.dtype), saved["inner"], like.opt_state.inner)
    return TrainState(params, rest, precision.MasterState(store, inner), jnp.asarray(saved["step"]),
                      jnp.asarray(saved["skipped"]))
