"""Block-sparse attention that reads only the key blocks the indexer kept (pure functions).

For query i, query head h and the blocks ids[b, h // (H / Hi), i, :] (`topk_key_blocks`; -1 = none):

    keys(i, h) = { j : j // bs in ids, j <= position_i, key_valid_j }
    o_ih       = sum_{j in keys} softmax_j(scale * <q_ih, k_j>) v_j

the same numbers as the masked path (`masked_attention`: a softmax over every slot with the others set
to finfo.min, whose exp is exactly 0), but each query multiplies K * bs keys instead of S_k. A query
with no visible key gets, like the masked path, the mean of v over all S_k slots.

Query heads are grouped into units that share both their kv head and their index head (U = lcm(Hi, KV)
units of H / U heads), so a gathered block of keys serves every query head of its unit at once.
`sparse_layer_attention` walks the queries in tiles twice: a first scan runs the indexer (its
[Hi, tile, S_k] scores live per tile; no gradient, so never recomputed) and keeps the block ids, a
second scan attends (custom VJP): per tile the gathered [U, tile, K * bs, D] keys and values and the
[H, tile, K * bs] probabilities are live, linear in S. Only the output's log-sum-exp is saved; the
backward recomputes each tile's probabilities and scatter-adds its key and value gradients into fp32
[B, nb, bs, KV, D] accumulators block by block (FlashAttention-2's backward, on gathered keys):
    dv_j += sum_i p_ij do_i ,  dp_ij = <do_i, v_j> ,  ds_ij = p_ij (dp_ij - sum_j' p_ij' dp_ij') ,
    dq_i = scale sum_j ds_ij k_j ,  dk_j += scale sum_i ds_ij q_i
(the row sum of p dp rather than <do, o>, so that a bf16 run differentiates exactly what it computed).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from m3jax.model.indexer import topk_key_blocks
from m3jax.model.softmax import softmax
from sharding.layout import platform

_MASKED = jnp.finfo(jnp.float32).min
QUERY_TILE = 64  # local queries per step of the per-tile gather scan (`_gathered`)
INDEX_QUERY_TILE = 128  # local queries per step of the indexer: with 16-block key chunks the fastest on CPU at 4k-16k
SLOT_ELEMENTS = 1 << 24  # gathered key + value elements per step of `slot_block_attention` (64 MB in fp32)
GROUPED_TILE = 128  # rows per tile of the grouped path's matmuls
PATHS = ("tiles", "grouped", "slots")
# The name `select_blocks` gives its block ids: every remat policy keeps them (`m3jax.model.decoder.
# remat_policy_fn`), so a rematerialised layer's backward reuses the forward's selection instead of running
# the indexer's scores and top-k again ([B, S, Hi, K] int32, no gradient).
INDEX_BLOCK_IDS = "index_block_ids"


def head_units(h: int, kvh: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(kv head, index head) of each unit, [U] each: unit u holds query heads u*(H/U) .. (u+1)*(H/U)-1."""
    u = math.lcm(kvh, hi)
    if h % u:
        raise ValueError(f"{h} query heads do not split into lcm({kvh} kv heads, {hi} index heads) = {u} groups")
    return np.arange(u) // (u // kvh), np.arange(u) // (u // hi)


def block_view(a: jax.Array, block_size: int) -> jax.Array:
    """[B, S_k, KV, D] -> [B, nb, bs, KV, D] in a's dtype, the slots past S_k zero (masked by slot < S_k).

    A reshape, free when bs divides S_k: the key blocks are gathered from it as they lie (`gather_blocks`), so a
    decode step reads only the blocks it selected, straight from the stacked cache. Transposed to [B, KV, nb,
    bs, D] and cast to fp32 first, every step copied the layer's whole cache (BENCHMARKS.md, session 29)."""
    b, sk = a.shape[:2]
    nb = -(-sk // block_size)
    if nb * block_size != sk:
        a = jnp.pad(a, ((0, 0), (0, nb * block_size - sk)) + ((0, 0),) * (a.ndim - 2))
    return a.reshape(b, nb, block_size, *a.shape[2:])


def gather_blocks(blocks: jax.Array, heads: jax.Array, ids: jax.Array) -> jax.Array:
    """blocks [B, nb, bs, KV, D] (`block_view`), heads (kv head of each id, broadcastable to ids) and ids [B, ...]
    (block ids in range) -> [B, ..., bs, D]: block ids[b, ...] of kv head heads[...], its bs slots in order."""
    rows = jnp.arange(blocks.shape[0]).reshape(-1, *(1,) * (ids.ndim - 1))
    return blocks[rows, ids, :, heads]


class _Static(tuple):
    """Hashable static configuration: (key_len, block_size, scale, dtype name, kv head of each unit,
    index head of each unit)."""

    def __new__(cls, *a):
        return super().__new__(cls, a)


def _kept_slots(st, kval_blocks, pos, ids):
    """(keep [B, U, T, K, bs]: slot j of each selected block is valid, < key_len and <= the query's position;
    clipped ids [B, U, T, K]); pos [B, T], ids [B, T, Hi, K] (-1 = none)."""
    key_len, bs, idx_of = st[0], st[1], np.asarray(st[5])
    ids = jnp.moveaxis(ids, 1, 2)[:, idx_of]  # [B, U, T, K]
    safe = jnp.clip(ids, 0, kval_blocks.shape[1] - 1)
    slot = safe[..., None] * bs + jnp.arange(bs)
    rows = jnp.arange(pos.shape[0])[:, None, None, None]
    keep = (ids >= 0)[..., None] & kval_blocks[rows, safe] & (slot < key_len) & (slot <= pos[:, None, :, None, None])
    return keep, safe


def _gather_tile(st, kb, vb, kval_blocks, pos, ids):
    """One tile's gathered keys/values [B, U, T, K*bs, D] (in st's dtype), keep mask [B, U, 1, T, K*bs], and
    the clipped ids [B, U, T, K]; pos [B, T], ids [B, T, Hi, K] (-1 = none)."""
    bs, dtype, kv_of = st[1], jnp.dtype(st[3]), np.asarray(st[4])
    b, t = pos.shape
    d = kb.shape[-1]
    keep, safe = _kept_slots(st, kval_blocks, pos, ids)
    u, kk = safe.shape[1], safe.shape[-1]
    heads = jnp.asarray(kv_of)[None, :, None, None]
    kg = gather_blocks(kb, heads, safe).astype(dtype).reshape(b, u, t, kk * bs, d)
    vg = gather_blocks(vb, heads, safe).astype(dtype).reshape(b, u, t, kk * bs, d)
    return kg, vg, keep.reshape(b, u, 1, t, kk * bs), safe


def _tile_logits(st, q, kg, keep):
    """q [B, T, H, D] -> masked fp32 logits [B, U, G, T, K*bs] (finfo.min where not kept, as the masked path)."""
    b, t, h, d = q.shape
    u = kg.shape[1]
    qu = q.reshape(b, t, u, h // u, d)
    logits = jnp.einsum("btugd,butjd->bugtj", qu, kg, preferred_element_type=jnp.float32) * st[2]
    return jnp.where(keep, logits, _MASKED)


def _forward(st, q, kb, vb, aux):
    """Scan over tiles: q [n, B, T, H, D] -> (o [n, B, T, H, D], lse [n, B, U, G, T])."""
    kval_blocks, pos, ids = aux

    def step(_, xs):
        qi, pi, ii = xs
        kg, vg, keep, _ = _gather_tile(st, kb, vb, kval_blocks, pi, ii)
        logits = _tile_logits(st, qi, kg, keep)
        lse = jax.nn.logsumexp(logits, axis=-1)
        probs = jnp.exp(logits - lse[..., None]).astype(vg.dtype)
        o = jnp.einsum("bugtj,butjd->btugd", probs, vg).reshape(qi.shape)
        return None, (o, lse)

    return jax.lax.scan(step, None, (q, pos, ids))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gathered(st, q, kb, vb, aux):
    return _forward(st, q, kb, vb, aux)[0]


def _gathered_fwd(st, q, kb, vb, aux):
    o, lse = _forward(st, q, kb, vb, aux)
    return o, (q, kb, vb, lse, aux)


def _gathered_bwd(st, res, do):
    q, kb, vb, lse, aux = res
    kval_blocks, pos, ids = aux
    b, nb, bs, kvh, d = kb.shape
    kv_of = np.asarray(st[4])

    def step(carry, xs):
        dkb, dvb = carry
        qi, doi, lse_i, pi, ii = xs
        kg, vg, keep, safe = _gather_tile(st, kb, vb, kval_blocks, pi, ii)
        t, h = qi.shape[1], qi.shape[2]
        u, kk = kg.shape[1], safe.shape[-1]
        logits = _tile_logits(st, qi, kg, keep)
        p = jnp.where(keep, jnp.exp(logits - lse_i[..., None]), 0.0)  # [B, U, G, T, J]
        dou = doi.reshape(b, t, u, h // u, d)
        dv = jnp.einsum("bugtj,btugd->butjd", p.astype(vg.dtype), dou, preferred_element_type=jnp.float32)
        dp = jnp.einsum("btugd,butjd->bugtj", dou, vg, preferred_element_type=jnp.float32)
        ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * st[2]
        dq = jnp.einsum("bugtj,butjd->btugd", ds, kg.astype(jnp.float32)).reshape(qi.shape)
        dk = jnp.einsum("bugtj,btugd->butjd", ds, qi.reshape(dou.shape).astype(jnp.float32))
        rows, heads = jnp.arange(b)[:, None, None, None], jnp.asarray(kv_of)[None, :, None, None]
        dkb = dkb.at[rows, safe, :, heads].add(dk.reshape(b, u, t, kk, bs, d))
        dvb = dvb.at[rows, safe, :, heads].add(dv.reshape(b, u, t, kk, bs, d))
        return (dkb, dvb), dq.astype(qi.dtype)

    zeros = jnp.zeros((b, nb, bs, kvh, d), jnp.float32)
    (dkb, dvb), dq = jax.lax.scan(step, (zeros, zeros), (q, do, lse, pos, ids))
    return dq, dkb.astype(kb.dtype), dvb.astype(vb.dtype), None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def _head_blocks(a: jax.Array, kv_of: np.ndarray, block_size: int) -> jax.Array:
    """k or v [B, S_k, KV, D] -> [B * U * nb, bs, D] fp32: block n of unit u's kv head, group (b * U + u) * nb + n."""
    b, sk, _, d = a.shape
    nb = -(-sk // block_size)
    a = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, nb * block_size - sk), (0, 0), (0, 0)))
    a = a.reshape(b, nb, block_size, -1, d)[:, :, :, kv_of]  # [B, nb, bs, U, D]
    return a.transpose(0, 3, 1, 2, 4).reshape(-1, block_size, d)


@jax.custom_vjp
def _permute(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[perm] along the leading axis, perm a permutation and inverse its inverse (x[perm][inverse] = x).

    The gradient is the cotangent gathered by the inverse; autodiff's own transpose of the gather would be a
    scatter-add into a zero buffer (on XLA:CPU at S = 4096: 4-9 ms per scatter plus the 33 MB zero fill)."""
    return x[perm]


def _permute_fwd(x, perm, inverse):
    return x[perm], (perm, inverse)


def _permute_bwd(res, g):
    perm, inverse = res
    return g[inverse], np.zeros(perm.shape, jax.dtypes.float0), np.zeros(inverse.shape, jax.dtypes.float0)


_permute.defvjp(_permute_fwd, _permute_bwd)


def grouped_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, ids: jax.Array,
                            kv_of: np.ndarray, *, block_size: int, scale: float, kernel: str = "tiled") -> jax.Array:
    """Attention of q [B, S, H, D] over its selected blocks as two grouped matmuls (one device).

    Every (query, unit, selected block) pair is a row group of the H/U query heads; the pairs are sorted
    by (batch row, unit, block) so that each block's keys are a group's weights, as experts are in a MoE:
        scores = grouped_matmul(q rows, K blocks)  [pairs * H/U, bs]     (fp32)
        out    = sum over a query's K blocks of grouped_matmul(probs rows, V blocks^T)
    with the softmax over a query's K * bs slots in between, so a block's keys are read once per row
    tile, not once per query (`gathered` reads them per query). Work and memory follow S x K x bs.
    keep [B, U, S, K, bs] (`_kept_slots`), ids [B, U, S, K] clipped block ids, kv_of [U]. -> [B, S, H, D]
    (rows of a query that sees no key are a uniform average over its gathered slots: callers replace them).
    kernel: `sharding.grouped_matmul`'s; "tiled" (work follows the filled rows), since ragged_dot lowers
    densely (B * U * nb groups x all rows) on CPU and jaxlib 0.10 CUDA.
    """
    from sharding.grouped_matmul import grouped_matmul  # the model package does not import sharding at load

    b, s, h, d = q.shape
    u, kk, bs = ids.shape[1], ids.shape[-1], block_size
    nb = -(-k.shape[1] // bs)
    g = h // u
    group = ((jnp.arange(b)[:, None, None, None] * u + jnp.arange(u)[None, :, None, None]) * nb + ids).reshape(-1)
    order = jnp.argsort(group, stable=True)  # pairs (b, u, t, k) sorted by group
    inverse = jnp.argsort(order)
    sizes = jnp.bincount(group, length=b * u * nb) * g
    # Each query row once per selected block, in (b, u, t, k) order, then sorted: a broadcast and a permutation,
    # whose transposes are a sum over k and the inverse permutation (indexing by (b, t, u) transposed into a
    # scatter-add into zeros).
    rows = jnp.broadcast_to(jnp.moveaxis(q.reshape(b, s, u, g, d), 2, 1).astype(jnp.float32)[:, :, :, None],
                            (b, u, s, kk, g, d))
    rows = _permute(rows.reshape(-1, g * d), order, inverse).reshape(-1, d)  # [P * G, D]
    scores = grouped_matmul(rows, _head_blocks(k, kv_of, bs), sizes, kernel=kernel, tile=GROUPED_TILE) * scale
    scores = _permute(scores.reshape(-1, g * bs), inverse, order).reshape(b, u, s, kk, g, bs)
    scores = jnp.where(keep[:, :, :, :, None, :], scores, _MASKED)
    scores = jnp.moveaxis(scores, 4, 3).reshape(b, u, s, g, kk * bs)
    probs = softmax(scores).astype(v.dtype).astype(jnp.float32)
    probs = _permute(jnp.moveaxis(probs.reshape(b, u, s, g, kk, bs), 3, 4).reshape(-1, g * bs), order, inverse)
    probs = probs.reshape(-1, bs)
    out = grouped_matmul(probs, jnp.swapaxes(_head_blocks(v, kv_of, bs), 1, 2), sizes, kernel=kernel,
                         tile=GROUPED_TILE)
    out = _permute(out.reshape(-1, g * d), inverse, order).reshape(b, u, s, kk, g, d).sum(3)  # [B, U, S, G, D]
    return jnp.moveaxis(out, 1, 2).reshape(b, s, h, d).astype(v.dtype)


def one_device_path(topk_blocks: int, block_size: int, heads_per_unit: int, backend: str | None = None,
                    queries_per_key: float = 1.0) -> str:
    """The faster one-device sparse path for a model's shape on `backend` (default: jax's), for a step whose
    queries are `queries_per_key` times its key slots (1 for a whole sequence; 1 / S_max for a decode step).

    On CPU: "slots" when a key block's mean number of rows in the grouped matmul, K x bs x H/U x queries_per_key
    (over a whole sequence each block is picked by K x bs queries on average, each bringing its unit's H/U
    heads), is below one of its row tiles, else "grouped". Below a tile, the grouped path's walk multiplies a
    whole tile for every (tile, block) segment, about S / bs loop steps of mostly wasted rows, where the slot
    path runs a few batched matmuls (BENCHMARKS.md, issue 11: the tiny release-like model, 32 rows a block, and
    the sparse bench model, 1,024).
    Elsewhere (a GPU; TPUs too, unmeasured): "tiles", S / QUERY_TILE steps of batched gathers. The grouped walk
    is a while loop of S x H x K / GROUPED_TILE steps, each a few small kernels: 32,895 steps for gpu_check's M3
    slice at S 4,096 (64 heads, top-16), a loop whose cost on a GPU is its steps' launches, not its FLOPs. That
    slice's step took 18 s on an H200 (BENCHMARKS.md, session 25); compiled for that GPU it held 8 such loops,
    and 37 GB of temporaries against 26 on tiles. The slot path's steps there: S / 8.
    Over a whole sequence the choice depends on the config and the platform alone, never on S. A decode step
    (one query a row) brings a block a fraction of a row: the grouped walk then read the layer's whole cache to
    multiply a few rows, 3.2-4.5x slower than the slots on the sparse bench model at 1,024-4,096 slots
    (scripts/bench_decode_step.py, BENCHMARKS.md session 29). The paths agree to float rounding
    (tests/test_sparse_attention.py; a decode step against the full forward: tests/test_decode_reads.py)."""
    if platform(backend) != "cpu":
        return "tiles"
    rows = topk_blocks * block_size * heads_per_unit * queries_per_key
    return "slots" if rows < GROUPED_TILE else "grouped"


def slot_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, ids: jax.Array,
                         kv_of: np.ndarray, *, block_size: int, scale: float) -> jax.Array:
    """Attention of q [B, S, H, D] over its selected blocks, each query's K blocks gathered (one device):

        scores[b, u, i, g, k, j] = scale <q[b, i, u * G + g], K_(u)[ids[b, u, i, k] * bs + j]>   (fp32)
        out[b, i, u * G + g]     = sum_{k, j} softmax_{k, j}(scores, masked by keep) V_(u)[ids * bs + j]

    Each query is the batch element of its own [H/U, D] x [D, K bs] matmuls: a few batched ops however
    small the blocks, where the grouped path walks ~S / bs tiles. Work follows S x K x bs; the gathered
    keys and values (B U S K bs D each) are bounded by walking the queries in chunks of SLOT_ELEMENTS
    under a rematerialised map. keep [B, U, S, K, bs], ids [B, U, S, K] clipped block ids, kv_of [U].
    -> [B, S, H, D] (a query that sees no key gets a uniform average: callers replace it).
    """
    b, s, h, d = q.shape
    u, kk, bs = ids.shape[1], ids.shape[-1], block_size
    g = h // u
    kb, vb = block_view(k, bs), block_view(v, bs)
    heads_t = jnp.asarray(kv_of)[None, None, :, None]

    def attend(qc, keep_c, ids_c):  # [B, T, H, D], [B, U, T, K, bs], [B, U, T, K]
        # Query-major (b, t, u) order flattened into one batch dimension: XLA:CPU ran the same matmuls with
        # three batch dimensions (b, u, t) 2-4x slower, and q and the output need no transpose this way.
        t = qc.shape[1]
        n = b * t * u
        ids_t, keep_t = jnp.moveaxis(ids_c, 1, 2), jnp.moveaxis(keep_c, 1, 2)  # [B, T, U, K(, bs)]
        kg = gather_blocks(kb, heads_t, ids_t).astype(jnp.float32).reshape(n, kk * bs, d)  # each query's keys
        vg = gather_blocks(vb, heads_t, ids_t).astype(jnp.float32).reshape(n, kk * bs, d)
        qu = qc.astype(jnp.float32).reshape(n, g, d)
        scores = jax.lax.dot_general(qu, kg, (((2,), (2,)), ((0,), (0,)))) * scale  # [N, G, K bs]
        scores = jnp.where(keep_t.reshape(n, 1, kk * bs), scores, _MASKED)
        probs = softmax(scores).astype(v.dtype).astype(jnp.float32)
        return jax.lax.dot_general(probs, vg, (((2,), (1,)), ((0,), (0,)))).reshape(b, t, h, d)

    # The backward gathers the keys and values again rather than keeping them: they are K bs times k's and
    # v's size (16x in the tiny release-like model), and under the layer scan of a model without remat
    # XLA:CPU stacked and copied them per layer: 29.7 -> 18.9 ms for that model's fwd+bwd at S 256
    # (BENCHMARKS.md, session 28).
    attend = jax.checkpoint(attend)
    chunk = max(1, min(s, SLOT_ELEMENTS // (2 * b * u * kk * bs * d)))
    if chunk == s:
        return attend(q, keep, ids).astype(v.dtype)
    n = -(-s // chunk)  # padded queries attend to block 0 with nothing kept; their rows are dropped

    def split(a, axis):
        a = jnp.pad(a, [(0, n * chunk - s if i == axis else 0) for i in range(a.ndim)])
        return jnp.moveaxis(a.reshape(*a.shape[:axis], n, chunk, *a.shape[axis + 1:]), axis, 0)

    out = jax.lax.map(lambda xs: attend(*xs), (split(q, 1), split(keep, 2), split(ids, 2)))
    return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, h, d)[:, :s].astype(v.dtype)


def select_blocks(iq: jax.Array, ik: jax.Array, positions: jax.Array, cfg, *, to_chunks, from_chunks,
                  n_ctx: int = 1, tile: int = INDEX_QUERY_TILE) -> jax.Array:
    """`topk_key_blocks` a tile of `tile` local queries at a time (its [Hi, tile, S_k] scores are reduced
    to block maxima key chunk by key chunk): iq [B, S, Hi, Di], ik [B, S_k, Di] -> ids [B, S, Hi, K] int32,
    named `INDEX_BLOCK_IDS`."""
    chunk = min(tile, iq.shape[1] // n_ctx)

    def select(xs):
        return jnp.moveaxis(topk_key_blocks(xs[0], ik, xs[1], block_size=cfg.index_block_size,
                                            topk_blocks=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks), 1, 2)

    ids = jax.lax.map(select, (to_chunks(iq, n_ctx, chunk), to_chunks(positions, n_ctx, chunk)))
    return checkpoint_name(from_chunks(ids, n_ctx, iq.shape[1]), INDEX_BLOCK_IDS)


def sparse_layer_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                           key_valid: jax.Array | None, iq: jax.Array | None, ik: jax.Array | None, cfg, *,
                           to_chunks, from_chunks, n_ctx: int = 1, tile: int = QUERY_TILE, constrain=None,
                           block_ids: jax.Array | None = None, return_block_ids: bool = False,
                           path: str = "tiles"):
    """A sparse layer's attention: the indexer's top-K blocks per query, then attention over them only.

    q [B, S, H, D] local queries at `positions`, k/v [B, S_k, KV, D] every key slot, iq [B, S, Hi, Di],
    ik [B, S_k, Di]. block_ids [B, S, Hi, K] (replay): use these blocks instead of the indexer's.
    to_chunks / from_chunks / n_ctx: how the sequence splits into scan steps (`attention._to_chunks`:
    a step holds `tile` local queries of each of the n_ctx context shards); constrain(array, logical axes):
    the layout's sharding constraint for the chunked queries and output.
    path: "tiles", the per-tile `_gathered` scan (any layout: each tile is a batched gather); on one device
    "grouped" (`grouped_block_attention`: the whole sequence's pairs sorted together) or "slots"
    (`slot_block_attention`); `one_device_path` picks the faster of the two for a shape.
    A query that sees no key (its blocks hold no valid slot at or before its position) outputs the mean
    of v over all S_k slots, as the masked path's all-finfo.min softmax does.
    -> o [B, S, H, D] (and the ids used, [B, S, Hi, K] int32, -1 = none, with return_block_ids).
    """
    if path not in PATHS:
        raise ValueError(f"sparse attention path {path!r}: expected one of {PATHS}")
    b, s, h, _ = q.shape
    sk, kvh, bs = k.shape[1], k.shape[2], cfg.index_block_size
    if block_ids is None:
        ids = select_blocks(iq, ik, positions, cfg, to_chunks=to_chunks, from_chunks=from_chunks, n_ctx=n_ctx)
    else:
        ids = block_ids.astype(jnp.int32)
    ids = jax.lax.stop_gradient(ids)  # [B, S, Hi, K]
    kv_of, idx_of = head_units(h, kvh, ids.shape[2])
    st = _Static(sk, bs, float(cfg.head_dim ** -0.5), jnp.dtype(k.dtype).name, tuple(kv_of.tolist()),
                 tuple(idx_of.tolist()))
    kval = jnp.ones((b, sk), bool) if key_valid is None else key_valid.astype(bool)
    nb = -(-sk // bs)
    kval_blocks = jnp.pad(kval, ((0, 0), (0, nb * bs - sk))).reshape(b, nb, bs)
    keep, safe = _kept_slots(st, kval_blocks, positions, ids)  # [B, U, S, K, bs], [B, U, S, K]
    if path == "grouped":
        o = grouped_block_attention(q, k, v, keep, safe, kv_of, block_size=bs, scale=st[2], kernel="tiled")
    elif path == "slots":
        o = slot_block_attention(q, k, v, keep, safe, kv_of, block_size=bs, scale=st[2])
    else:
        constrain = constrain or (lambda a, axes: a)
        chunked = (None, "act_batch", "act_seq", "act_heads", None)
        chunk = min(tile, s // n_ctx)
        pos_c, ids_c = to_chunks(positions, n_ctx, chunk), to_chunks(ids, n_ctx, chunk)
        kb, vb = block_view(k, bs), block_view(v, bs)
        o = _gathered(st, constrain(to_chunks(q, n_ctx, chunk), chunked), kb, vb, (kval_blocks, pos_c, ids_c))
        o = from_chunks(constrain(o, chunked), n_ctx, s)
    # A query that sees no key: the mean of v over all S_k slots, as the masked path. That mean reads every slot.
    # Without a padding mask no query of the indexer's own selection is blind (a selected block with a finite
    # score holds a visible slot, and the query's own block has one), so a decode step skips it.
    if key_valid is not None or block_ids is not None:
        seen = jnp.moveaxis(keep.any(axis=(3, 4)), 1, 2)[..., None, None]  # [B, S, U, 1, 1]
        blind = v.astype(jnp.float32).mean(axis=1).astype(o.dtype)[:, kv_of]  # [B, U, D]
        o = jnp.where(seen, o.reshape(b, s, len(kv_of), h // len(kv_of), -1), blind[:, None, :, None, :])
    o = o.reshape(b, s, h, -1)
    return (o, ids) if return_block_ids else o
