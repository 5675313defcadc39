"""indexer/recall: the share of a sparse layer's full attention that lies in the key blocks its indexer kept.

For query i (position pos_i), query head h, key slots j of the layer's keys and the selected blocks
ids[b, i, h // (H / Hi), :] (-1 = none), with the full causal + padding softmax and no indexer mask:

    p[b,h,i,j]    = softmax_j( scale * <q[b,i,h], k[b,j,h // (H / KV)]> )   over j <= pos_i with key_valid[b, j]
    recall[b,i,h] = sum_{j : j // block_size in ids[b,i,h // (H / Hi)]} p[b,h,i,j]

(fp32, scale = head_dim ** -0.5; p = 0 on hidden slots). recall = 1 when the selection covers every
visible block; the indexer keeps index_topk_blocks of them, so a query with more visible blocks can miss
mass. A query that sees no key counts as 1 and is left out of the mean. The layer's figure is

    recall = sum_{b,i,h} w[b,i] recall[b,i,h] / (H * sum_{b,i} w[b,i]) ,  w = query_mask & (sees a key)

(NaN when no query counts). Queries are walked `tile` at a time (`lax.map`), so one tile's
[B, H, tile, S_k] probabilities are live, never [B, H, S, S_k]. Diagnostics only: no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3jax.model.tiles import _from_chunks, _to_chunks, causal_keep


def indexer_recall(q: jax.Array, k: jax.Array, positions: jax.Array, key_valid: jax.Array | None,
                   block_ids: jax.Array, cfg, tile: int = 128, *, query_mask: jax.Array | None = None,
                   reduce: bool = True, n_ctx: int = 1, constrain=None) -> jax.Array:
    """The full-attention mass in the selected blocks (module docstring) for one sparse layer.

    q [B, S, H, D] queries at positions [B, S]; k [B, S_k, KV, D] every key slot (post-norm, post-RoPE);
    key_valid [B, S_k] (None = all real); block_ids [B, S, Hi, K] int (-1 = none); cfg: head_dim and
    index_block_size. query_mask [B, S] (None = all): the queries that count (real tokens).
    reduce: the layer's mean (a scalar, fp32); else the per-query recall [B, S, H] (1 where no key is seen).
    n_ctx / constrain: how the sequence is cut over context shards and the layout's constraint (as
    `sparse_layer_attention`): a tile holds `tile` local queries of each shard.
    """
    b, s, h, _ = q.shape
    sk = k.shape[1]
    hi = block_ids.shape[2]
    bs = cfg.index_block_size
    nb = -(-sk // bs)
    scale = float(cfg.head_dim) ** -0.5
    constrain = constrain or (lambda a, axes: a)
    kval = jnp.ones((b, sk), bool) if key_valid is None else key_valid.astype(bool)
    qmask = jnp.ones((b, s), bool) if query_mask is None else query_mask.astype(bool)
    k32 = jax.lax.stop_gradient(k).astype(jnp.float32)
    chunk = min(tile, s // n_ctx)

    def one(xs):
        qc, pc, ic, mc = xs  # [B, T, H, D], [B, T], [B, T, Hi, K], [B, T]
        mass, total, seen = full_attention_block_mass(constrain(qc, ("act_batch", "act_seq", "act_heads", None)),
                                                      k32, pc, kval, scale, bs)
        sel = (ic[..., None] == jnp.arange(nb)).any(-2)  # [B, T, Hi, nb]
        sel = jnp.repeat(jnp.moveaxis(sel, 2, 1), h // hi, axis=1)  # [B, H, T, nb]: index head h // (H / Hi)
        r = jnp.where(seen, jnp.sum(jnp.where(sel, mass, 0.0), -1) / jnp.where(seen, total, 1.0), 1.0)
        return jnp.moveaxis(r, 1, 2), mc & seen[:, 0]  # [B, T, H], [B, T]

    xs = tuple(_to_chunks(a, n_ctx, chunk) for a in (q, positions, block_ids.astype(jnp.int32), qmask))
    r, w = jax.lax.map(one, xs)  # [n, B, T, H], [n, B, T]; padded queries have mask 0
    if not reduce:
        return _from_chunks(r, n_ctx, s)
    count = w.sum() * h
    return jnp.where(count > 0, jnp.sum(r * w[..., None]) / jnp.maximum(count, 1), jnp.nan).astype(jnp.float32)


def full_attention_block_mass(q: jax.Array, k32: jax.Array, positions: jax.Array, key_valid: jax.Array,
                              scale: float, block_size: int):
    """The full causal + padding softmax of queries q [B, T, H, D] (positions [B, T]) over key slots k32
    [B, S_k, KV, D] (fp32, key_valid [B, S_k] bool), reduced to key blocks of `block_size`, without the
    normaliser: (mass [B, H, T, nb] = sum_{j in block n} exp(l_j - max l), total [B, H, T] = sum_n mass,
    seen [B, 1, T]: the query sees some key). p(block n) = mass / total where seen. fp32, HIGHEST
    precision, no gradient (q is stopped here; k32 the caller's stopped copy)."""
    b, t, h, d = q.shape
    sk, kvh = k32.shape[1], k32.shape[2]
    nb = -(-sk // block_size)
    qg = jax.lax.stop_gradient(q).astype(jnp.float32).reshape(b, t, kvh, h // kvh, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k32, precision=jax.lax.Precision.HIGHEST) * scale
    logits = logits.reshape(b, h, t, sk)
    keep = causal_keep(positions, key_valid, sk)  # [B, 1, T, S_k]
    seen = keep.any(-1)  # [B, 1, T]
    top = jnp.max(jnp.where(keep, logits, -jnp.inf), axis=-1, keepdims=True)
    e = jnp.where(keep, jnp.exp(logits - jnp.where(seen[..., None], top, 0.0)), 0.0)
    mass = jnp.pad(e, ((0, 0), (0, 0), (0, 0), (0, nb * block_size - sk))).reshape(b, h, t, nb, block_size).sum(-1)
    return mass, e.sum(-1), seen
