"""M3ForCausalLM's inputs checked at the call (m3jax.model.inputs): an audit found a token id past the vocabulary
made its row NaN, -1 silently took the last row's embedding, replayed routes with another k ran another model, a
negative decode position wrote the cache's last slot, and wrong shapes failed deep inside jax naming nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax import tiny
from m3jax.model.decoder import M3ForCausalLM

CFG = tiny.m3_config(vocab_size=64, index_block_size=4, index_topk_blocks=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model():
    return M3ForCausalLM(CFG, rngs=nnx.Rngs(0))


def ids(b=2, s=12):
    return jnp.asarray(tiny.random_ids(CFG, b, s, seed=1))


@pytest.mark.parametrize("bad, said", [
    (64, r"input_ids hold token id 64: expected ids in \[0, 64\) \(vocab_size\)"),
    (-1, r"input_ids hold token id -1"),
])
def test_a_token_id_outside_the_vocabulary_is_refused(model, bad, said):
    with pytest.raises(ValueError, match=said):
        model(ids().at[0, 5].set(bad))


@pytest.mark.parametrize("make, said", [
    (lambda x: x[0], r"input_ids \(12,\): expected a \[B, S\] integer array"),
    (lambda x: x[:0], r"input_ids \(0, 12\)"),
    (lambda x: x.astype(jnp.float32), r"input_ids of dtype float32: expected integers"),
])
def test_input_ids_of_another_shape_or_type_are_refused(model, make, said):
    with pytest.raises(ValueError, match=said):
        model(make(ids()))


@pytest.mark.parametrize("kw, said", [  # made in the test: no array at collection
    (lambda: dict(attention_mask=jnp.ones((2, 11))), r"attention_mask \(2, 11\): expected \[B, S\] = \[2, 12\]"),
    (lambda: dict(positions=jnp.ones((2, 11), jnp.int32)), r"positions \(2, 11\): expected \[B, S\] = \[2, 12\]"),
    (lambda: dict(positions=jnp.ones((2, 12)) * 0.5), r"positions of dtype float32: expected integers"),
])
def test_a_mask_or_positions_of_another_shape_or_type_are_refused(model, kw, said):
    with pytest.raises(ValueError, match=said):
        model(ids(), **kw())


def test_replayed_routes_are_checked_before_the_layers(model):
    logits, routes = model(ids(), return_routes=True)
    np.testing.assert_array_equal(np.asarray(model(ids(), routes=routes)), np.asarray(logits))  # still replays
    for bad in (routes[..., :1], routes[:, :10], routes[:, :, :0]):
        with pytest.raises(ValueError, match=r"routes .*: expected \[B, S, MoE layers, num_experts_per_tok\] = "
                                             rf"\[2, 12, {routes.shape[2]}, {CFG.num_experts_per_tok}\]"):
            model(ids(), routes=bad)
    with pytest.raises(ValueError, match=rf"routes hold expert ids 0..99: expected ids in \[0, {CFG.num_local_experts}"):
        model(ids(), routes=routes.at[0, 0, 0, 0].set(99))


def test_a_decode_call_is_checked_against_its_cache(model):
    x = ids()
    cache = model.init_cache(2, 16)
    _, cache = model(x, positions=jnp.broadcast_to(jnp.arange(12), (2, 12)), cache=cache)
    with pytest.raises(ValueError, match=r"decode position -1: expected positions in \[0, 16\)"):
        model(x[:, :1], positions=jnp.full((2, 1), -1), cache=cache)
    with pytest.raises(ValueError, match=r"a decode cache of 2 rows \(init_cache's batch\) for input_ids of 1 rows"):
        model(x[:1, :1], positions=jnp.full((1, 1), 12), cache=cache)
    with pytest.raises(ValueError, match=r"attention_mask \(2, 12\): expected \[B, max_len\] = \[2, 16\]"):
        model(x[:, :1], positions=jnp.full((2, 1), 12), attention_mask=jnp.ones((2, 12)), cache=cache)
    # traced, a negative position cannot be refused: its logits are NaN, as past the cache
    step = jax.jit(lambda p, c: model(x[:, :1], positions=p, cache=c)[0])
    assert np.isnan(np.asarray(step(jnp.full((2, 1), -1), cache))).all()
