"""The attention softmax, written so that autodiff's backward is one cheap elementwise pass."""

import jax
import jax.numpy as jnp


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """p = exp(z - log(sum exp(z))),  z = x - m,  m = max(x) (held constant under autodiff).

    Equal to `jax.nn.softmax` up to an ulp (a row of equal values, e.g. all masked, gives the uniform
    row). Why not `jax.nn.softmax`: its quotient exp(x - m) / sum differentiates into a product-and-
    quotient expression that XLA:CPU fused into one slow YNNPACK reduction (54 ms for the gradient of a
    [2, 4096, 4, 256] softmax on the 2-core CPU); through the log-sum-exp the gradient is
    p * (g - sum(g * p)) with p recomputed by one exp, 13 ms (BENCHMARKS.md, issue 11, session 12).
    """
    m = jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    # Shifted before the log is added back: with m = finfo.min (a row masked everywhere) m + log(n) would
    # round back to m and give ones instead of the uniform 1 / n.
    z = x - m
    return jnp.exp(z - jnp.log(jnp.sum(jnp.exp(z), axis=axis, keepdims=True)))
