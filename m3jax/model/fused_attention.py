"""Full-attention layers on cuDNN's fused flash attention (`jax.nn.dot_product_attention`), for GPUs.

cuDNN states its mask as causal by index plus one key length per row (PADDING_CAUSAL); the model's is causal
by position plus a validity flag per key slot (`causal_keep`: slot j is visible to query i iff
j <= position_i and key_valid[j]). The two are one mask exactly when every row's positions are 0..S-1 and
its key_valid is a non-empty prefix (right padding, the model's contract): then j <= i and j < length, on
padding rows too. Whether an input has that form is decided at run time (`lax.cond`; on a GPU only the
branch taken runs), so any other input (left padding, a row of padding only, offset positions) runs the
model's own attention (`fallback`), and no input's result depends on having cuDNN's form.

The rest of cuDNN's constraints are static (`applies`): a GPU, 16-bit q/k/v, a head dim that is a multiple
of 8 and at most 128, self-attention over the layer's own tokens (not a decode step over cache slots), and
the keys on the same device as the queries (no context sharding). Those jax itself checks when the call is
traced (the cuDNN version, the device's compute capability, shapes) fall back too, with a warning.

Off a GPU nothing here runs, except in the tests, which swap `implementation` for jax's "xla" one (the same
call and mask, computed by XLA) to check the mapping of the mask and the fallback on CPU; cuDNN's own
numbers are `scripts/gpu_check.py`'s to measure.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from sharding.layout import on_gpu

FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 128  # cuDNN's limit before Hopper (256 from sm90 on): the model's choice holds on every GPU


def implementation(backend: str | None = None) -> str | None:
    """`jax.nn.dot_product_attention`'s implementation on `backend` (default: jax's): "cudnn" on a GPU, else
    None (nothing fused)."""
    return "cudnn" if on_gpu(backend) else None


def applies(q: jax.Array, key_len: int, cached: bool, n_ctx: int, backend: str | None = None) -> bool:
    """Whether a full layer's attention of queries q [B, S, H, D] over key_len keys can run fused (static) on
    `backend` (the platform the program is built for; default jax's)."""
    d = q.shape[-1]
    return (implementation(backend) is not None and q.dtype in FUSED_DTYPES and d % 8 == 0 and d <= MAX_HEAD_DIM
            and not cached and n_ctx == 1 and key_len == q.shape[1])


def fused_form(positions: jax.Array, key_valid: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(whether the mask is cuDNN's PADDING_CAUSAL form: a scalar bool, key lengths [B] int32)."""
    b, s = positions.shape
    index = jnp.arange(s, dtype=positions.dtype)
    ok = jnp.all(positions == index)
    if key_valid is None:
        return ok, jnp.full((b,), s, jnp.int32)
    lengths = jnp.sum(key_valid, axis=-1, dtype=jnp.int32)
    prefix = key_valid == (index[None, :] < lengths[:, None])
    return ok & jnp.all(prefix) & jnp.all(lengths > 0), lengths


def fused_attention(q, k, v, positions, key_valid, scale: float, fallback, backend: str | None = None):
    """softmax(q k^T * scale, causal_keep(positions, key_valid)) v for q [B, S, H, D], k/v [B, S, KV, D]
    (GQA: query head h reads kv head h // (H / KV)), through `jax.nn.dot_product_attention` where the mask
    has cuDNN's form (module docstring), else fallback(q, k, v). backend: the platform the program is built
    for (default jax's), whose implementation the call names."""
    ok, lengths = fused_form(positions, key_valid)
    impl = implementation(backend)

    def fused(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                            key_value_seq_lengths=None if key_valid is None else lengths,
                                            implementation=impl).astype(v.dtype)

    try:  # jax checks cuDNN's own constraints (version, compute capability, shapes) when the call is traced
        jax.eval_shape(fused, q, k, v)
    except (NotImplementedError, ValueError, RuntimeError) as e:
        logging.getLogger(__name__).warning("cuDNN attention does not apply (%s): the model's own attention runs", e)
        return fallback(q, k, v)
    return jax.lax.cond(ok, fused, fallback, q, k, v)
