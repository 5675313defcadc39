"""The attention softmax, with a JVP that XLA:CPU turns into one cheap elementwise backward pass."""

import jax
import jax.numpy as jnp


@jax.custom_jvp
def softmax(x: jax.Array) -> jax.Array:
    """p = exp(x - m) / sum(exp(x - m)) over the last axis, m = max(x);  JVP: dp = p * (dx - sum(p * dx)).

    Equal to `jax.nn.softmax(x, axis=-1)` up to an ulp (a row of equal values, e.g. all masked, gives the
    uniform row). Why not `jax.nn.softmax`: XLA:CPU fused its gradient into one slow YNNPACK reduction, 54 ms
    for a [2, 4096, 4, 256] softmax on the 2-core CPU against 12-14 ms from this JVP (whose transpose is
    p * (g - sum(g * p)) on the saved p); at the tiny model's shapes both take the same time
    (BENCHMARKS.md, issue 11, session 12). A JVP rather than a VJP rule, so that `jax.checkpoint` treats p
    like any other intermediate.
    """
    z = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))  # differentiated only through the JVP below
    return z / jnp.sum(z, axis=-1, keepdims=True)


@softmax.defjvp
def _softmax_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    p = softmax(x)
    return p, p * (dx - jnp.sum(p * dx, axis=-1, keepdims=True))
