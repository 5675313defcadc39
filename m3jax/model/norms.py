"""Gemma-style RMSNorm, the only normalisation in M3 (input, post-attention, final, q/k, indexer q/k)."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """y = (x / sqrt(mean(x^2) + eps)) * (1 + w), over the last axis.

    Computed in fp32 and cast back to x.dtype only after the (1 + w) multiply; w is stored
    zero-centred, so a freshly initialised norm is the identity scale.
    """
    # On rows flattened to [N, d]: the weight's gradient is then one plain column sum. Autodiff of the same
    # formula on [B, S, d] reduced the token axes of a rank-3 product inside one XLA:CPU (YNNPACK) fusion:
    # 40 ms for a [1, 4096, 512] input where the column sum takes 3 ms (2-core CPU).
    d = x.shape[-1]
    xf = x.astype(jnp.float32).reshape(-1, d)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype).reshape(x.shape)
