"""Lightning indexer: per-query block selection for the sparse attention layers (pure functions).

The indexer adds nothing to the residual stream; it only decides which key blocks each query may
attend to. Selection goes through top-k and a boolean mask, so (as in HF) the indexer parameters
receive no gradient from the language-model loss.
"""

import jax
import jax.numpy as jnp


KEY_CHUNK_BLOCKS = 16  # key blocks scored per step of `key_block_scores`' loop (16 x 64 keys: fastest on CPU)
# Up to this many fp32 scores (4 MB) the indexer scores its queries against every key at once, with no loop: a
# decode step's few queries, whose loop over key chunks copied the layer's index keys once more and paid a
# thread hand-off per chunk on a CPU (BENCHMARKS.md, session 29). A constant: no O(S^2) term at scale.
WHOLE_SCORES_ELEMENTS = 1 << 20


def scores_fit_whole(batch: int, index_heads: int, queries: int, keys: int) -> bool:
    """Whether the indexer's [B, Hi, queries, keys] fp32 scores are small enough to form in one step."""
    return batch * index_heads * queries * keys <= WHOLE_SCORES_ELEMENTS


def key_block_scores(index_q: jax.Array, index_k: jax.Array, positions: jax.Array, *, block_size: int,
                     local_blocks: int) -> jax.Array:
    """Block scores the top-k ranks, [B, Hi, S, nb] fp32, nb = ceil(S_k / block_size).

    index_q [B, S, Hi, Di] and index_k [B, S_k, Di] are normalised and rotated already.
        score[b,h,i,j] = <iq[b,i,h], ik[b,j]>  (fp32, no scale)   ;  -inf where key slot j > position_i
        blk[b,h,i,n]   = max_{j in block n} score                 (padded slots count as -inf)
        blk[..., max(pos_i // bs - l, 0)] = +inf  for l < local_blocks   (the query's own block, forced)
    The token scores are reduced to block maxima KEY_CHUNK_BLOCKS blocks at a time, and the loop stops
    after the last chunk any of the S queries can see (max position), so no [S, S_k] buffer is formed
    and wholly-future key chunks cost nothing; scores that `scores_fit_whole` are formed at once.
    No gradient flows (the selection is discrete).
    """
    b, s, hi, di = index_q.shape
    sk = index_k.shape[1]
    nb = -(-sk // block_size)
    cb = nb if scores_fit_whole(b, hi, s, nb * block_size) else min(KEY_CHUNK_BLOCKS, nb)
    n_chunks = -(-nb // cb)
    width = cb * block_size
    iq = jax.lax.stop_gradient(index_q).astype(jnp.float32)
    ik = jnp.pad(jax.lax.stop_gradient(index_k).astype(jnp.float32), ((0, 0), (0, n_chunks * width - sk), (0, 0)))
    ik = ik.reshape(b, n_chunks, width, di)
    live = jnp.clip((positions.max() + width) // width, 1, n_chunks)

    def chunk(c, out):
        scores = jnp.einsum("bshd,btd->bhst", iq, jax.lax.dynamic_index_in_dim(ik, c, 1, keepdims=False))
        slot = c * width + jnp.arange(width)
        hidden = (slot[None, None, :] > positions[:, :, None]) | (slot >= sk)[None, None, :]
        scores = jnp.where(hidden[:, None], -jnp.inf, scores)
        return jax.lax.dynamic_update_slice_in_dim(out, scores.reshape(b, hi, s, cb, block_size).max(-1), c * cb, 3)

    empty = jnp.full((b, hi, s, n_chunks * cb), -jnp.inf)
    block_scores = (chunk(0, empty) if n_chunks == 1 else jax.lax.fori_loop(0, live, chunk, empty))[..., :nb]
    block_ids = jnp.arange(nb)
    query_block = positions // block_size  # [B, S]
    forced = jnp.zeros((b, s, nb), bool)
    for lag in range(local_blocks):
        forced |= block_ids == jnp.maximum(query_block - lag, 0)[..., None]
    return jnp.where(forced[:, None], jnp.inf, block_scores)


def topk_key_blocks(index_q: jax.Array, index_k: jax.Array, positions: jax.Array, *, block_size: int,
                    topk_blocks: int, local_blocks: int) -> jax.Array:
    """The key blocks each query keeps, [B, Hi, S, min(K, nb)] int32 block ids, -1 where none.

    ids = top-min(K, nb) of `key_block_scores` (HF's top-k: the forced local blocks come first, ties
    as jax.lax.top_k), with ids whose selected score is -inf (blocks wholly in the query's future, for
    queries with fewer than K past blocks) replaced by -1.
    """
    block_scores = key_block_scores(index_q, index_k, positions, block_size=block_size,
                                    local_blocks=local_blocks)
    top_scores, top_ids = jax.lax.top_k(block_scores, min(topk_blocks, block_scores.shape[-1]))
    return jax.lax.stop_gradient(jnp.where(top_scores > -jnp.inf, top_ids, -1).astype(jnp.int32))


def block_ids_to_mask(block_ids: jax.Array, num_blocks: int) -> jax.Array:
    """[B, Hi, S, K] block ids (-1 = none) -> [B, Hi, S, nb] boolean keep-mask over key blocks."""
    return (block_ids[..., None] == jnp.arange(num_blocks)).any(axis=-2)


def select_key_blocks(index_q: jax.Array, index_k: jax.Array, positions: jax.Array, *, block_size: int,
                      topk_blocks: int, local_blocks: int) -> jax.Array:
    """Boolean keep-mask over key blocks, [B, Hi, S, nb]: the blocks of `topk_key_blocks`."""
    ids = topk_key_blocks(index_q, index_k, positions, block_size=block_size, topk_blocks=topk_blocks,
                          local_blocks=local_blocks)
    return block_ids_to_mask(ids, -(-index_k.shape[1] // block_size))


def block_mask_to_tokens(keep_blocks: jax.Array, block_size: int, key_len: int, num_heads: int) -> jax.Array:
    """[B, Hi, S, nb] block keep-mask -> [B, H, S, S_k] token keep-mask.

    Index head g serves query heads g*(H/Hi) .. (g+1)*(H/Hi)-1 (HF's repeat_interleave).
    """
    tok = jnp.repeat(keep_blocks, block_size, axis=-1)[..., :key_len]
    return jnp.repeat(tok, num_heads // keep_blocks.shape[1], axis=1)
