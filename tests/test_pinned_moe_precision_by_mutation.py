"""MoE and optimizer-precision code a mutation audit changed without any test failing (session 55): the decoupled
weight decay's place in AdamW, the fp32 master's update, the router's fp32 logits, the static capacity's rounding,
the combine's fp32 product, the params a master implies. Each test names the slip it catches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest


@pytest.mark.parametrize("master", ["none", "fp32", "compact"])
def test_adamw_is_optax_adamw_on_the_master(master):
    """20 steps at lr 1e-2, weight decay 0.1: the master (fp32 params for "none") follows optax.adamw in fp32 to
    ~1 ulp. Decay before Adam (L2 through Adam's root: 0.044 off) and decay of the bf16 param instead of the master
    (6.4e-5 off) both passed every test, the sliced and whole steps sharing the slip."""
    from sharding import optim_step, precision
    init = jnp.asarray(np.random.default_rng(2).normal(size=4096), jnp.bfloat16)
    grads = [jnp.asarray(np.random.default_rng(10 + i).normal(size=4096), jnp.float32) for i in range(20)]
    opt = optim_step.adamw(1e-2, weight_decay=0.1, clip_norm=None, master=master)
    params = {"w": init.astype(jnp.float32) if master == "none" else init}
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update({"w": g}, state, params)
        params = precision.apply(params, updates, state)
    got = np.asarray(precision.master_of(params, state)["w"])
    want, ref = init.astype(jnp.float32), optax.adamw(1e-2, weight_decay=0.1)
    ref_state = ref.init(want)
    for g in grads:
        u, ref_state = ref.update(g, ref_state, want)
        want = optax.apply_updates(want, u)
    np.testing.assert_allclose(got, np.asarray(want), rtol=0, atol=1e-6)


def test_the_router_scores_bf16_activations_in_fp32():
    """bf16 hidden states and an fp32 router choose as the same states in fp32 do (the architecture's fp32 router);
    scored in bf16, 1.5 % of tokens took another expert set."""
    from m3jax.model.moe import route
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(1024, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 512)) / np.sqrt(512), jnp.float32)
    bias = jnp.asarray(rng.normal(size=64) * 0.01, jnp.float32)
    got, want = route(x, w, bias, top_k=4), route(x.astype(jnp.float32), w, bias, top_k=4)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_static_capacity_rounds_up_as_the_dynamic_one_does():
    """cf x rows fractional: 0.75 x 10 assignments = 7.5 -> 8 rows (floor dropped one more assignment, and the
    unpadded batch then disagreed with the padded one, whose dynamic capacity rounds up)."""
    import math

    from sharding import expert
    assert expert.receive_rows(5, 2, 1, 8, 0.75, "padded") == 8
    assert expert.receive_rows(5, 2, 4, 2, 0.75, "padded") == 4 * math.ceil(0.75 * 10 / 4)
    assert int(expert.capped_rows(8, 0.75, jnp.int32(10), 12)) == 8


def test_the_combine_forms_weight_times_output_in_fp32_then_casts():
    """HF's order (m3-architecture.md): fp32 w x out, cast to the activations' dtype, summed per token. The weight
    cast to bf16 first changed 25 % of a bf16 combine's elements."""
    from sharding.expert import combine
    rng = np.random.default_rng(0)
    tokens, k, d = 64, 2, 32
    rows = jnp.asarray(rng.normal(size=(tokens * k, d)) * 3, jnp.bfloat16)
    w = jax.nn.softmax(jnp.asarray(rng.normal(size=(tokens, k)), jnp.float32), -1)
    order = jnp.arange(tokens * k)
    x = jnp.zeros((tokens, d), jnp.bfloat16)
    got = combine(x, rows, w, order, order // k)
    want = x.at[order // k].add((rows.astype(jnp.float32) * w.reshape(-1)[order][:, None]).astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_the_params_a_master_implies_are_its_to_bf16_rounding():
    """`to_bf16`, not a plain cast (round to nearest even): on an exact tie they differ (1.00390625 -> 1.0078125 and
    1.0), and a compact master rebuilt from the other jumped by 0.2 %."""
    from sharding.precision import params_from_master, to_bf16
    master = jnp.asarray([1.00390625, 1.01171875, -1.00390625, 0.3, 2.0 ** -130], jnp.float32)
    like = {"w": jnp.zeros(5, jnp.bfloat16), "router": jnp.zeros(5, jnp.float32)}
    got = params_from_master({"w": master, "router": master}, like)
    np.testing.assert_array_equal(np.asarray(got["w"], np.float32), np.asarray(to_bf16(master), np.float32))
    assert got["router"].dtype == jnp.float32 and np.array_equal(np.asarray(got["router"]), np.asarray(master))
    assert float(to_bf16(master)[0]) != float(master[:1].astype(jnp.bfloat16)[0])  # the case is a tie
