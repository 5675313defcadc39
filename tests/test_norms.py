"""rms_norm on rows flattened to [N, d] computes the formula on the input's own rank: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.model.norms import rms_norm


def _formula(x, w, eps):
    """The Gemma RMSNorm on x's own rank (what autodiff reduced slowly over the token axes on XLA:CPU)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 7, 4, 16), (6, 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_equal_the_formula(shape, dtype):
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = (3.0 * jax.random.normal(kx, shape)).astype(dtype)
    w = (0.1 * jax.random.normal(kw, shape[-1:])).astype(dtype)
    cot = jax.random.normal(kc, shape)

    def loss(norm):
        return lambda x, w: jnp.sum(norm(x, w, 1e-6).astype(jnp.float32) * cot)

    got, ref = rms_norm(x, w, 1e-6), _formula(x, w, 1e-6)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    tol = 1e-6 if dtype == jnp.float32 else 2 ** -7  # the sum order; bf16: one rounding of the same fp32 value
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref))
    for g, r in zip(jax.grad(loss(rms_norm), argnums=(0, 1))(x, w), jax.grad(loss(_formula), argnums=(0, 1))(x, w)):
        assert g.dtype == r.dtype == dtype
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.max(np.abs(g - r)) <= tol * np.max(np.abs(r))
