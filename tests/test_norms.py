"""rms_norm's hand-written VJP equals autodiff of its own forward formula (fp32 and bf16 inputs, any rank)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.model.norms import _forward, rms_norm


@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 7, 4, 16), (6, 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_equals_autodiff_of_the_formula(shape, dtype):
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = (3.0 * jax.random.normal(kx, shape)).astype(dtype)
    w = (0.1 * jax.random.normal(kw, shape[-1:])).astype(dtype)
    cot = jax.random.normal(kc, shape)

    def loss(norm):
        return lambda x, w: jnp.sum(norm(x, w, 1e-6).astype(jnp.float32) * cot)

    got = jax.grad(loss(rms_norm), argnums=(0, 1))(x, w)
    ref = jax.grad(loss(_forward), argnums=(0, 1))(x, w)
    np.testing.assert_array_equal(np.asarray(rms_norm(x, w, 1e-6), np.float32),
                                  np.asarray(_forward(x, w, 1e-6), np.float32))
    # fp32: the same numbers up to the sum order; bf16: both round the same fp32 gradient to bf16 (1 ulp)
    tol = 1e-6 if dtype == jnp.float32 else 2 ** -7
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype == dtype
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.max(np.abs(g - r)) <= tol * np.max(np.abs(r))
