"""M3 attention: per-head QK norm, partial RoPE, GQA; optional block-sparse mask from the indexer."""

import jax
import jax.numpy as jnp

from m3jax.model.indexer import block_mask_to_tokens, select_key_blocks
from m3jax.model.norms import rms_norm
from m3jax.model.rope import apply_rope

_MASKED = jnp.finfo(jnp.float32).min


def causal_keep(positions: jax.Array, key_valid: jax.Array | None, key_len: int) -> jax.Array:
    """[B, 1, S, S_k] boolean: key slot j visible to query i iff j <= position_i and j is not padding."""
    keep = jnp.arange(key_len)[None, None, None, :] <= positions[:, None, :, None]
    if key_valid is not None:
        keep &= key_valid[:, None, None, :]
    return keep


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, scale: float) -> jax.Array:
    """softmax(q k^T * scale, masked) v with query head h reading kv head h // (H / KV).

    q [B, S, H, D], k/v [B, S_k, KV, D], keep [B, 1 or H, S, S_k] -> [B, S, H, D].
    Logits and softmax in fp32; probabilities cast to the value dtype before the value product.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d)
    logits = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
    keep = keep.reshape(b, -1, 1, s, keep.shape[-1]) if keep.shape[1] == 1 else \
        keep.reshape(b, kv, h // kv, s, keep.shape[-1])
    logits = jnp.where(keep, logits, _MASKED)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, d)


def attention_block(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
                    key_valid: jax.Array | None, cfg, sparse: bool, cache: dict | None = None):
    """One layer's attention on normalised hidden x [B, S, d] -> [B, S, d] (and the updated cache).

    p holds this layer's q/k/v/o projections ([heads, D, d] / [d, H, D]), q/k norms, and for sparse
    layers the indexer's index_q_proj [Hi, Di, d], index_k_proj [Di, d] and their norms.
    cache (decoding): {"k", "v": [B, S_max, KV, D], "index_k": [B, S_max, Di] for sparse layers}, the
    post-norm, post-RoPE keys by slot. The new tokens' keys are written at slots = positions, and
    attention reads every slot (slots not yet written lie beyond each query's position, so causality
    hides them); key_valid then spans S_max.
    """
    eps = cfg.rms_norm_eps
    q = rms_norm(jnp.einsum("bse,hde->bshd", x, p["q_proj"]), p["q_norm"], eps)
    k = rms_norm(jnp.einsum("bse,hde->bshd", x, p["k_proj"]), p["k_norm"], eps)
    v = jnp.einsum("bse,hde->bshd", x, p["v_proj"])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    iq = ik = None
    if sparse:
        iq, ik = indexer_qk(p, x, cos, sin, eps)
    if cache is not None:
        rows = jnp.arange(x.shape[0])[:, None]
        cache = {"k": cache["k"].at[rows, positions].set(k), "v": cache["v"].at[rows, positions].set(v),
                 **({"index_k": cache["index_k"].at[rows, positions].set(ik)} if sparse else {})}
        k, v = cache["k"], cache["v"]
        ik = cache.get("index_k")
    keep = causal_keep(positions, key_valid, k.shape[1])
    if sparse:
        blocks = select_key_blocks(iq, ik, positions, block_size=cfg.index_block_size,
                                   topk_blocks=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks)
        keep = keep & block_mask_to_tokens(blocks, cfg.index_block_size, k.shape[1], cfg.num_attention_heads)
    o = gqa_attention(q, k, v, keep, cfg.head_dim ** -0.5)
    out = jnp.einsum("bshd,ehd->bse", o, p["o_proj"])
    return out if cache is None else (out, cache)


def indexer_qk(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, eps: float):
    """Normalised, rotated indexer queries [B, S, Hi, Di] and its single key head [B, S, Di].

    HF rotates the indexer with cos[..., :index_head_dim] of the attention's RoPE table.
    """
    di = p["index_k_proj"].shape[0]
    iq = rms_norm(jnp.einsum("bse,hde->bshd", x, p["index_q_proj"]), p["index_q_norm"], eps)
    ik = rms_norm(jnp.einsum("bse,de->bsd", x, p["index_k_proj"])[:, :, None, :], p["index_k_norm"], eps)
    iq = apply_rope(iq, cos[..., :di], sin[..., :di])
    ik = apply_rope(ik, cos[..., :di], sin[..., :di])
    return iq, ik[:, :, 0, :]
