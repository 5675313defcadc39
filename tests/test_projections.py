"""The attention projections on merged token rows equal their einsums (values and gradients); the softmax
with its own JVP equals jax.nn.softmax, masked rows included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.model.projections import project_in, project_out
from m3jax.model.softmax import softmax

_MASKED = jnp.finfo(jnp.float32).min


def _close(got, ref, tol):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape
    assert np.max(np.abs(got - ref)) <= tol * max(np.max(np.abs(ref)), 1e-30)


@pytest.mark.parametrize("w_shape", [(4, 16, 32), (1, 16, 32), (48, 32)])
@pytest.mark.parametrize("merged", [True, False])
def test_project_out_equals_the_einsum(w_shape, merged):
    kx, kw, kc = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(kx, (2, 5, 32)), jax.random.normal(kw, w_shape)
    letters = "hd"[2 - (len(w_shape) - 1):]
    ref_fn = lambda x, w: jnp.einsum(f"bse,{letters}e->bs{letters}", x, w)  # noqa: E731
    cot = jax.random.normal(kc, (2, 5) + w_shape[:-1])
    got_fn = lambda x, w: project_out(x, w, merged)  # noqa: E731
    _close(got_fn(x, w), ref_fn(x, w), 1e-6)
    for g, r in zip(jax.grad(lambda x, w: jnp.sum(got_fn(x, w) * cot), argnums=(0, 1))(x, w),
                    jax.grad(lambda x, w: jnp.sum(ref_fn(x, w) * cot), argnums=(0, 1))(x, w)):
        _close(g, r, 1e-6)


@pytest.mark.parametrize("merged", [True, False])
def test_project_in_equals_the_einsum(merged):
    kx, kw, kc = jax.random.split(jax.random.key(2), 3)
    o, w = jax.random.normal(kx, (2, 5, 4, 16)), jax.random.normal(kw, (32, 4, 16))
    cot = jax.random.normal(kc, (2, 5, 32))
    ref_fn = lambda o, w: jnp.einsum("bshd,ehd->bse", o, w)  # noqa: E731
    got_fn = lambda o, w: project_in(o, w, merged)  # noqa: E731
    _close(got_fn(o, w), ref_fn(o, w), 1e-6)
    for g, r in zip(jax.grad(lambda o, w: jnp.sum(got_fn(o, w) * cot), argnums=(0, 1))(o, w),
                    jax.grad(lambda o, w: jnp.sum(ref_fn(o, w) * cot), argnums=(0, 1))(o, w)):
        _close(g, r, 1e-6)


def test_project_in_names_a_shape_mismatch():
    with pytest.raises(ValueError, match=r"does not end in the weight's input dims \(4, 16\)"):
        project_in(jnp.zeros((2, 5, 8, 16)), jnp.zeros((32, 4, 16)), True)


def test_softmax_equals_jax_nn_softmax_with_masked_and_empty_rows():
    kx, km, kc = jax.random.split(jax.random.key(3), 3)
    x = 4.0 * jax.random.normal(kx, (3, 6, 40))
    keep = jax.random.bernoulli(km, 0.4, x.shape).at[0, 0].set(False).at[1, 2].set(True)  # one row all masked
    cot = jax.random.normal(kc, x.shape)

    def ref(x):
        return jax.nn.softmax(jnp.where(keep, x, _MASKED), axis=-1)

    def got(x):
        return softmax(jnp.where(keep, x, _MASKED))

    _close(got(x), ref(x), 1e-6)
    np.testing.assert_allclose(np.asarray(got(x))[0, 0], 1.0 / 40, rtol=1e-6)  # a query that sees no key
    _close(jax.grad(lambda x: jnp.sum(got(x) * cot))(x), jax.grad(lambda x: jnp.sum(ref(x) * cot))(x), 1e-6)
