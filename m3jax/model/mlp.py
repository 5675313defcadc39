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


# Up to this many token rows on one device (decode steps, short prompts) the gate and up projections are one product
# against gate_up viewed as [2 I, d]. As a "...d,cid->...ci" einsum XLA:CPU copies the weight transposed to
# [d, 2 I] at each call: 4.7 ms of a 16 ms decode step of the sparse bench model. Over more rows that copy is
# amortised and the einsum's forward+backward was as fast or faster (two 512-wide layers, fwd+bwd, einsum /
# merged: 1.56x at 8 rows, 1.31x at 64, 0.86x at 256, 1.0x at 1,024-4,096; BENCHMARKS.md, session 29).
MERGED_GATE_UP_ROWS = 128


def dense_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, alpha: float, limit: float,
              one_device: bool = False) -> jax.Array:
    """x [..., d], gate_up [2, I, d] (row 0 gate, row 1 up), down [d, I] -> [..., d].

    one_device: may merge gate_up's [2, I] into one axis (`MERGED_GATE_UP_ROWS`); under a mesh the merge would
    split a tensor-sharded I, so the einsum stays.
    """
    if one_device and x.size // x.shape[-1] <= MERGED_GATE_UP_ROWS:
        gu = jax.lax.dot_general(x, gate_up.reshape(-1, gate_up.shape[-1]), (((x.ndim - 1,), (1,)), ((), ())))
        gate, up = gu[..., :gate_up.shape[1]], gu[..., gate_up.shape[1]:]
    else:
        gu = jnp.einsum("...d,cid->...ci", x, gate_up)
        gate, up = gu[..., 0, :], gu[..., 1, :]
    act = swiglu_oai(gate, up, alpha, limit)
    return jnp.einsum("...i,di->...d", act, down)
