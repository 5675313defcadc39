"""Sparse layers that read only the kept key blocks (m3jax.model.sparse) against the masked reference.

The reference is `masked_attention`: dense scores with the indexer's selection as a mask (what HF does).
Both implementations of the gather path (per-tile gathers under a custom VJP for meshes, grouped
matmuls on one device) must give its values and q/k/v gradients to fp32 rounding, for GQA shapes, key
padding, sequences not a multiple of the block size, more than one local block and queries that see no
key at all.
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.model import attention
from m3jax.model.indexer import block_ids_to_mask, key_block_scores, select_key_blocks, topk_key_blocks
from m3jax.model.sparse import head_units, sparse_layer_attention

TOL = 1e-5


def _inputs(b, s, h, kv, hi, di=8, d=16, seed=0):
    r = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)  # noqa: E731
    return f(b, s, h, d), f(b, s, kv, d), f(b, s, kv, d), f(b, s, hi, di), f(b, s, di)


def _rel(a, b):
    return float(jnp.abs(a - b).max() / jnp.abs(a).max())


CASES = [  # b, s, h, kv, hi, tile, local blocks
    (2, 50, 4, 2, 2, 64, 1),   # S not a multiple of the block size (8), one tile
    (2, 70, 4, 1, 2, 16, 1),   # more index heads than kv heads, tiles not dividing S
    (1, 33, 6, 3, 1, 8, 2),    # one index head over 3 kv heads, two forced local blocks
    (2, 64, 4, 2, 4, 32, 1),   # index heads = query heads
]


def _grid():
    """Every case with both implementations (jitted, a few seconds each)."""
    for i, c in enumerate(CASES):
        for grouped in (False, True):
            kept = True
            name = f"b{c[0]}s{c[1]}h{c[2]}kv{c[3]}hi{c[4]}t{c[5]}l{c[6]}-{'grouped' if grouped else 'gathered'}"
            yield pytest.param(c, grouped, id=name, marks=() if kept else (pytest.mark.extended, pytest.mark.slow))


@pytest.mark.parametrize("case,grouped", list(_grid()))
def test_values_and_gradients_equal_the_masked_path(case, grouped):
    b, s, h, kv, hi, tile, local = case
    cfg = SimpleNamespace(index_block_size=8, index_topk_blocks=3, index_local_blocks=local, head_dim=16,
                          num_attention_heads=h)
    q, k, v, iq, ik = _inputs(b, s, h, kv, hi)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    # Row 1: the last 5 slots are padding; row 0 (b = 2): slots 8..23 are, so that queries 8..15 (block 1,
    # the local one) may keep only invalid or future slots when their other picks are invalid too.
    valid = np.ones((b, s), bool)
    valid[-1, s - 5:] = False
    if b == 2:
        valid[0, 8:24] = False
    valid = jnp.asarray(valid)

    def ref(q, k, v):
        return attention.masked_attention(q, k, v, pos, valid, iq, ik, cfg)

    def new(q, k, v):
        return sparse_layer_attention(q, k, v, pos, valid, iq, ik, cfg, to_chunks=attention._to_chunks,
                                      from_chunks=attention._from_chunks, tile=tile, grouped=grouped)

    assert _rel(jax.jit(ref)(q, k, v), jax.jit(new)(q, k, v)) < TOL
    # jitted: op by op, the gathered path's loops took ~11 s per case
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))(q, k, v)  # noqa: E731
    for g_ref, g_new, name in zip(grad(ref), grad(new), "qkv"):
        assert _rel(g_ref, g_new) < TOL, name


@pytest.mark.slow  # two compiles of the layer; the fast loop keeps the padded parity cases
def test_a_query_that_sees_no_key_gets_the_mean_of_v_like_the_masked_path():
    """Keys 0..15 padding: queries 0..15 see nothing (their picks hold only padding or future slots)."""
    b, s, h, kv, hi = 1, 40, 2, 1, 1
    cfg = SimpleNamespace(index_block_size=8, index_topk_blocks=2, index_local_blocks=1, head_dim=16,
                          num_attention_heads=h)
    q, k, v, iq, ik = _inputs(b, s, h, kv, hi, seed=3)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    valid = jnp.arange(s)[None] >= 16
    ref = jax.jit(lambda *a: attention.masked_attention(*a, cfg))(q, k, v, pos, valid, iq, ik)
    for grouped in (False, True):  # jitted: op by op, the layer's loops took ~10 s
        out = jax.jit(lambda *a, grouped=grouped: sparse_layer_attention(
            *a, cfg, to_chunks=attention._to_chunks, from_chunks=attention._from_chunks, tile=8,
            grouped=grouped))(q, k, v, pos, valid, iq, ik)
        np.testing.assert_allclose(out[0, :16], jnp.broadcast_to(v.mean(1)[:, None], (1, 16, h, 16))[0],
                                   rtol=1e-6, atol=1e-6)
        assert _rel(ref, out) < TOL


def test_top_k_ids_give_the_indexer_mask_and_drop_fully_future_blocks():
    b, s, hi = 2, 45, 2
    _, _, _, iq, ik = _inputs(b, s, 2, 1, hi, seed=1)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    ids = topk_key_blocks(iq, ik, pos, block_size=8, topk_blocks=3, local_blocks=1)
    assert ids.shape == (b, hi, s, 3) and ids.dtype == jnp.int32
    # The first block's queries have one past block: the other two picks are dropped (-1).
    assert bool((ids[:, :, :8, 0] == 0).all()) and bool((ids[:, :, :8, 1:] == -1).all())
    # Never a block that starts after the query; the query's own block always kept.
    kept = np.asarray(ids)
    own = np.asarray(pos)[:, None, :] // 8
    assert ((kept == -1) | (kept * 8 <= np.asarray(pos)[:, None, :, None])).all()
    assert (kept == own[..., None]).any(-1).all()
    mask = select_key_blocks(iq, ik, pos, block_size=8, topk_blocks=3, local_blocks=1)
    np.testing.assert_array_equal(mask, block_ids_to_mask(ids, 6))
    scores = key_block_scores(iq, ik, pos, block_size=8, local_blocks=1)
    top = jax.lax.top_k(scores, 3)[1]
    np.testing.assert_array_equal(np.where(kept >= 0, kept, top), top)


def test_replayed_block_ids_give_the_same_output_and_are_what_it_returns():
    b, s, h, kv, hi = 2, 48, 4, 2, 2
    cfg = SimpleNamespace(index_block_size=8, index_topk_blocks=2, index_local_blocks=1, head_dim=16,
                          num_attention_heads=h)
    q, k, v, iq, ik = _inputs(b, s, h, kv, hi, seed=2)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    kw = dict(to_chunks=attention._to_chunks, from_chunks=attention._from_chunks, tile=16)
    out, ids = sparse_layer_attention(q, k, v, pos, None, iq, ik, cfg, return_block_ids=True, **kw)
    expect = jnp.moveaxis(topk_key_blocks(iq, ik, pos, block_size=8, topk_blocks=2, local_blocks=1), 1, 2)
    np.testing.assert_array_equal(ids, expect)
    replayed = sparse_layer_attention(q, k, v, pos, None, None, None, cfg, block_ids=ids, **kw)
    np.testing.assert_array_equal(out, replayed)


def test_head_units_pair_each_query_head_with_its_kv_and_index_head():
    kv_of, idx_of = head_units(8, 2, 4)  # 4 units of 2 query heads
    np.testing.assert_array_equal(kv_of, [0, 0, 1, 1])
    np.testing.assert_array_equal(idx_of, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="lcm"):
        head_units(6, 2, 4)


@pytest.mark.parametrize("grouped", [pytest.param(False, marks=[pytest.mark.extended, pytest.mark.slow]), True], ids=["gathered", "grouped"])
def test_temp_memory_grows_linearly_in_s(grouped):
    """Compiled temp memory of forward+backward at S and 4S: x4-ish (linear), not x16 (an [S, S] term)."""
    cfg = SimpleNamespace(index_block_size=64, index_topk_blocks=4, index_local_blocks=1, head_dim=64,
                          num_attention_heads=4)

    def temp(s):
        q, k, v, iq, ik = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _inputs(1, s, 4, 2, 2, di=16, d=64))
        pos = jnp.broadcast_to(jnp.arange(s), (1, s))

        def loss(q, k, v, iq, ik):
            return sparse_layer_attention(q, k, v, pos, None, iq, ik, cfg, to_chunks=attention._to_chunks,
                                          from_chunks=attention._from_chunks, grouped=grouped).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(q, k, v, iq, ik).compile().memory_analysis().temp_size_in_bytes

    small, large = temp(1024), temp(4096)
    assert large / small < 6, (small, large)
