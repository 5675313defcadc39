"""Query tiling and the causal/padding keep-mask shared by the attention paths (pure functions).

Kept apart from `m3jax.model.attention` so that modules the attention layer calls into (the recall
diagnostic) can use them without importing the layer back.
"""

import jax
import jax.numpy as jnp


def causal_keep(positions: jax.Array, key_valid: jax.Array | None, key_len: int) -> jax.Array:
    """[B, 1, S, S_k] boolean: key slot j visible to query i iff j <= position_i and j is not padding."""
    keep = jnp.arange(key_len)[None, None, None, :] <= positions[:, None, :, None]
    if key_valid is not None:
        keep &= key_valid[:, None, None, :]
    return keep


def _to_chunks(a: jax.Array, n_ctx: int, chunk: int) -> jax.Array:
    """[B, S, ...] -> [n, B, n_ctx * chunk, ...]: step j holds local queries j*chunk.. of every context shard.

    The sequence is split (n_ctx, S_l) with S_l = S / n_ctx, each shard's S_l padded with zeros to
    n * chunk, n = ceil(S_l / chunk), so a step never crosses a context shard.
    """
    b, s, rest = a.shape[0], a.shape[1], a.shape[2:]
    s_l = s // n_ctx
    n = -(-s_l // chunk)
    a = a.reshape(b, n_ctx, s_l, *rest)
    a = jnp.pad(a, [(0, 0), (0, 0), (0, n * chunk - s_l)] + [(0, 0)] * len(rest))
    a = jnp.moveaxis(a.reshape(b, n_ctx, n, chunk, *rest), 2, 0)
    return a.reshape(n, b, n_ctx * chunk, *rest)


def _from_chunks(a: jax.Array, n_ctx: int, s: int) -> jax.Array:
    """Inverse of `_to_chunks` for [n, B, n_ctx * chunk, ...] -> [B, S, ...] (padding dropped)."""
    n, b, rest = a.shape[0], a.shape[1], a.shape[3:]
    chunk = a.shape[2] // n_ctx
    a = jnp.moveaxis(a.reshape(n, b, n_ctx, chunk, *rest), 0, 2).reshape(b, n_ctx, n * chunk, *rest)
    return a[:, :, : s // n_ctx].reshape(b, s, *rest)
