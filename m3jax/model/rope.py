"""Partial rotary position embedding, NeoX (half-split) pairing, as HF's `rotate_half`."""

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, S, r] for integer positions [B, S].

    inv_freq[m] = theta^(-2m/r), m = 0..r/2-1;  ang = pos * inv_freq;  cos = cat(cos(ang), cos(ang)).
    Computed in fp32, then cast to the activation dtype (as HF does).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first r = cos.shape[-1] channels of x [B, S, heads, D]; pass the rest through.

    With x_rot = [x1, x2] (halves of the first r channels): out = x_rot*cos + [-x2, x1]*sin.
    """
    r = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = x_rot * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
    return jnp.concatenate([rotated, x_pass], axis=-1)
