"""model.moe_capacity_factor drops what overflows a device's expert receive buffer, and nothing else decides what
is dropped: padding takes no capacity, one device bounds its buffer as a mesh without expert parallelism does, and
a decode step drops nothing (found by an audit, session 51; each test fails on the code before it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax import tiny
from m3jax.model.decoder import M3ForCausalLM
from m3jax.model.moe import moe_block
from sharding.layout import Layout
from sharding.mesh import MeshConfig, build_mesh
from tests.test_expert_parallel import CFG, D, params

# Even rows: 4 real tokens then padding; odd rows: all real. 16 rows: two a device on 8 devices, where the first
# one's padding sorts before the second's tokens.
VALID = np.ones((16, 16), bool)
VALID[::2, 4:] = False


def moe(layout, x, cf, exchange=None, valid=VALID):
    """moe_block's output (the layout alone decides the program, as in tests/test_expert_parallel.py)."""
    return np.asarray(jax.jit(lambda p, x: moe_block(p, x, CFG, layout, cf, exchange, token_valid=valid))(
        params(), x))


# Each case's factor is one at which the code before moved real tokens' outputs (checked: on one device the
# boundary falls inside an expert whose rows the padding's choices shift at 0.7, not at 0.3, 0.5 or 0.9).
@pytest.mark.parametrize("shape, exchange, cf", [(None, None, 0.7), ((1, 1, 8, 1), "padded", 0.5),
                                                 ((1, 1, 8, 1), "ragged_emulated", 0.5), ((2, 1, 4, 1), "padded", 0.5)],
                         ids=["one-device", "ep8-padded", "ep8-ragged", "dp2-ep4-padded"])
def test_padding_takes_no_capacity(shape, exchange, cf):
    """What sits in the padding must not change a real token's output once experts overflow (it did, by up to 9.9
    here and 0.21 in a model's logits: a row's padding took slots ahead of the next row's tokens)."""
    layout = Layout() if shape is None else build_mesh(MeshConfig(*shape), CFG)
    x = jax.random.normal(jax.random.key(1), (16, 16, D))
    other = jnp.where(VALID[..., None], x, jax.random.normal(jax.random.key(2), x.shape))
    got, moved = moe(layout, x, cf, exchange), moe(layout, other, cf, exchange)
    np.testing.assert_array_equal(moved[VALID], got[VALID])
    # the code before, which routed padding like tokens: the real tokens' outputs moved
    before, moved_before = (moe(layout, a, cf, exchange, valid=None)[VALID] for a in (x, other))
    assert not np.allclose(before, moved_before, atol=1e-3)


@pytest.mark.parametrize("shape, exchange", [(None, None), ((1, 1, 8, 1), "padded"), ((1, 1, 8, 1), "ragged_emulated"),
                                            ((2, 1, 4, 1), "padded")],
                         ids=["one-device", "ep8-padded", "ep8-ragged", "dp2-ep4-padded"])
def test_padding_does_not_enlarge_the_capacity(shape, exchange):
    """The same rows at width 16 (half padding) and cut to width 8 (what grpo.micro_batch_widths does, whose cut
    changes no value): their real tokens' outputs agree. The capacity followed the T tokens of the buffer, padding
    included, so the padded batch was nearly dropless where the cut one dropped (log-probs 0.18 apart, an audit)."""
    layout = Layout() if shape is None else build_mesh(MeshConfig(*shape), CFG)
    valid = np.zeros((16, 16), bool)
    valid[:, :8] = np.arange(8)[None, :] < (4 + np.arange(16) % 5)[:, None]  # 4 to 8 real tokens a row
    x = jax.random.normal(jax.random.key(4), (16, 16, D))
    wide, cut = moe(layout, x, 0.5, exchange, valid), moe(layout, x[:, :8], 0.5, exchange, valid[:, :8])
    np.testing.assert_allclose(wide[:, :8][valid[:, :8]], cut[valid[:, :8]], rtol=0,
                               atol=1e-6 * np.abs(cut).max())
    assert not np.allclose(cut[valid[:, :8]], moe(layout, x[:, :8], None, exchange, valid[:, :8])[valid[:, :8]],
                           atol=1e-3)  # the factor drops pairs here


def test_one_device_bounds_its_buffer_as_a_mesh_without_expert_parallelism():
    """One device used to ignore the setting (dropless) where 8 data-parallel devices applied it: the same run
    config trained another model on one device. Each device of (8, 1, 1, 1) without expert axes routes one row;
    one device given that row alone drops the same pairs."""
    x = jax.random.normal(jax.random.key(3), (8, 16, D))
    everywhere = np.ones((8, 16), bool)
    mesh = moe(build_mesh(MeshConfig(8, 1, 1, 1, expert_axes=()), CFG), x, 0.5, "padded", everywhere)
    rows = np.concatenate([moe(Layout(), x[i:i + 1], 0.5, None, everywhere[i:i + 1]) for i in range(8)])
    np.testing.assert_allclose(rows, mesh, rtol=0, atol=1e-6 * np.abs(mesh).max())
    assert not np.allclose(rows, moe(Layout(), x, None, None, everywhere), atol=1e-3)


# A tiny model of two full-attention MoE layers (a random router, no hot expert).
MODEL_CFG = tiny.m3_config(layers=2, full_attention_layers=2, dense_layers=0, vocab_size=64, hidden_size=32,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=16, intermediate_size=16)


def test_a_decode_step_drops_nothing():
    """A decode step has one token per row, so a cap on it is another bound than the training forward's
    (rollout logprobs were 0.2 off the full forward's on (1, 1, 8, 1)); it decodes as the dropless model."""
    tokens = jax.random.randint(jax.random.key(4), (8, 6), 3, 64)

    def decode(cf):
        model = M3ForCausalLM(MODEL_CFG, rngs=nnx.Rngs(0), moe_capacity_factor=cf)
        cache, out = model.init_cache(8, 8), []
        for i in range(tokens.shape[1]):
            logits, cache = model(tokens[:, i:i + 1], positions=jnp.full((8, 1), i), cache=cache)
            out.append(np.asarray(logits))
        return np.concatenate(out, 1), model

    capped, model = decode(0.25)
    dropless, _ = decode(None)
    np.testing.assert_array_equal(capped, dropless)
    # the same model drops on the whole sequence: the cap is real there
    assert not np.allclose(np.asarray(model(tokens)), dropless, atol=1e-4)


@pytest.mark.parametrize("cf", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_nonsense_capacity_factors_are_refused(cf):
    with pytest.raises(ValueError, match="moe_capacity_factor"):
        M3ForCausalLM(MODEL_CFG, rngs=nnx.Rngs(0), moe_capacity_factor=cf)


def test_a_models_padding_takes_no_capacity_on_an_expert_parallel_mesh():
    """The model passes its attention mask to the MoE layers (the audit's case: the real tokens' logits moved by
    0.21 when only the padding's ids changed, on (1, 1, 8, 1) with cf 1.0 and a hot expert; 0.5 here)."""
    layout = build_mesh(MeshConfig(1, 1, 8, 1), MODEL_CFG)
    model = M3ForCausalLM(MODEL_CFG, rngs=nnx.Rngs(0), moe_capacity_factor=0.5, layout=layout)
    ids = jax.random.randint(jax.random.key(5), VALID.shape, 3, 64)
    other = jnp.where(VALID, ids, jax.random.randint(jax.random.key(6), ids.shape, 3, 64))
    with jax.set_mesh(layout.mesh):
        got, moved = (np.asarray(model(i, attention_mask=jnp.asarray(VALID))) for i in (ids, other))
    np.testing.assert_array_equal(moved[VALID], got[VALID])
