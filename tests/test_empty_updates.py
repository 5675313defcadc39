"""An update none of whose tokens carries loss (every row at loss weight 0: the groups dynamic sampling filled in,
every response cut under grpo.overlong_filter), or whose gradient is exactly 0 (every advantage 0, no KL or entropy
term), is held: its gradient is 0, yet Adam's momentum and the weight decay moved the weights (an audit: 77 % of the
step before's change), while metrics.jsonl read loss 0, grad_norm 0 and skipped_updates 0."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rl.skipped_updates import SkippedUpdates
from sharding import optim_step
from sharding.train_step import init_state, make_train_step, token_cross_entropy

V, D = 16, 8


class Tiny(nnx.Module):
    def __init__(self):
        k1, k2 = jax.random.split(jax.random.key(0))
        self.embed = nnx.Param(0.3 * jax.random.normal(k1, (V, D)), logical_axes=("table_vocab", "embed"))
        self.head = nnx.Param(0.3 * jax.random.normal(k2, (V, D)), logical_axes=("vocab", "embed"))

    def __call__(self, ids, attention_mask=None):
        return self.embed[...][ids] @ self.head[...].T


def batch(weight: float):
    ids = np.random.default_rng(1).integers(0, V, (2, 3, 7))
    return {"input_ids": jnp.asarray(ids[..., :-1]), "targets": jnp.asarray(ids[..., 1:]),
            "loss_mask": jnp.full((2, 3, 6), weight, jnp.float32)}


OPTIMIZERS = {  # sharding.optim_step's in-place `step`, and a plain optax optimizer (the other branch)
    "optim_step": lambda: optim_step.adamw(1e-2, weight_decay=0.1, master="none"),
    "optax": lambda: optax.adamw(1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_an_update_without_loss_tokens_keeps_the_weights_and_the_optimizer_state(kind):
    opt = OPTIMIZERS[kind]()
    graphdef, state = init_state(Tiny(), opt)
    step = make_train_step(graphdef, opt, donate=False)
    state, m = step(state, batch(1.0))
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state, m = step(state, batch(0.0))
    for a, b in zip(jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert bool(m["empty"]) and not bool(m["skipped"]) and float(m["grad_norm"]) == 0.0
    # counted with the skipped updates, so the learning-rate schedule (rl.policy.applied_learning_rate) waits too
    assert int(state.step) == 2 and int(state.skipped) == 1
    state, m = step(state, batch(1.0))
    assert not bool(m["empty"]) and int(state.skipped) == 1
    assert any(np.any(np.asarray(a) != b) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before[0])))


def zero_advantage_loss(model, mb):
    """Every advantage 0 (a step whose groups all had equal rewards, no KL or entropy term): tokens carry loss, and
    its gradient is exactly 0."""
    loss, sums = token_cross_entropy(model, mb)
    return 0.0 * loss, sums


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_an_update_whose_gradient_is_zero_keeps_the_weights_and_the_optimizer_state(kind):
    """A soak run of the demo: once its groups all had equal rewards, the updates with a zero gradient went on moving
    the weights by Adam's momentum, and its reward fell from 1.0 to 0.5."""
    opt = OPTIMIZERS[kind]()
    graphdef, state = init_state(Tiny(), opt)
    learn, no_signal = (make_train_step(graphdef, opt, loss, donate=False)
                        for loss in (token_cross_entropy, zero_advantage_loss))
    state, _ = learn(state, batch(1.0))
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state, m = no_signal(state, batch(1.0))
    for a, b in zip(jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert bool(m["empty"]) and float(m["tokens"]) == 36.0 and float(m["grad_norm"]) == 0.0
    assert int(state.step) == 2 and int(state.skipped) == 1


def test_a_held_update_is_warned_of_and_does_not_count_toward_the_divergence_stop(caplog):
    """Warned at the first step of a run of them, then every 100th (a saturated run holds most of its updates: a
    line each step buried the others), again at the first after a step that trained."""
    watch = SkippedUpdates(limit=2, updates_per_step=1)
    with caplog.at_level(logging.WARNING, logger="rl.trainer"):
        for step in range(1, 202):
            watch.after(step, 0, 0.0, 0.0, empty=1)
        watch.after(202, 0, 0.1, 0.5)
        watch.after(203, 0, 0.0, 0.0, empty=1)
    assert watch.in_a_row == 0
    said = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in said] == ["step 1", "step 100", "step 200", "step 203"]
    assert said[0].startswith("step 1: 1 of 1 update(s) held, with no learning signal (no token of theirs carrying "
                              "loss") and said[0].endswith("the weights did not change")
    assert said[1].endswith("the weights did not change (100 steps in a row; `empty_updates` counts each)")
