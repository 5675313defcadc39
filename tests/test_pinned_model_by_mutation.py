"""Model and train-step behaviour a mutation audit (session 54) found no test pinned, mostly paths the tiny random
models never reach (long positions in bf16, activations past the SwiGLU clamp, a nonzero router bias, a repeated
replayed block, a NaN in the indexer's gradient). Each test fails on its mutant (checked by applying it)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax import tiny


def test_rope_angles_of_a_bf16_model_are_taken_from_fp32_positions():
    """Positions rounded to bf16 moved cos at 4099 from -0.71 to 0.81 (every long sequence's logits wrong)."""
    from m3jax.model.rope import rope_cos_sin
    pos = jnp.array([[0, 100, 257, 1001, 4099]], jnp.int32)
    cos, sin = rope_cos_sin(pos, 64, 5e6, jnp.bfloat16)
    c32, s32 = rope_cos_sin(pos, 64, 5e6, jnp.float32)
    np.testing.assert_allclose(np.asarray(cos, np.float32), np.asarray(c32), atol=1e-2)
    np.testing.assert_allclose(np.asarray(sin, np.float32), np.asarray(s32), atol=1e-2)


def test_swiglu_clamps_the_gate_above_and_up_on_both_sides():
    """swiglu_oai(g, u) = min(g, L) sigmoid(alpha min(g, L)) (clip(u, -L, L) + 1): the tiny models' activations never
    reach L = 7, so no parity test saw the clamp."""
    from m3jax.model.mlp import swiglu_oai
    g, u = np.array([2.0, 7.5, 10.0, 20.0]), np.array([-10.0, -3.0, 0.5, 9.0])
    gc = np.minimum(g, 7.0)
    want = gc / (1 + np.exp(-1.702 * gc)) * (np.clip(u, -7.0, 7.0) + 1)
    np.testing.assert_allclose(np.asarray(swiglu_oai(jnp.asarray(g), jnp.asarray(u), 1.702, 7.0)), want, rtol=1e-5)


def test_the_routed_experts_use_the_configured_swiglu_limit(monkeypatch):
    from m3jax.model import moe
    cfg = tiny.m3_config(layers=2, full_attention_layers=2, dense_layers=1)
    seen = []

    def spy(gate, up, alpha, limit):
        seen.append(limit)
        return gate * up
    monkeypatch.setattr(moe, "swiglu_oai", spy)
    tiny.m3_model(cfg, remat=False)(jnp.asarray(tiny.random_ids(cfg, 1, 8)))
    assert seen and all(float(limit) == cfg.swiglu_limit for limit in seen), (seen, cfg.swiglu_limit)


def test_replaying_own_routes_returns_them_under_a_nonzero_router_bias():
    """The router's own choice under replay is taken with its bias (with a zero bias it differed in 0.91 of the ids:
    route_mismatch_frac read mismatch where there was none); every test model's bias was 0."""
    cfg = tiny.m3_config(layers=2, full_attention_layers=2, dense_layers=1)
    model = tiny.m3_model(cfg, remat=False)
    for stack in model.stacks:
        if hasattr(stack, "router_bias"):
            stack.router_bias.set_value(0.3 * jax.random.normal(jax.random.key(1), stack.router_bias[...].shape))
    ids = jnp.asarray(tiny.random_ids(cfg, 2, 32))
    _, own = model(ids, return_routes=True)
    _, chosen = model(ids, routes=own, return_routes=True)
    np.testing.assert_array_equal(np.asarray(chosen), np.asarray(own))


def test_a_block_a_replay_names_twice_is_read_once():
    from m3jax.model.attention import valid_replay
    ids = jnp.array([[2, 2, 0], [1, 0, 1], [3, 3, 3]], jnp.int32)
    got = np.asarray(valid_replay(ids, 4)).tolist()
    assert got[0] == [2, -1, 0] and got[2] == [3, -1, -1]


def test_a_nan_gradient_of_the_separately_clipped_indexer_skips_the_update():
    from m3jax.model.specs import weight_decay_mask
    from sharding import optim_step
    from sharding.train_step import init_state, make_train_step, token_cross_entropy
    cfg = tiny.m3_config(layers=2, full_attention_layers=1, dense_layers=2)
    model = tiny.m3_model(cfg, remat=False)
    mask = weight_decay_mask(cfg, nnx.state(model, nnx.Param))
    opt = optim_step.adamw(1e-3, clip_norm=1.0, decay_mask=mask, clip_mask=mask)
    graphdef, state = init_state(model, opt)

    def loss_fn(m, mb):  # the LM loss plus a term of value 0 whose gradient (the indexer's only) is NaN
        ce, sums = token_cross_entropy(m, mb)
        return ce + jnp.sum(jnp.sqrt(jnp.abs(m.stacks[1].index_q_proj[...]) * 0.0)), sums
    ids = jnp.asarray(tiny.random_ids(cfg, 2, 17))
    batch = {"input_ids": ids[None, :, :-1], "targets": ids[None, :, 1:], "loss_mask": jnp.ones((1, 2, 16))}
    new, metrics = make_train_step(graphdef, opt, loss_fn, donate=False)(state, batch)
    assert bool(metrics["skipped"]) and np.isfinite(float(metrics["grad_norm"]))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(new.params))


def test_capacity_rows_round_up():
    from sharding.expert import capped_rows
    assert int(capped_rows(128, 1.25, jnp.int32(30), 64)) == 38  # ceil(1.25 * 30)
    assert int(capped_rows(128, 1.5, jnp.int32(45), 64, 2)) == 34


def test_the_legacy_sparse_attention_config_wins_over_flat_fields_as_in_transformers():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    from m3jax.hf_config import fields_from_hf
    raw = tiny.hf_config().to_dict()
    raw["index_n_heads"] = 4
    raw["sparse_attention_config"] = {"sparse_num_index_heads": 2}
    assert fields_from_hf(raw)["index_n_heads"] == MiniMaxM3VLTextConfig(**raw).index_n_heads == 2
