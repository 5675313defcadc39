"""Flash (online-softmax) attention: never holds a [queries, keys] scores block (pure functions).

For query i of head h (kv head h // G, G = H / KV) and key slots j = 0 .. S_k-1:

    s_ij  = scale * <q_i, k_j>                 (fp32)       keep_ij = causal & padding & block mask
    m_i   = max_{j kept} s_ij ,   l_i = sum_{j kept} exp(s_ij - m_i)
    o_i   = sum_{j kept} exp(s_ij - m_i) v_j / l_i ,        lse_i = m_i + log l_i

computed per tile of `q_tile` queries by walking key tiles of `k_tile` slots and updating a running max
m, running sum l and running output acc (rescaled by exp(m_old - m_new) when the max grows). Only the key
tiles some query of the tile can see are visited (causality, padding, the indexer's block mask): for each
(batch row, kv head, query tile) the needed tiles are listed first and a while loop runs as many steps
as the largest list, so the work follows the visible tiles, not S_k.

Backward (FlashAttention-2): only o and lse are saved; per (query tile, visited key tile) the
probabilities are recomputed as p = exp(s - lse), and with D_i = <do_i, o_i>:
    dv_j += sum_i p_ij do_i ,   ds_ij = p_ij (<do_i, v_j> - D_i) ,   dq_i += scale sum_j ds_ij k_j ,
    dk_j += scale sum_i ds_ij q_i.

A query with no visible key gets, like the dense path (softmax over an all-`finfo.min` row), the plain
mean of v over all S_k slots (gradient 1/S_k to every v, none to q and k).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_NEG = jnp.finfo(jnp.float32).min


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, positions: jax.Array | None = None,
                    causal: bool = True, key_valid: jax.Array | None = None, block_mask: jax.Array | None = None,
                    block_size: int | None = None, q_tile: int = 128, k_tile: int = 128) -> jax.Array:
    """softmax(scale q k^T, masked) v without a [S, S_k] block; q [B, S, H, D], k/v [B, S_k, KV, D] -> [B, S, H, D].

    positions [B, S] (int): with causal, query i sees key slot j only if j <= positions[b, i] (default 0..S-1;
    a decode step passes its slots); ignored when causal is False.
    key_valid [B, S_k] bool: False slots (padding) are hidden from every query.
    block_mask [B, Hb, S, nb] bool with `block_size` slots per block (Hb divides H; query head h reads
    block_mask[:, h // (H / Hb)]): query i sees slot j only if block_mask[b, ., i, j // block_size].
    GQA: query head h reads kv head h // (H / KV) (K and V are never repeated).
    Logits, softmax and accumulation in fp32; probabilities cast to v's dtype before the value product;
    the output in v's dtype. q_tile / k_tile need not divide S / S_k (the tail is padded).
    """
    b, s, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    tq, tk = max(1, min(q_tile, s)), max(1, min(k_tile, sk))
    nq, nk = -(-s // tq), -(-sk // tk)
    if causal and positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if not causal:
        positions = jnp.full((b, s), sk, jnp.int32)  # every slot <= position
    if key_valid is None:
        key_valid = jnp.ones((b, sk), bool)
    # Padded query rows see nothing (position -1); padded key slots are invalid.
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, nq * tq - s)), constant_values=-1)
    kval = jnp.pad(key_valid.astype(bool), ((0, 0), (0, nk * tk - sk)))
    if block_mask is None:  # one block spanning every slot, kept
        hb, bs, bm = 1, nk * tk, jnp.ones((b, 1, nq * tq, 1), bool)
    else:
        if block_size is None:
            raise ValueError("block_mask needs block_size")
        hb, bs = block_mask.shape[1], block_size
        if h % hb:
            raise ValueError(f"{h} query heads are not a multiple of {hb} block-mask heads")
        bm = jnp.pad(block_mask.astype(bool), ((0, 0), (0, 0), (0, nq * tq - s), (0, 0)))
    tiles, count = visited_key_tiles(pos, kval, bm, bs, tq, tk, nq, nk, h, kvh)
    return _flash(_Static(s, sk, tq, tk, bs, float(scale)), q, k, v, (pos, kval, bm, tiles, count))


class _Static(tuple):
    """Hashable static configuration: (S, S_k, q_tile, k_tile, block_size, scale)."""

    def __new__(cls, *a):
        return super().__new__(cls, a)


def _head_map(h: int, kvh: int, hb: int) -> np.ndarray:
    """[KV, G] block-mask head of query head kv * G + g."""
    return (np.arange(h) // (h // hb)).reshape(kvh, h // kvh)


def visited_key_tiles(pos, kval, bm, bs, tq, tk, nq, nk, h, kvh):
    """Per (batch, kv head, query tile): the key tiles some query of the tile can see, in order, first in
    `tiles` [B, KV, nq, nk], and how many there are, `count` [B, KV, nq] (the loop over a query tile runs
    max over (batch, kv head) of count steps).

    pos [B, nq*tq] query positions (-1: padding), kval [B, nk*tk] valid key slots, bm [B, Hb, nq*tq, nb]
    block mask with bs slots per block; tq / tk queries / keys per tile; h / kvh query / kv heads."""
    b = pos.shape[0]
    hb, nb = bm.shape[1], bm.shape[-1]
    pos_max = pos.reshape(b, nq, tq).max(-1)  # [B, nq]
    causal = (jnp.arange(nk) * tk)[None, None, :] <= pos_max[:, :, None]  # [B, nq, nk]
    valid = kval.reshape(b, nk, tk).any(-1)  # [B, nk]
    bq = bm.reshape(b, hb, nq, tq, nb).any(3)  # [B, Hb, nq, nb]
    if bs % tk == 0:  # each key tile lies in one block
        blk = bq[..., np.minimum(np.arange(nk) * tk // bs, nb - 1)]
    elif tk % bs == 0:  # each key tile covers tk / bs whole blocks
        per = tk // bs
        bq = bq[..., : nk * per] if nb >= nk * per else jnp.pad(bq, ((0, 0),) * 3 + ((0, nk * per - nb),))
        blk = bq.reshape(b, hb, nq, nk, per).any(-1)
    else:  # through the slots: [B, Hb, nq, nk * tk]
        slot_block = np.minimum(np.arange(nk * tk) // bs, nb - 1)
        blk = bq[..., slot_block].reshape(b, hb, nq, nk, tk).any(-1)  # [B, Hb, nq, nk]
    blk = blk[:, _head_map(h, kvh, hb)].any(2)  # [B, KV, nq, nk]
    need = blk & causal[:, None] & valid[:, None, None, :]
    tiles = jnp.argsort(~need, axis=-1, stable=True).astype(jnp.int32)
    return tiles, need.sum(-1).astype(jnp.int32)


def _tile_keep(st, pos_t, kval, bm_t, hmap, idx, active):
    """[B, KV, G, tq, tk] keep-mask of key tile idx [B, KV] for the query tile (pos_t [B, tq],
    bm_t [B, Hb, nb, tq]: read only at this tile's blocks and the kv head's query heads)."""
    _, sk, _, tk, bs, _ = st
    slot = idx[..., None] * tk + jnp.arange(tk)  # [B, KV, tk]
    ok = (slot < sk) & jnp.take_along_axis(kval[:, None, :], slot, axis=2) & active[..., None]
    keep = ok[:, :, None, None, :] & (slot[:, :, None, None, :] <= pos_t[:, None, None, :, None])
    blocks = jnp.minimum(slot // bs, bm_t.shape[-2] - 1)  # [B, KV, tk]
    rows = jnp.arange(blocks.shape[0])[:, None, None, None]
    tok = bm_t[rows, hmap[None, :, :, None], blocks[:, :, None, :]]  # [B, KV, G, tk, tq]
    return keep & jnp.swapaxes(tok, -1, -2)


def _layout(st, q, k, v):
    """Tiled views: q [nq, B, KV, G, tq, D], k/v [B, KV, nk, tk, D]."""
    s, sk, tq, tk = st[0], st[1], st[2], st[3]
    b, _, h, d = q.shape
    kvh = k.shape[2]
    nq, nk = -(-s // tq), -(-sk // tk)
    qp = jnp.pad(q, ((0, 0), (0, nq * tq - s), (0, 0), (0, 0))).reshape(b, nq, tq, kvh, h // kvh, d)
    qt = qp.transpose(1, 0, 3, 4, 2, 5)

    def kvt(a):
        a = jnp.pad(a, ((0, 0), (0, nk * tk - sk), (0, 0), (0, 0))).reshape(b, nk, tk, kvh, d)
        return a.transpose(0, 3, 1, 2, 4)

    return qt, kvt(k), kvt(v)


def _gather_tile(a, idx):
    """a [B, KV, nk, tk, D], idx [B, KV] -> [B, KV, tk, D]."""
    return jnp.take_along_axis(a, idx[:, :, None, None, None], axis=2)[:, :, 0]


def _visit(st, qi, kt, vt, kval, hmap, pos_t, bm_t, idx, active):
    """One key tile idx [B, KV] for query tile qi [B, KV, G, tq, D]: (keep mask, K tile, V tile, fp32 scores
    scale * q k^T), what the forward and the backward (which recomputes the scores) both start from."""
    keep = _tile_keep(st, pos_t, kval, bm_t, hmap, idx, active)
    kj, vj = _gather_tile(kt, idx), _gather_tile(vt, idx)
    sc = jnp.einsum("bkgqd,bktd->bkgqt", qi, kj, preferred_element_type=jnp.float32) * st[5]
    return keep, kj, vj, sc


def _xs(st, aux):
    pos, kval, bm, tiles, count = aux
    tq = st[2]
    nq = tiles.shape[2]
    b, hb, _, nb = bm.shape
    pos_t = pos.reshape(b, nq, tq).transpose(1, 0, 2)
    bm_t = bm.reshape(b, hb, nq, tq, nb).transpose(2, 0, 1, 4, 3)  # [nq, B, Hb, nb, tq]
    return pos_t, bm_t, tiles.transpose(2, 0, 1, 3), count.transpose(2, 0, 1)


def _forward(st, q, k, v, aux):
    s, sk, tq, tk, bs, _ = st
    b, _, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    hmap = _head_map(h, kvh, aux[2].shape[1])
    kval = aux[1]
    qt, kt, vt = _layout(st, q, k, v)
    mean_v = v.astype(jnp.float32).mean(axis=1)  # [B, KV, D]: a query with no visible key

    def q_step(_, xs):
        qi, pos_t, bm_t, tiles, count = xs

        def k_step(t, carry):
            m, l, acc = carry
            keep, kj, vj, sc = _visit(st, qi, kt, vt, kval, hmap, pos_t, bm_t, tiles[:, :, t], t < count)
            sc = jnp.where(keep, sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(sc - m_new[..., None])
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + jnp.einsum("bkgqt,bktd->bkgqd", p.astype(v.dtype), vj,
                                                      preferred_element_type=jnp.float32)
            return m_new, l, acc

        init = (jnp.full((b, kvh, g, tq), _NEG, jnp.float32), jnp.zeros((b, kvh, g, tq), jnp.float32),
                jnp.zeros((b, kvh, g, tq, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, count.max(), k_step, init)
        seen = l > 0
        o = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], mean_v[:, :, None, None, :])
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        return None, (o.astype(v.dtype), lse, seen)

    _, (o, lse, seen) = jax.lax.scan(q_step, None, (qt, *_xs(st, aux)))
    return o, lse, seen  # [nq, B, KV, G, tq, (D)]


def _untile(o, s):
    """[nq, B, KV, G, tq, D] -> [B, S, H, D]."""
    nq, b, kvh, g, tq, d = o.shape
    return o.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * tq, kvh * g, d)[:, :s]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, aux):
    return _untile(_forward(st, q, k, v, aux)[0], st[0])


def _flash_fwd(st, q, k, v, aux):
    o, lse, seen = _forward(st, q, k, v, aux)
    return _untile(o, st[0]), (q, k, v, o, lse, seen, aux)


def _flash_bwd(st, res, do):
    s, sk, tq, tk, bs, scale = st
    q, k, v, o, lse, seen, aux = res
    b, _, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    nk = -(-sk // tk)
    hmap = _head_map(h, kvh, aux[2].shape[1])
    kval = aux[1]
    qt, kt, vt = _layout(st, q, k, v)
    dot = _layout(st, do, k, v)[0]  # [nq, B, KV, G, tq, D]
    delta = jnp.sum(dot.astype(jnp.float32) * o.astype(jnp.float32), -1)  # [nq, B, KV, G, tq]

    def q_step(carry, xs):
        dk, dv = carry
        qi, doi, oi_delta, lse_i, pos_t, bm_t, tiles, count = xs

        def k_step(t, c):
            dq, dk, dv = c
            idx = tiles[:, :, t]
            keep, kj, vj, sc = _visit(st, qi, kt, vt, kval, hmap, pos_t, bm_t, idx, t < count)
            p = jnp.where(keep, jnp.exp(sc - lse_i[..., None]), 0.0)
            dv_j = jnp.einsum("bkgqt,bkgqd->bktd", p.astype(v.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqd,bktd->bkgqt", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - oi_delta[..., None]) * scale
            dq = dq + jnp.einsum("bkgqt,bktd->bkgqd", ds, kj.astype(jnp.float32))
            dk_j = jnp.einsum("bkgqt,bkgqd->bktd", ds, qi.astype(jnp.float32))
            rows, heads = jnp.arange(b)[:, None], jnp.arange(kvh)[None, :]
            return dq, dk.at[rows, heads, idx].add(dk_j), dv.at[rows, heads, idx].add(dv_j)

        dq0 = jnp.zeros((b, kvh, g, tq, d), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(0, count.max(), k_step, (dq0, dk, dv))
        return (dk, dv), dq

    zeros = jnp.zeros((b, kvh, nk, tk, d), jnp.float32)
    (dk, dv), dq = jax.lax.scan(q_step, (zeros, zeros), (qt, dot, delta, lse, *_xs(st, aux)))
    # Queries with no visible key output mean(v): each of the S_k slots gets 1/S_k of their do.
    blind = jnp.sum(jnp.where(seen[..., None], 0.0, dot.astype(jnp.float32)), axis=(0, 3, 4))  # [B, KV, D]
    dk, dv = (a.transpose(0, 2, 3, 1, 4).reshape(b, nk * tk, kvh, d)[:, :sk] for a in (dk, dv))
    dv = dv + (blind / sk)[:, None]
    return _untile(dq, s).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)
