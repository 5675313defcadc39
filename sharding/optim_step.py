"""The optimizer step applied one layer slice at a time, in place (bounded temporaries).

Applying an optax chain to the whole parameter tree lets XLA hold fp32 temporaries (the master, Adam's
fp32 moments, the update) of every leaf at once, and keep the old state beside the new one until the
non-finite check selects between them: XLA:CPU measured 7.5-9.5 bytes per parameter on top of the
train state (BENCHMARKS.md, scripts/bench_update_memory.py), about 32 GB per GPU for the 32-node
recipe. Here every large leaf of a layer stack is updated in a `fori_loop` over its layers whose carry
is the leaf and its state leaves, so each layer's slice is written back into the same (donated)
buffers and the temporaries are those of one slice (`m3jax.plan.memory.update_temporaries`).

The maths is the chain's own: the per-slice update calls the very transformations of the chain after
the global-norm clip, whose factor (the only quantity that needs every leaf) is computed once with
optax's formula. Results equal `optimizer.update` + `precision.apply` on the whole tree up to float
rounding (XLA compiles the slice's arithmetic into other kernels); compact and fp32 masters stay
bitwise equal to each other (tests/test_train_step.py).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sharding import precision

SLICE_MIN_ELEMS = 1 << 20  # smaller leaves are updated whole: their temporaries do not matter


class SlicedOptimizer(NamedTuple):
    """An optax GradientTransformation (init, update) plus `step`, its in-place sliced application:
    step(grads, divisor, opt_state, params, keep) -> (params, opt_state) for grads / divisor, or the
    old params and state where keep is False. `clip_mask`: the clip groups (`group_norms`), None = one."""
    init: Callable
    update: Callable
    step: Callable
    clip_mask: object = None


def _one_group(mask) -> bool:
    """True when `mask` puts every leaf in one clip group (None, a bool, or a tree of equal bools)."""
    return mask is None or isinstance(mask, bool) or len(set(jax.tree.leaves(mask))) <= 1


def group_norms(grads, mask) -> tuple[jax.Array, jax.Array | None]:
    """(norm of the leaves where mask is True, norm of the others or None when there are none): the two
    clip groups. With mask None every leaf is in the first group, and its norm is optax's global norm
        ||g|| = sqrt(sum_leaves sum(g_leaf^2))."""
    flags = _flags(mask, grads)
    leaves = jax.tree.leaves(grads)
    main = optax.tree.norm([g for g, f in zip(leaves, flags) if f])
    apart = [g for g, f in zip(leaves, flags) if not f]
    return main, (optax.tree.norm(apart) if apart else None)


def _clip(g, norm, clip_norm):
    """optax.clip_by_global_norm's arithmetic for one leaf: g where norm < clip_norm, else g / norm * clip_norm."""
    return jax.lax.select(jnp.squeeze(norm < clip_norm), g, (g / norm.astype(g.dtype)) * clip_norm)


def clip_by_group_norms(clip_norm: float, mask) -> optax.GradientTransformation:
    """optax.clip_by_global_norm applied to each clip group on its own (`group_norms`): the leaves where mask
    is False (those without an LM gradient: the indexer, trained only by an auxiliary loss) are clipped by
    their own global norm, so that their gradient never scales the policy's update down. With one group
    (mask None or all True) it is optax's transformation itself; the state is optax's EmptyState."""
    if _one_group(mask):
        return optax.clip_by_global_norm(clip_norm)

    def update(updates, state, params=None):
        del params
        main, apart = group_norms(updates, mask)
        leaves, tdef = jax.tree.flatten(updates)
        out = [_clip(g, main if f else apart, clip_norm) for g, f in zip(leaves, _flags(mask, updates))]
        return jax.tree.unflatten(tdef, out), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def sliced(rest: Callable[[bool], optax.GradientTransformation], clip_norm: float | None,
           decay_mask=None, clip_mask=None) -> Callable:
    """`step` for `with_master_weights(chain(clip_by_group_norms(clip_norm, clip_mask), *parts))` whose state
    is MasterState(store, (clip_state, *part_states)); `rest(decay)` = with_master_weights(chain(*parts))
    for one leaf that is (or is not) weight-decayed (the whole optimizer when clip_norm is None: then its
    state is used as is). `decay_mask` / `clip_mask`: a bool per parameter leaf (a pytree like the params),
    None = all True."""

    def step(grads, divisor, opt_state, params, keep):
        norms = group_norms(jax.tree.map(lambda g: g / divisor, grads), clip_mask)
        in_main = _flags(clip_mask, params)

        def prepare(i, g):
            g = g / divisor
            return g if clip_norm is None else _clip(g, norms[0] if in_main[i] else norms[1], clip_norm)

        inner = opt_state.inner[1:] if clip_norm is not None else opt_state.inner
        state = precision.MasterState(opt_state.master, inner)
        params, state = _apply_by_slices(rest, prepare, grads, state, params, keep,
                                         _flags(decay_mask, params))
        inner = ((opt_state.inner[0], *state.inner) if clip_norm is not None else state.inner)
        return params, precision.MasterState(state.master, inner)

    return step


def _apply_by_slices(opt_for, prepare, grads, state, params, keep, decays):
    """Run opt_for(decays[i]).update leaf by leaf (sliced over the leading axis when large) and reassemble
    the state.

    The state is seen as items: params-shaped subtrees (master store, moments) and scalars (counts). A
    leaf's own state is the state with every params-shaped subtree replaced by that leaf's array."""
    pdef = jax.tree.structure(params)
    is_p = lambda x: jax.tree.structure(x) == pdef  # noqa: E731
    items, sdef = jax.tree.flatten(state, is_leaf=is_p)
    kinds = [is_p(x) for x in items]
    columns = [jax.tree.leaves(x) if k else x for x, k in zip(items, kinds)]
    master_mode = not (isinstance(state.master, tuple) and state.master == ())

    def leaf_state(i, scalar_only=False):
        pick = lambda col, k: (jnp.zeros((), col[i].dtype) if scalar_only else col[i]) if k else col  # noqa: E731
        return jax.tree.unflatten(sdef, [pick(c, k) for c, k in zip(columns, kinds)])

    def one(opt, prep, g, st, p):
        upd, st2 = opt.update(prep(g), st, p)
        p2 = upd if master_mode else optax.apply_updates(p, upd)
        return jax.tree.map(lambda a, b: jnp.where(keep, a, b), (p2, st2), (p, st))

    new_p, new_cols = [], [[] for _ in items]
    layered = [_leads_with_layers(v) for v in jax.tree.leaves(params, is_leaf=_is_variable)]
    for i, (p, g) in enumerate(zip(jax.tree.leaves(params), jax.tree.leaves(grads))):
        p2, st2 = _update_leaf(functools.partial(one, opt_for(decays[i]), functools.partial(prepare, i)), g,
                               leaf_state(i), p, layered[i])
        new_p.append(p2)
        for j, x in enumerate(jax.tree.leaves(st2)):
            new_cols[j].append(x)
    # Counts are the same for every leaf: evaluate the chain once on 0-d stand-ins for their new values.
    p0 = jax.tree.leaves(params)[0]
    _, scalars = one(opt_for(True), functools.partial(prepare, 0), jnp.zeros((), jnp.float32),
                     leaf_state(0, scalar_only=True), jnp.zeros((), p0.dtype))
    scalars = jax.tree.leaves(scalars)
    out = [jax.tree.unflatten(jax.tree.structure(x), col) if k else scalars[j]
           for j, (x, k, col) in enumerate(zip(items, kinds, new_cols))]
    return jax.tree.unflatten(pdef, new_p), jax.tree.unflatten(sdef, out)


def _is_variable(x) -> bool:
    return hasattr(x, "get_metadata") and hasattr(x, "get_value")


def _leads_with_layers(v) -> bool:
    """True for a parameter whose leading axis is a stack's "layers" axis (nnx metadata)."""
    return _is_variable(v) and tuple(v.get_metadata().get("logical_axes") or ())[:1] == ("layers",)


def _update_leaf(one, g, st, p, layered: bool):
    """one(g, st, p) on a whole leaf, or for a large layer stack a fori_loop over its layers writing each
    slice back into the carried leaf and state arrays (in place when the step donates them)."""
    if not layered or p.shape[0] < 2 or math.prod(p.shape) < SLICE_MIN_ELEMS:
        return one(g, st, p)
    n = p.shape[0]
    sliced_ = lambda x: x.shape[:1] == (n,) and x.ndim == p.ndim  # noqa: E731
    take = lambda j: lambda x: jax.lax.dynamic_index_in_dim(x, j, keepdims=False) if sliced_(x) else x  # noqa: E731

    # Software-pipelined: layer j is updated from slices read at the end of iteration j - 1 (carried,
    # so materialised), and layer j + 1 is read from the arrays after layer j's write-back. Reading
    # layer j inside the write-backs instead forms a cycle (the new param needs the old remainder and
    # the new remainder the old param) that XLA breaks by copying whole carried leaves every iteration.
    def body(j, carry):
        (p_all, st_all), (p_j, st_j) = carry
        p2, st2 = one(take(j)(g), st_j, p_j)
        put = lambda full, part: jax.lax.dynamic_update_index_in_dim(full, part, j, 0) if sliced_(full) else full  # noqa: E731
        p_all, st_all = put(p_all, p2), jax.tree.map(put, st_all, st2)
        nxt = take(jnp.minimum(j + 1, n - 1))
        return (p_all, st_all), (nxt(p_all), jax.tree.map(nxt, st_all))

    first = take(0)
    (p, st), _ = jax.lax.fori_loop(0, n, body, ((p, st), (first(p), jax.tree.map(first, st))))
    return p, st


def _flags(mask, tree) -> list[bool]:
    """One bool per array leaf of `tree`: all True for mask None, `mask` itself for a bool, else the leaves
    of `mask` (a pytree with one bool where `tree` has each array, e.g. built by mapping over the params)."""
    n = len(jax.tree.leaves(tree))
    if mask is None or isinstance(mask, bool):
        return [mask is not False] * n
    flags = [bool(f) for f in jax.tree.leaves(mask)]
    if len(flags) != n:
        raise ValueError(f"weight-decay mask has {len(flags)} leaves for {n} parameters: build it from the same "
                         "parameter tree the optimizer updates")
    return flags


def decayed_weights(weight_decay: float, mask=None) -> optax.GradientTransformation:
    """Decoupled weight decay where the mask says so: u + weight_decay * p on those leaves, u elsewhere.

    optax.add_decayed_weights's arithmetic and (empty) state; optax's own `mask=` would wrap the state in
    MaskedState, and the sliced step needs one state layout for every leaf whether decayed or not."""

    def update(updates, state, params):
        leaves, tdef = jax.tree.flatten(updates)
        decayed = [g + weight_decay * p if f else g
                   for g, p, f in zip(leaves, jax.tree.leaves(params), _flags(mask, updates), strict=True)]
        return jax.tree.unflatten(tdef, decayed), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def adamw(learning_rate, *, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, clip_norm: float | None = 1.0,
          moment_dtype=jnp.float32, master: str = "fp32", decay_mask=None,
          clip_mask=None) -> optax.GradientTransformation:
    """Clip -> Adam (moments in moment_dtype) -> decoupled weight decay -> lr schedule, on the master.

    Returns a `SlicedOptimizer`: the optax transformation plus `step`, the same update applied layer
    slice by layer slice in place (what `make_train_step` runs). `master`: `sharding.precision` modes.
    `decay_mask`: a pytree like the params with a bool per parameter, False for parameters weight decay
    must leave alone (those without a gradient from the loss, which decay alone would shrink every
    step); None decays every parameter. `clip_mask`: likewise, False for the parameters clipped by their own
    global norm (`clip_by_group_norms`); None clips all together."""

    def parts(decay):
        adam = [precision.scale_by_adam(b1, b2, eps, moment_dtype)]
        wd = [decayed_weights(weight_decay, decay)] if weight_decay else []
        return [*adam, *wd, optax.scale_by_learning_rate(learning_rate)]

    clip_mask = None if _one_group(clip_mask) else clip_mask
    clip = [clip_by_group_norms(clip_norm, clip_mask)] if clip_norm else []
    whole = precision.with_master_weights(optax.chain(*clip, *parts(decay_mask)), master)
    rest = lambda decay: precision.with_master_weights(optax.chain(*parts(decay)), master)  # noqa: E731
    return SlicedOptimizer(whole.init, whole.update, sliced(rest, clip_norm or None, decay_mask, clip_mask),
                           clip_mask)
