"""Lightning indexer: per-query block selection for the sparse attention layers (pure functions).

The indexer adds nothing to the residual stream; it only decides which key blocks each query may
attend to. Selection goes through top-k and a boolean mask, so (as in HF) the indexer parameters
receive no gradient from the language-model loss.
"""

import jax
import jax.numpy as jnp


def select_key_blocks(index_q: jax.Array, index_k: jax.Array, positions: jax.Array, *, block_size: int,
                      topk_blocks: int, local_blocks: int) -> jax.Array:
    """Boolean keep-mask over key blocks, [B, Hi, S, nb], nb = ceil(S_k / block_size).

    index_q [B, S, Hi, Di] and index_k [B, S_k, Di] are normalised and rotated already.
        score[b,h,i,j] = <iq[b,i,h], ik[b,j]>  (fp32, no scale)   ;  -inf where key slot j > position_i
        blk[b,h,i,n]   = max_{j in block n} score                 (padded slots count as -inf)
        blk[..., max(pos_i // bs - l, 0)] = +inf  for l < local_blocks   (the query's own block, forced)
        keep = top-min(K, nb) blocks of blk, minus those whose selected score is -inf (fully future)
    """
    b, s, hi, _ = index_q.shape
    sk = index_k.shape[1]
    nb = -(-sk // block_size)
    scores = jnp.einsum("bshd,btd->bhst", index_q.astype(jnp.float32), index_k.astype(jnp.float32))
    future = jnp.arange(sk)[None, None, None, :] > positions[:, None, :, None]
    scores = jnp.where(future, -jnp.inf, scores)
    pad = nb * block_size - sk
    if pad:
        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
    block_scores = scores.reshape(b, hi, s, nb, block_size).max(axis=-1)
    block_ids = jnp.arange(nb)
    query_block = positions // block_size  # [B, S]
    forced = jnp.zeros((b, s, nb), bool)
    for lag in range(local_blocks):
        forced |= block_ids == jnp.maximum(query_block - lag, 0)[..., None]
    block_scores = jnp.where(forced[:, None], jnp.inf, block_scores)
    k = min(topk_blocks, nb)
    top_scores, top_ids = jax.lax.top_k(block_scores, k)
    chosen = (top_ids[..., None] == block_ids) & (top_scores > -jnp.inf)[..., None]
    return jax.lax.stop_gradient(chosen.any(axis=-2))


def block_mask_to_tokens(keep_blocks: jax.Array, block_size: int, key_len: int, num_heads: int) -> jax.Array:
    """[B, Hi, S, nb] block keep-mask -> [B, H, S, S_k] token keep-mask.

    Index head g serves query heads g*(H/Hi) .. (g+1)*(H/Hi)-1 (HF's repeat_interleave).
    """
    tok = jnp.repeat(keep_blocks, block_size, axis=-1)[..., :key_len]
    return jnp.repeat(tok, num_heads // keep_blocks.shape[1], axis=1)
