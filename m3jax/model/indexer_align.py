"""Indexer alignment (`model.indexer_loss_coef`): a KL that teaches the lightning indexer where the full
attention puts its mass, as DeepSeek-V3.2 trains its indexer (dense stage); the LM loss gives it none.

For a sparse layer, query i (position pos_i), index head g serving the query heads G_g (g * H/Hi ...
(g+1) * H/Hi - 1) and key blocks n of `index_block_size` slots:

    p[h,i,n]  = sum_{j in block n} softmax_j( scale <q[i,h], k[j, h // (H/KV)]> )   (causal + padding, no mask)
    t[g,i,n]  = (1 / |G_g|) sum_{h in G_g} p[h,i,n]                 the target: L1-normalised, stop-gradient
    s[g,i,n]  = max_{j in block n, j <= pos_i, key_valid[j]} <iq[i,g], ik[j]>   the indexer's block score
    u[g,i,:]  = softmax_n( s[g,i,n] )  over the blocks with a visible key      (fp32, no forced local block)
    kl[i]     = (1 / Hi) sum_g sum_n t[g,i,n] (log t[g,i,n] - log u[g,i,n])   (0 log 0 = 0)

kl[i] = 0 for a query that sees no key. The gradient reaches only the indexer's parameters: q and k are
stopped here, and the caller computes iq / ik from a detached hidden state (`attention_block`), so the
residual stream is not trained to please the indexer. The top-k (`key_block_scores`) ranks the same
block maxima s, so lowering the KL raises the mass of the blocks the indexer keeps (`indexer/recall`).

Queries are walked `tile` at a time under `jax.checkpoint` (`lax.map`): one tile's [B, H, tile, S_k]
probabilities and [B, Hi, tile, S_k] indexer scores are live, forward and backward, never [S, S_k]. The
target costs one full-attention pass per sparse layer: the price of looking at what the mask hides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3jax.model.recall import full_attention_block_mass
from m3jax.model.tiles import _from_chunks, _to_chunks, causal_keep


def indexer_alignment_kl(q: jax.Array, k: jax.Array, index_q: jax.Array, index_k: jax.Array, positions: jax.Array,
                         key_valid: jax.Array | None, cfg, tile: int = 128, *, n_ctx: int = 1,
                         constrain=None) -> jax.Array:
    """kl [B, S] fp32 (module docstring) for one sparse layer; differentiable in index_q / index_k only.

    q [B, S, H, D], k [B, S_k, KV, D] (post-norm, post-RoPE; every key slot); index_q [B, S, Hi, Di],
    index_k [B, S_k, Di] (the indexer's, normalised and rotated); positions [B, S]; key_valid [B, S_k]
    (None = all real); cfg: head_dim and index_block_size. n_ctx / constrain: how the sequence is cut
    over context shards and the layout's constraint (as `indexer_recall`).
    """
    b, s, h, _ = q.shape
    sk = k.shape[1]
    hi = index_q.shape[2]
    bs = cfg.index_block_size
    nb = -(-sk // bs)
    scale = float(cfg.head_dim) ** -0.5
    constrain = constrain or (lambda a, axes: a)
    kval = jnp.ones((b, sk), bool) if key_valid is None else key_valid.astype(bool)
    k32 = jax.lax.stop_gradient(k).astype(jnp.float32)
    ik32 = index_k.astype(jnp.float32)
    chunk = min(tile, s // n_ctx)

    @jax.checkpoint
    def one(xs):
        qc, iqc, pc = xs  # [B, T, H, D], [B, T, Hi, Di], [B, T]
        t = qc.shape[1]
        mass, total, seen = full_attention_block_mass(constrain(qc, ("act_batch", "act_seq", "act_heads", None)),
                                                      k32, pc, kval, scale, bs)
        p = mass / jnp.where(seen, total, 1.0)[..., None]  # [B, H, T, nb]
        target = p.reshape(b, hi, h // hi, t, nb).mean(2)  # [B, Hi, T, nb]
        scores = jnp.einsum("bthd,bsd->bhts", iqc.astype(jnp.float32), ik32, precision=jax.lax.Precision.HIGHEST)
        scores = jnp.where(causal_keep(pc, kval, sk), scores, -jnp.inf)
        blocks = jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, nb * bs - sk)), constant_values=-jnp.inf)
        blocks = blocks.reshape(b, hi, t, nb, bs).max(-1)  # [B, Hi, T, nb]; -inf: no visible key
        visible = blocks > -jnp.inf
        visible |= ~visible.any(-1, keepdims=True)  # a query that sees nothing: any finite softmax (kl is 0)
        log_u = jax.nn.log_softmax(jnp.where(visible, blocks, 0.0), axis=-1, where=visible)
        terms = jnp.where(target > 0, target * (jnp.log(jnp.where(target > 0, target, 1.0)) - log_u), 0.0)
        kl = jnp.where(seen[:, 0], terms.sum(-1).mean(1), 0.0)  # [B, T]
        return kl

    xs = (_to_chunks(q, n_ctx, chunk), _to_chunks(index_q, n_ctx, chunk), _to_chunks(positions, n_ctx, chunk))
    return _from_chunks(jax.lax.map(one, xs), n_ctx, s)
