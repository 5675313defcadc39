"""A jitted, sharded training step: micro-batch accumulation, global-token normalisation, clipping
(inside the optimizer), non-finite skip, explicit shardings and donation.

The model enters as (graphdef, params, rest) from `nnx.split(model, nnx.Param, ...)`; the loss is a
plug-in `loss_fn(model, micro_batch) -> (sum of per-token losses, metrics)`, so GRPO and plain
cross-entropy share the step. Normalisation: the summed loss of all micro-batches is divided by the
number of valid tokens of the whole step (`batch["loss_mask"].sum()`), never a mean of means.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import precision
from sharding.optim_step import group_norms
from sharding.layout import Layout, as_layout


class TrainState(NamedTuple):
    params: Any  # nnx.State of the trainable parameters
    rest: Any  # non-trainable state (router correction bias)
    opt_state: Any
    step: jax.Array
    skipped: jax.Array  # steps skipped for non-finite gradients


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


def _logical_shardings(layout: Layout, state_tree):
    """NamedShardings for an nnx.State from each Variable's `logical_axes` metadata."""
    return jax.tree.map(lambda v: v.replace(layout.sharding(v.get_metadata()["logical_axes"])),
                        state_tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


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


def batch_sharding(layout) -> NamedSharding:
    """[micro-batches, batch, seq] with batch on the token-batch axes and seq on context."""
    layout = as_layout(layout)
    return NamedSharding(layout.mesh, P(None, *layout.spec(("act_batch", "act_seq"))))


def valid_tokens(batch: dict) -> jax.Array:
    return jnp.sum(batch["loss_mask"]).astype(jnp.float32)


def make_train_step(graphdef, optimizer: optax.GradientTransformation,
                    loss_fn: Callable = token_cross_entropy, *, normalizer: Callable = valid_tokens, mesh=None,
                    shardings: TrainState | None = None, donate: bool = True) -> Callable:
    """step(state, batch) -> (state, metrics); batch arrays are [num_micro_batches, micro_batch, ...].

    normalizer(batch) is the whole step's denominator (default: its valid-token count). The loss's
    metrics must be sums; they are summed over micro-batches and returned under metrics["sums"].
    mesh: the run's layout (`sharding.mesh.build_mesh`; a bare Mesh takes the default rules) or None for
    one device; the step is traced and run under its mesh.
    """
    layout = as_layout(mesh)
    mesh = layout.mesh

    def step(state: TrainState, batch: dict):
        total = jnp.maximum(normalizer(batch), 1.0)

        def micro(carry, mb):
            grad_acc, loss_acc, sums_acc = carry

            def f(params):
                return loss_fn(nnx.merge(graphdef, params, state.rest), mb)

            (loss_sum, sums), grads = jax.value_and_grad(f, has_aux=True)(state.params)
            grad_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_acc, grads)
            sums_acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), sums_acc, sums)
            return (grad_acc, loss_acc + loss_sum.astype(jnp.float32), sums_acc), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        first = jax.tree.map(lambda x: x[0], batch)
        sums_shape = jax.eval_shape(lambda: loss_fn(nnx.merge(graphdef, state.params, state.rest), first)[1])
        sums0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), sums_shape)
        (grads, loss_sum, sums), _ = jax.lax.scan(micro, (zeros, jnp.zeros([], jnp.float32), sums0), batch)
        loss = loss_sum / total
        # grad_norm: the norm the optimizer clips the policy by; the parameters it clips apart (no LM
        # gradient: the indexer's alignment loss) report theirs as grad_norm_apart
        grad_norm, apart = group_norms(jax.tree.map(lambda g: g / total, grads), getattr(optimizer, "clip_mask", None))
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        if apart is not None:
            finite &= jnp.isfinite(apart)
        if hasattr(optimizer, "step"):  # in place, layer slice by layer slice (sharding.optim_step)
            params, opt_state = optimizer.step(grads, total, state.opt_state, state.params, finite)
            out = TrainState(params, state.rest, opt_state, state.step + 1, state.skipped + (~finite).astype(jnp.int32))
        else:
            grads = jax.tree.map(lambda g: g / total, grads)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = precision.apply(state.params, updates, opt_state)
            new = TrainState(params, state.rest, opt_state, state.step + 1, state.skipped)
            skipped = TrainState(state.params, state.rest, state.opt_state, state.step + 1, state.skipped + 1)
            out = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, skipped)
        return out, {"loss": loss, "grad_norm": grad_norm, "skipped": ~finite, "tokens": valid_tokens(batch),
                     "sums": sums, **({} if apart is None else {"grad_norm_apart": apart})}

    if mesh is None:
        return jax.jit(step, donate_argnums=(0,) if donate else ())
    jitted = jax.jit(step, in_shardings=(shardings, None),
                     out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=(0,) if donate else ())
    per_rank = batch_sharding(layout).spec

    def run(state, batch):
        # Leaves of rank 2 ([micro, batch], e.g. advantages) take the batch part of the layout only.
        batch = {k: jax.device_put(v, NamedSharding(mesh, P(*per_rank[:np.ndim(v)]))) for k, v in batch.items()}
        with jax.set_mesh(mesh):
            return jitted(state, batch)

    run.jitted = jitted
    return run

