"""Adam's moments stored in bf16 (`precision.moment_dtype: bfloat16`, both M3 recipes): rounded stochastically,
so they follow fp32 Adam's in expectation. Rounded to nearest, nu froze: its decay moves it by 1 - b2 = 0.1 % a
step, below half a bf16 ulp (a helper's audit)."""

import jax
import jax.numpy as jnp
import numpy as np

from sharding.precision import round_stochastically, scale_by_adam, to_bf16


def test_stochastic_rounding_is_unbiased_and_keeps_what_bf16_holds():
    x = jnp.asarray([1.0 + 2 ** -10, -3.0 - 2 ** -9 - 2 ** -12, 0.1, 7e-39], jnp.float32)  # 7e-39: subnormal
    every_dither = jnp.arange(1 << 16, dtype=jnp.uint32)
    rounded = jax.vmap(lambda d: round_stochastically(x, jnp.full(x.shape, d, jnp.uint32)))(every_dither)
    mean = np.asarray(rounded, np.float64).mean(0)
    np.testing.assert_allclose(mean, np.asarray(x, np.float64), rtol=0, atol=1e-12)  # exactly x, over the dithers
    assert set(np.unique(np.asarray(rounded[:, 0], np.float32))) == {1.0, 1.0078125}  # the two neighbours only
    held = jnp.asarray([1.5, -0.0, jnp.inf, -jnp.inf, 3.0e38], jnp.float32)
    for d in (0, 0xFFFF, 0xFFFFFFFF):
        out = np.asarray(round_stochastically(held, jnp.full(held.shape, d, jnp.uint32)), np.float32)
        np.testing.assert_array_equal(out[:4], np.asarray(held[:4]))
    assert np.isnan(np.asarray(round_stochastically(jnp.asarray([jnp.nan]), jnp.full(1, 0xFFFF, jnp.uint32)),
                               np.float32)).all()
    # NaNs with low mantissa bits (0x7FFFFFFF: NVIDIA's fp32 NaN) came out +-0 (an audit): NaN on both roundings
    nans = jax.lax.bitcast_convert_type(jnp.asarray([0x7FFFFFFF, 0xFFFF8000, 0x7FC00000, 0x7F800001], jnp.uint32),
                                        jnp.float32)
    for d in (0, 0xFFFF):
        assert np.isnan(np.asarray(round_stochastically(nans, jnp.full(4, d, jnp.uint32)), np.float32)).all(), d
    assert np.isnan(np.asarray(to_bf16(nans), np.float32)).all()


def _nu_after(moment_dtype, grads):
    opt = scale_by_adam(0.9, 0.999, 1e-8, moment_dtype)

    def body(state, g):
        _, state = opt.update(g, state)
        return state, None

    state, _ = jax.lax.scan(body, opt.init(grads[0]), grads)
    return state.nu.astype(jnp.float32), state.mu.astype(jnp.float32)


def test_bf16_moments_follow_fp32_adams_in_expectation():
    """A steady gradient of ~1 for 3000 updates, then ~0.1 for 3000: nu rounded to nearest stopped at 0.25 (fp32:
    0.95) and never decayed (0.25 against 0.057); stochastically rounded it follows fp32's within its noise."""
    n = 1024
    scale = 1.0 + jnp.arange(n, dtype=jnp.float32) / n  # elements of other bits: their dithers differ
    grads = jnp.concatenate([jnp.broadcast_to(scale, (3000, n)), jnp.broadcast_to(0.1 * scale, (3000, n))])
    f32 = jax.jit(_nu_after, static_argnums=0)
    for steps in (3000, 6000):
        (nu32, mu32), (nu16, mu16) = (map(np.asarray, f32(dt, grads[:steps])) for dt in (jnp.float32, jnp.bfloat16))
        ratio = nu16 / nu32
        assert abs(np.mean(ratio) - 1) < 0.01 and np.percentile(np.abs(ratio - 1), 95) < 0.25, (steps, ratio.mean())
        assert abs(np.mean(mu16 / mu32) - 1) < 0.002


def test_fp32_moments_are_optax_adam_for_gradients_of_every_scale():
    """u = mu_hat / (sqrt(nu_hat) + eps), as optax: eps inside the root (a mutation audit) made a 1e-5 gradient's
    first update 0.0995 where Adam's is 0.999, and no test saw it."""
    import optax
    ours, theirs = scale_by_adam(moment_dtype=jnp.float32), optax.scale_by_adam()
    g0 = jnp.asarray([1e-6, 1e-5, 1e-3, 0.1, 1.0, -2.0], jnp.float32)
    s1, s2 = ours.init(g0), theirs.init(g0)
    for step in range(4):
        g = g0 * (1.0 + 0.5 * step * (-1) ** step)
        u1, s1 = ours.update(g, s1)
        u2, s2 = theirs.update(g, s2)
        np.testing.assert_allclose(np.asarray(u1), np.asarray(u2), rtol=1e-6, err_msg=f"update {step + 1}")
