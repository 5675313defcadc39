"""SwiGLU-OAI feed-forward (dense MLP, shared expert and every routed expert use it)."""

import jax
import jax.numpy as jnp


def swiglu_oai(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """act = (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit).

    The gate is clamped from above only; gate and up are the two halves of the fused projection
    (not interleaved).
    """
    g = jnp.minimum(gate, limit)
    u = jnp.clip(up, -limit, limit)
    return (u + 1.0) * g * jax.nn.sigmoid(alpha * g)


def dense_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, alpha: float, limit: float) -> jax.Array:
    """x [..., d], gate_up [2, I, d] (row 0 gate, row 1 up), down [d, I] -> [..., d]."""
    gu = jnp.einsum("...d,cid->...ci", x, gate_up)
    act = swiglu_oai(gu[..., 0, :], gu[..., 1, :], alpha, limit)
    return jnp.einsum("...i,di->...d", act, down)
