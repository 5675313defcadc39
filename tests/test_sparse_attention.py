"""Sparse layers that read only the kept key blocks (m3jax.model.sparse) against the masked reference.

The reference is `masked_attention`: dense scores with the indexer's selection as a mask (what HF does).
Every implementation of the gather path (per-tile gathers under a custom VJP for meshes; grouped
matmuls or per-query gathered slots on one device) must give its values and q/k/v gradients to fp32
rounding, for GQA shapes, key padding, sequences not a multiple of the block size, more than one local
block and queries that see no key at all.
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.model import attention
from m3jax.model.indexer import block_ids_to_mask, key_block_scores, select_key_blocks, topk_key_blocks
from m3jax.model import sparse
from m3jax.model.sparse import PATHS, head_units, one_device_path, slot_block_attention, sparse_layer_attention

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
    """Every case with every implementation (jitted, a few seconds each)."""
    for c in CASES:
        for path in PATHS:
            yield pytest.param(c, path, id=f"b{c[0]}s{c[1]}h{c[2]}kv{c[3]}hi{c[4]}t{c[5]}l{c[6]}-{path}")


@pytest.mark.parametrize("case,path", list(_grid()))
def test_values_and_gradients_equal_the_masked_path(case, path):
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
                                      from_chunks=attention._from_chunks, tile=tile, path=path)

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
    for path in PATHS:  # jitted: op by op, the layer's loops took ~10 s
        out = jax.jit(lambda *a, path=path: sparse_layer_attention(
            *a, cfg, to_chunks=attention._to_chunks, from_chunks=attention._from_chunks, tile=8,
            path=path))(q, k, v, pos, valid, iq, ik)
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


@pytest.mark.parametrize("path", [pytest.param("tiles", marks=[pytest.mark.extended, pytest.mark.slow]), "grouped",
                                  "slots"])
def test_temp_memory_grows_linearly_in_s(path):
    """Compiled temp memory of forward+backward at S and 4S: x4-ish (linear), not x16 (an [S, S] term)."""
    cfg = SimpleNamespace(index_block_size=64, index_topk_blocks=4, index_local_blocks=1, head_dim=64,
                          num_attention_heads=4)

    def temp(s):
        q, k, v, iq, ik = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _inputs(1, s, 4, 2, 2, di=16, d=64))
        pos = jnp.broadcast_to(jnp.arange(s), (1, s))

        def loss(q, k, v, iq, ik):
            return sparse_layer_attention(q, k, v, pos, None, iq, ik, cfg, to_chunks=attention._to_chunks,
                                          from_chunks=attention._from_chunks, path=path).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(q, k, v, iq, ik).compile().memory_analysis().temp_size_in_bytes

    small, large = temp(1024), temp(4096)
    assert large / small < 6, (small, large)


def _slot_inputs(b=2, s=40, h=4, kvh=2, kk=2, bs=8, d=16, seed=5):
    r = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(r.normal(size=(b, s, n, d)), jnp.float32) for n in (h, kvh, kvh))
    u = kvh
    ids = jnp.asarray(r.integers(0, -(-s // bs), (b, u, s, kk)), jnp.int32)
    keep = jnp.asarray(r.random((b, u, s, kk, bs)) > 0.3)
    return q, k, v, keep, ids, np.arange(u)


def test_slot_path_in_query_chunks_equals_one_chunk(monkeypatch):
    """Past SLOT_ELEMENTS gathered elements the queries are walked in chunks (padding the last one): the same
    values and gradients to fp32 rounding (XLA:CPU vectorises the softmax's exp and sums by shape, so not
    bit for bit)."""
    q, k, v, keep, ids, kv_of = _slot_inputs()

    def results():  # a new function each time, so that jit traces it again under the patched constant
        def run(q, k, v):
            return slot_block_attention(q, k, v, keep, ids, kv_of, block_size=8, scale=0.25)

        grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(run(*a))), argnums=(0, 1, 2)))(q, k, v)
        return jax.jit(run)(q, k, v), grads, "scan" in str(jax.make_jaxpr(run)(q, k, v))

    whole, whole_grads, walked = results()
    assert not walked
    per_query = 2 * 2 * 2 * 2 * 8 * 16  # 2 (k and v) x B x U x K x bs x D
    monkeypatch.setattr(sparse, "SLOT_ELEMENTS", per_query * 16)  # chunks of 16 queries: 16, 16, 8 (+8 padding)
    chunked, chunked_grads, walked = results()
    assert walked
    assert _rel(whole, chunked) < 1e-6
    for a, b in zip(chunked_grads, whole_grads):
        assert _rel(b, a) < 1e-6


def test_one_device_path_follows_the_rows_a_block_brings_and_unknown_paths_are_refused():
    assert one_device_path(2, 8, 2) == "slots"  # the tiny release-like model: 32 rows a block
    assert one_device_path(4, 64, 4) == "grouped"  # the sparse bench model: 1,024
    assert one_device_path(2, 32, 2) == "grouped"  # exactly one 128-row tile
    # on a GPU the per-tile gathers: the grouped walk is a loop of ~S H K / 128 launch-bound steps
    assert one_device_path(16, 128, 16, backend="gpu") == one_device_path(2, 8, 2, backend="cuda") == "tiles"
    q, k, v, iq, ik = _inputs(1, 16, 2, 1, 1)
    cfg = SimpleNamespace(index_block_size=8, index_topk_blocks=1, index_local_blocks=1, head_dim=16)
    with pytest.raises(ValueError, match="sparse attention path 'dense'"):
        sparse_layer_attention(q, k, v, jnp.arange(16)[None], None, iq, ik, cfg, to_chunks=attention._to_chunks,
                               from_chunks=attention._from_chunks, path="dense")


@pytest.mark.parametrize("chunked", [False, True])
def test_block_scores_without_forced_local_blocks_match_a_causal_reference(monkeypatch, chunked):
    """index_local_blocks = 0 (allowed by the config) forces no block, so the query's own block competes on its
    scores: the query's own key (slot == position) must count, and the loop over key chunks must reach the chunk
    that holds the largest position even when that position is the chunk's first slot. With a forced own block
    (local_blocks >= 1) neither shows, which is why only this case pins them."""
    from m3jax.model import indexer
    b, s, hi, di, bs = 1, 12, 2, 8, 2
    _, _, _, iq, ik = _inputs(b, s, 2, 1, hi, di=di, seed=3)
    pos = jnp.array([[0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 4, 0]])  # largest position 8: the first slot of chunk 2
    if chunked:  # chunks of 2 blocks (4 slots); the loop runs only over the live ones
        monkeypatch.setattr(indexer, "WHOLE_SCORES_ELEMENTS", 0)
        monkeypatch.setattr(indexer, "KEY_CHUNK_BLOCKS", 2)
    got = np.asarray(key_block_scores(iq, ik, pos, block_size=bs, local_blocks=0))
    scores = np.einsum("bshd,btd->bhst", np.asarray(iq, np.float64), np.asarray(ik, np.float64))
    scores = np.where(np.arange(s)[None, None, None, :] <= np.asarray(pos)[:, None, :, None], scores, -np.inf)
    want = scores.reshape(b, hi, s, s // bs, bs).max(-1)
    np.testing.assert_allclose(got, want, rtol=1e-5)
