"""Weight decay leaves alone the parameters the LM loss gives no gradient (the indexer), and clipping takes
their norm apart from the policy's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from m3jax import tiny
from m3jax.model.specs import weight_decay_mask
from sharding import optim_step
from sharding.train_step import init_state, make_train_step, token_cross_entropy

LR, WD = 1e-2, 0.1


def is_indexer(path) -> bool:
    return "index_" in jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def steps():
    """One train step of a tiny model with sparse layers, with the model's decay mask and without one."""
    cfg = tiny.m3_config(layers=2)
    assert cfg.has_sparse_attention
    model = tiny.m3_model(cfg, seed=0)
    ids = tiny.random_ids(cfg, 2, 33, seed=1)
    batch = {"input_ids": jnp.asarray(ids[None, :, :-1]), "targets": jnp.asarray(ids[None, :, 1:]),
             "loss_mask": jnp.ones((1, 2, 32), jnp.float32)}
    out = {}
    for name, mask in (("masked", weight_decay_mask(cfg, nnx.state(model, nnx.Param))), ("unmasked", None)):
        opt = optim_step.adamw(LR, weight_decay=WD, master="none", decay_mask=mask)
        graphdef, state = init_state(model, opt)
        new, metrics = make_train_step(graphdef, opt, donate=False)(state, batch)
        assert not bool(metrics["skipped"])
        out[name] = (state.params, new.params)
    # jitted: eagerly, every op of the backward compiles on its own (~10 s)
    grads = nnx.jit(nnx.grad(lambda m, b: token_cross_entropy(m, b)[0]))(model, {k: v[0] for k, v in batch.items()})
    return out, nnx.state(grads, nnx.Param)


@pytest.mark.extended  # the default run checks it through the GRPO train step with weight decay:
# tests/test_indexer_align.py::test_alignment_loss_leaves_the_policy_step_bitwise_unchanged
@pytest.mark.slow  # two train-step compiles and an eager gradient; the fast loop checks the mask in
# tests/test_train_step.py's sliced-vs-whole test and the unit tests below
def test_the_indexer_has_no_lm_gradient(steps):
    _, grads = steps
    flat = jax.tree_util.tree_leaves_with_path(grads)
    assert any(is_indexer(p) for p, _ in flat)
    for path, g in flat:
        assert np.any(np.asarray(g)) != is_indexer(path), jax.tree_util.keystr(path)


@pytest.mark.extended  # the default run checks it through the GRPO train step with weight decay:
# tests/test_indexer_align.py::test_alignment_loss_leaves_the_policy_step_bitwise_unchanged
@pytest.mark.slow  # two train-step compiles and an eager gradient; the fast loop checks the mask in
# tests/test_train_step.py's sliced-vs-whole test and the unit tests below
def test_indexer_is_bitwise_unchanged_by_a_decayed_step_and_the_rest_decays_as_before(steps):
    out, _ = steps
    (before, masked), (_, unmasked) = out["masked"], out["unmasked"]
    leaves = zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(masked), jax.tree.leaves(unmasked))
    for (path, p0), pm, pu in leaves:
        p0, pm, pu = (np.asarray(x) for x in (p0, pm, pu))
        if is_indexer(path):
            np.testing.assert_array_equal(pm, p0)
            # without the mask, decay alone moves it: Adam's update of a zero gradient is zero
            np.testing.assert_allclose(pu, p0 - LR * WD * p0, rtol=1e-6, atol=1e-12)
            assert not np.array_equal(pu, p0) or not p0.any()
        else:  # every other parameter takes the same step either way
            np.testing.assert_array_equal(pm, pu)


def test_mask_must_match_the_parameters():
    opt = optim_step.adamw(LR, weight_decay=WD, decay_mask={"a": True})
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    with pytest.raises(ValueError, match="1 leaves for 2 parameters"):
        opt.update(params, opt.init(params), params)


def test_all_true_mask_is_optax_add_decayed_weights():
    params = {"a": jnp.arange(3.0), "b": jnp.full((2, 2), -1.5)}
    updates = {"a": jnp.ones(3), "b": jnp.full((2, 2), 0.25)}
    want, _ = optax.add_decayed_weights(WD).update(updates, optax.EmptyState(), params)
    got, state = optim_step.decayed_weights(WD).update(updates, optax.EmptyState(), params)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert state == optax.EmptyState()
    got, _ = optim_step.decayed_weights(WD, {"a": False, "b": True}).update(updates, optax.EmptyState(), params)
    np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(updates["a"]))
    np.testing.assert_array_equal(np.asarray(got["b"]), np.asarray(want["b"]))


def test_clip_groups_are_optax_global_norm_clips_of_each_group():
    """clip_by_group_norms: the leaves where the mask is False are clipped by their own global norm, the
    others by theirs, each exactly as optax.clip_by_global_norm clips a tree; one group is optax's own."""
    updates = {"a": jnp.full(3, 2.0), "b": jnp.full((2, 2), -1.5), "idx": jnp.arange(4.0)}
    mask = {"a": True, "b": True, "idx": False}
    got, state = optim_step.clip_by_group_norms(1.0, mask).update(updates, optax.EmptyState())
    policy, _ = optax.clip_by_global_norm(1.0).update({"a": updates["a"], "b": updates["b"]}, optax.EmptyState())
    indexer, _ = optax.clip_by_global_norm(1.0).update({"idx": updates["idx"]}, optax.EmptyState())
    for name, want in (*policy.items(), *indexer.items()):
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want), err_msg=name)
    assert state == optax.EmptyState()
    # the policy's leaves do not see the indexer's norm (which one global norm would fold in)
    together, _ = optax.clip_by_global_norm(1.0).update(updates, optax.EmptyState())
    assert not np.array_equal(np.asarray(got["a"]), np.asarray(together["a"]))
    main, apart = optim_step.group_norms(updates, mask)
    np.testing.assert_allclose([float(main), float(apart)], [np.sqrt(12 + 9), np.sqrt(14)], rtol=1e-6)
    assert optim_step.group_norms(updates, None)[1] is None
    assert isinstance(optim_step.clip_by_group_norms(1.0, {"a": True, "b": True}), type(optax.clip_by_global_norm(1.0)))
