"""A jitted, sharded training step: micro-batch accumulation, global-token normalisation, clipping
(inside the optimizer), non-finite skip, explicit shardings and donation.

The model enters as (graphdef, params, rest) from `nnx.split(model, nnx.Param, ...)`; the loss is a
plug-in `loss_fn(model, micro_batch) -> (sum of per-token losses, metrics)`, so GRPO and plain
cross-entropy share the step. Normalisation: the summed loss of all micro-batches is divided by the
number of valid tokens of the whole step (`batch["loss_mask"].sum()`), never a mean of means.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import precision
from sharding.host_values import place_host_value
from sharding.optim_step import group_norms
from sharding.layout import Layout, as_layout
from sharding.widths import cut_micro_batch, micro_widths, on_host


class TrainState(NamedTuple):
    params: Any  # nnx.State of the trainable parameters
    rest: Any  # non-trainable state (router correction bias)
    opt_state: Any
    step: jax.Array
    skipped: jax.Array  # updates not applied: a non-finite gradient, or no learning signal (`finish`)


def token_cross_entropy(model, batch) -> tuple[jax.Array, dict]:
    """sum over valid tokens of -log p(target): batch has input_ids, targets, loss_mask [mb, S]."""
    logits = model(batch["input_ids"], attention_mask=batch.get("attention_mask"))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * batch["loss_mask"]), {}


def init_state(model, optimizer: optax.GradientTransformation) -> tuple[Any, TrainState]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, TrainState(params, rest, optimizer.init(params), jnp.zeros([], jnp.int32),
                                jnp.zeros([], jnp.int32))


def abstract_state(model, optimizer: optax.GradientTransformation, layout: Layout) -> tuple[Any, TrainState]:
    """`init_state` of a model built by shape (`nnx.eval_shape`), as `jax.ShapeDtypeStruct`s placed where the
    state would be (`state_shardings`; jax's default device without a mesh): a checkpoint's restore target, with
    nothing computed or held."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = jax.eval_shape(lambda p, r: init_state(nnx.merge(graphdef, p, r), optimizer)[1], params, rest)
    if layout.mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)
    return graphdef, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                                  state_shardings(layout, state))


def _logical_shardings(layout: Layout, state_tree):
    """NamedShardings for an nnx.State from each Variable's `logical_axes` metadata, one name per dimension
    (`nnx.Param(value, logical_axes=("embed", "mlp"))`); a variable without it that is not a parameter (an RNG
    state, a batch statistic) is replicated."""
    def placed(path, v):
        axes = v.get_metadata().get("logical_axes")
        where = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        shape = getattr(v.get_value(), "shape", None)  # None: a tree of shardings already (step_copy_shardings)
        if axes is None:
            if isinstance(v, nnx.Param):  # a bare KeyError('logical_axes') named no variable
                raise ValueError(f"parameter {where} {type(v).__name__}{tuple(shape or ())} has no logical_axes: "
                                 "declare it nnx.Param(value, logical_axes=(name per dimension, ...)) with names of "
                                 "the rules table (sharding/rules.py, MeshConfig.extra_rules)")
            return v.replace(layout.replicated())
        if shape is not None and len(axes) != len(shape):  # jax took a short spec as replicated trailing dimensions
            raise ValueError(f"{where} of shape {tuple(shape)} names {len(axes)} logical axes {tuple(axes)}: "
                             "expected one per dimension (None = replicated)")
        return v.replace(layout.sharding(axes))
    return jax.tree_util.tree_map_with_path(placed, state_tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(layout, state: TrainState) -> TrainState:
    """Shardings for a (possibly abstract) TrainState on a layout (or a Mesh with the default rules):
    params and every param-shaped optimizer subtree (master, remainder, moments) follow the params'
    logical axes; scalars are replicated."""
    layout = as_layout(layout)
    param_sh = _logical_shardings(layout, state.params)
    replicated = layout.replicated()
    pdef = jax.tree.structure(state.params)
    is_params = lambda x: jax.tree.structure(x) == pdef  # noqa: E731
    opt_sh = jax.tree.map(lambda x: param_sh if is_params(x) else replicated, state.opt_state, is_leaf=is_params)
    return TrainState(param_sh, _logical_shardings(layout, state.rest), opt_sh, replicated, replicated)


def step_copy_shardings(layout, params):
    """Shardings of a step's copy of `params` (an nnx.State, or its tree of shardings): each weight as
    `Layout.step_copy` places it, i.e. still cut over the FSDP axes a micro-batch gathers over, whole over
    `fsdp_step_axes`; None when the layout makes no copy."""
    copy = as_layout(layout).step_copy()
    return None if copy is None else _logical_shardings(copy, params)


def step_copier(copy_shardings) -> Callable:
    """copy(params) -> the step's copy of `params` (`step_copy_shardings`), gathered by one jitted program (made
    here, once); the identity when there is no copy. Traced inside a step, use a sharding constraint instead."""
    if copy_shardings is None:
        return lambda params: params
    return jax.jit(lambda params: params, out_shardings=copy_shardings)


def batch_sharding(layout) -> NamedSharding:
    """[micro-batches, batch, seq] with batch on the token-batch axes and seq on context."""
    layout = as_layout(layout)
    return NamedSharding(layout.mesh, P(None, *layout.spec(("act_batch", "act_seq"))))


def valid_tokens(batch: dict) -> jax.Array:
    return jnp.sum(batch["loss_mask"]).astype(jnp.float32)


def make_train_step(graphdef, optimizer: optax.GradientTransformation,
                    loss_fn: Callable = token_cross_entropy, *, normalizer: Callable = valid_tokens, mesh=None,
                    shardings: TrainState | None = None, donate: bool = True,
                    widths: Sequence[int] = ()) -> Callable:
    """step(state, batch) -> (state, metrics); batch arrays are [num_micro_batches, micro_batch, ...].

    normalizer(batch) is the whole step's denominator (default: its valid-token count). The loss's
    metrics must be sums; they are summed over micro-batches and returned under metrics["sums"].
    An update is held (weights and optimizer state kept) when its gradient is not finite (metrics["skipped"])
    or it has no learning signal (metrics["empty"]: its batch's loss_mask sums to 0, or its gradient is exactly 0
    though tokens carry loss, and so is the indexer's own when it has one).
    mesh: the run's layout (`sharding.mesh.build_mesh`; a bare Mesh takes the default rules) or None for
    one device; the step is traced and run under its mesh.
    widths: token positions a micro-batch may be cut to (`sharding.widths`); each micro-batch then runs at the
    smallest that holds its rows' real tokens (batch["attention_mask"]), one jitted micro-step per width and
    one jitted optimizer update; () = one program that scans every micro-batch at the batch's width.
    """
    layout = as_layout(mesh)
    mesh = layout.mesh
    # a layout with `fsdp_step_axes`: every micro-batch reads one copy of the weights gathered over those axes at
    # the start of the step, and its gradient is reduced back onto the state's shards (`step_copy_shardings`)
    copy_sh = None if shardings is None else step_copy_shardings(layout, shardings.params)

    def grads_of(params, rest, mb):
        def f(p):
            return loss_fn(nnx.merge(graphdef, p, rest), mb)

        (loss_sum, sums), grads = jax.value_and_grad(f, has_aux=True)(params)
        return (jax.tree.map(lambda g: g.astype(jnp.float32), grads), loss_sum.astype(jnp.float32),
                jax.tree.map(lambda x: x.astype(jnp.float32), sums))

    def add(carry, mb_out):
        return jax.tree.map(jnp.add, carry, mb_out)

    def finish(state: TrainState, carry, total, tokens):
        """The optimizer update from the summed gradients, loss and metric sums of the step's micro-batches."""
        grads, loss_sum, sums = carry
        loss = loss_sum / total
        # grad_norm: the norm the optimizer clips the policy by; the parameters it clips apart (no LM
        # gradient: the indexer's alignment loss) report theirs as grad_norm_apart
        grad_norm, apart = group_norms(jax.tree.map(lambda g: g / total, grads), getattr(optimizer, "clip_mask", None))
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        if apart is not None:
            finite &= jnp.isfinite(apart)
        # No learning signal: no token carries loss (every row at loss weight 0: groups dynamic sampling filled in,
        # overlong rows filtered), or the gradient is exactly 0 though some do (every group's rewards equal, so every
        # advantage 0, with no KL or entropy term). Adam's momentum and the weight decay would still move the weights
        # (77 % of the step before's change, an audit's run; m / sqrt(v) after a zero gradient is 0.9 / sqrt(0.999)
        # of the step before's: the demo, saturated, lost half its reward over such steps in a soak run). Held like a
        # non-finite update: weights and optimizer state kept, counted in `skipped` so the schedule waits for it too.
        still = grad_norm == 0
        if apart is not None:  # the indexer's own loss still has a gradient to apply
            still &= apart == 0
        empty = finite & ((tokens == 0) | still)
        apply = finite & ~empty
        if hasattr(optimizer, "step"):  # in place, layer slice by layer slice (sharding.optim_step)
            params, opt_state = optimizer.step(grads, total, state.opt_state, state.params, apply)
            held = (~apply).astype(jnp.int32)
            out = TrainState(params, state.rest, opt_state, state.step + 1, state.skipped + held)
        else:
            grads = jax.tree.map(lambda g: g / total, grads)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = precision.apply(state.params, updates, opt_state)
            new = TrainState(params, state.rest, opt_state, state.step + 1, state.skipped)
            skipped = TrainState(state.params, state.rest, state.opt_state, state.step + 1, state.skipped + 1)
            out = jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, skipped)
        return out, {"loss": loss, "grad_norm": grad_norm, "skipped": ~finite, "empty": empty, "tokens": tokens,
                     "sums": sums, **({} if apart is None else {"grad_norm_apart": apart})}

    def step(state: TrainState, batch: dict):
        total = jnp.maximum(normalizer(batch), 1.0)
        params = state.params if copy_sh is None else jax.lax.with_sharding_constraint(state.params, copy_sh)

        def micro(carry, mb):
            carry = add(carry, grads_of(params, state.rest, mb))
            if copy_sh is not None:  # the sum stays on the state's shards, not the copy's
                carry = (jax.lax.with_sharding_constraint(carry[0], shardings.params), *carry[1:])
            return carry, None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        if copy_sh is not None:
            zeros = jax.lax.with_sharding_constraint(zeros, shardings.params)
        first = jax.tree.map(lambda x: x[0], batch)
        sums_shape = jax.eval_shape(lambda: loss_fn(nnx.merge(graphdef, state.params, state.rest), first)[1])
        sums0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), sums_shape)
        carry, _ = jax.lax.scan(micro, (zeros, jnp.zeros([], jnp.float32), sums0), batch)
        return finish(state, carry, total, valid_tokens(batch))

    donated = (0,) if donate else ()
    if widths:
        return _cut_step(grads_of, add, finish, normalizer, layout, shardings, tuple(widths), donated,
                         step_copier(copy_sh))
    if mesh is None:
        return jax.jit(step, donate_argnums=donated)
    jitted = jax.jit(step, in_shardings=(shardings, None),
                     out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=donated)
    per_rank = batch_sharding(layout).spec

    def run(state, batch):
        _check_batch(layout, batch)
        # Leaves of rank 2 ([micro, batch], e.g. advantages) take the batch part of the layout only.
        batch = {k: place_host_value(v, NamedSharding(mesh, P(*per_rank[:np.ndim(v)]))) for k, v in batch.items()}
        with jax.set_mesh(mesh):
            return jitted(state, batch)

    run.jitted = jitted
    return run


def _check_batch(layout: Layout, batch: dict) -> None:
    """One error naming the mesh axes a [micro-batches, rows, positions] batch does not divide (`batch_problem`)."""
    if "input_ids" not in batch:
        return
    shape = np.shape(batch["input_ids"])
    if problem := layout.batch_problem(shape[1], shape[2] if len(shape) > 2 else None):
        raise ValueError(f"train step batch: {problem}")


def _cut_step(grads_of, add, finish, normalizer, layout: Layout, shardings, widths, donated,
              copy: Callable = lambda params: params) -> Callable:
    """The step with each micro-batch cut to its width (`make_train_step(widths=...)`): a jitted micro-step per
    width adds the micro-batch's gradient to the carry, then one jitted update. The micro-steps run one
    micro-batch at a time, so a step's mix of widths never makes a new program; the carry starts from zeros
    (shapes from one trace of the first micro-batch, kept), so each width is one program. `copy` makes the step's
    copy of the weights that the micro-steps read (`step_copier`)."""
    mesh = layout.mesh
    replicated = None if mesh is None else NamedSharding(mesh, P())
    carry_sh = None if mesh is None else (shardings.params, replicated, replicated)
    more = jax.jit(lambda params, rest, carry, mb: add(carry, grads_of(params, rest, mb)),
                   out_shardings=carry_sh, donate_argnums=(2,))
    update = jax.jit(finish, donate_argnums=donated) if mesh is None else jax.jit(
        finish, in_shardings=(shardings, carry_sh, None, None), out_shardings=(shardings, replicated),
        donate_argnums=donated)
    per_rank = batch_sharding(layout).spec[1:] if mesh is not None else None
    zeros = {}  # "fn": the jitted zero carry, made at the first call

    def place(mb):
        if mesh is None:
            return mb
        return {k: place_host_value(v, NamedSharding(mesh, P(*per_rank[:np.ndim(v)]))) for k, v in mb.items()}

    def run(state, batch):
        if mesh is not None:
            _check_batch(layout, batch)
        total = jnp.maximum(normalizer(batch), 1.0)
        tokens = valid_tokens(batch)
        batch = {k: on_host(v) for k, v in batch.items()}
        cut = micro_widths(np.asarray(batch["attention_mask"]), widths)
        with contextlib.ExitStack() as stack:
            if mesh is not None:
                stack.enter_context(jax.set_mesh(mesh))
            mbs = [place(cut_micro_batch(batch, m, width)) for m, width in enumerate(cut)]
            if "fn" not in zeros:
                shapes = jax.eval_shape(grads_of, state.params, state.rest, mbs[0])
                zeros["fn"] = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                                      out_shardings=carry_sh)
            carry = zeros["fn"]()
            params = copy(state.params)  # the step's copy (`step_copier`): state.params when there is none
            for mb in mbs:
                carry = more(params, state.rest, carry, mb)
            del params  # freed before the update, whose peak it would raise
            return update(state, carry, total, tokens)

    run.widths = widths
    return run
