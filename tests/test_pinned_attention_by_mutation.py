"""Attention code a mutation audit changed without any test failing (session 55): flash attention's choice of the key
tiles a query tile reads, the sparse gather's rows that a replayed block selection leaves without a visible key, and
which index head each query head reads with fewer index heads than kv heads. Each test names the slip it catches."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np


def _normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def test_flash_reads_the_key_tile_that_starts_at_a_querys_own_position():
    """A query at position 8 with tiles of 8: its own key opens the second key tile (sequences of 128 n + 1 at the
    default tiles, a decode step at a multiple of 128). `<` for `<=` skipped that tile: the last query's output off
    by 0.23 and its own key's gradient 0."""
    from m3jax.model.attention import causal_keep, gqa_attention
    from m3jax.model.flash import flash_attention
    rng = np.random.default_rng(0)
    q, k, v = (_normal(rng, 1, 9, 2, 16) for _ in range(3))
    keep = causal_keep(jnp.arange(9)[None], None, 9)

    def last_query(fn):
        return lambda k: jnp.sum(fn(k)[0, -1] ** 2)

    flash = lambda k: flash_attention(q, k, v, scale=0.25, q_tile=8, k_tile=8)  # noqa: E731
    dense = lambda k: gqa_attention(q, k, v, keep, 0.25)  # noqa: E731
    np.testing.assert_allclose(np.asarray(flash(k)), np.asarray(dense(k)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(last_query(flash))(k)), np.asarray(jax.grad(last_query(dense))(k)),
                               atol=1e-5)


def test_replayed_blocks_that_leave_a_query_blind_read_as_the_masked_path():
    """Indexer replay may name no block a query can see (an id past the keys, made -1; only future blocks): every
    gather path must give the masked path's row. Without its blind-row fix when no padding mask is given, the tiles
    path was 7.6 off there."""
    from m3jax.model import attention
    from m3jax.model.sparse import sparse_layer_attention
    rng = np.random.default_rng(0)
    cfg = SimpleNamespace(index_block_size=8, index_topk_blocks=2, index_local_blocks=1, head_dim=16,
                          num_attention_heads=2)
    q, k, v = _normal(rng, 1, 32, 2, 16), _normal(rng, 1, 32, 1, 16), _normal(rng, 1, 32, 1, 16)
    pos = jnp.arange(32)[None]
    ids = np.stack([np.arange(32) // 8, np.maximum(np.arange(32) // 8 - 1, 0)], -1)[None, :, None, :]
    ids = ids.astype(np.int32)
    ids[0, 20] = -1  # no block
    ids[0, 9] = [3, -1]  # a future block only
    ids = jnp.asarray(ids)
    want = attention.masked_attention(q, k, v, pos, None, jnp.zeros((1, 32, 1, 8)), jnp.zeros((1, 32, 8)), cfg,
                                      block_ids=ids)
    for path in ("tiles", "grouped", "slots"):
        got = sparse_layer_attention(q, k, v, pos, None, None, None, cfg, to_chunks=attention._to_chunks,
                                     from_chunks=attention._from_chunks, path=path, block_ids=ids)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, err_msg=path)


def test_with_fewer_index_heads_than_kv_heads_each_query_head_reads_its_groups_index_head():
    """4 query heads, 4 kv heads, 2 index heads (the config allows it; the release has 4 and 4): heads 0-1 read index
    head 0, heads 2-3 index head 1. `% hi` for `// (u // hi)` gave heads 1 and 2 the other's blocks (1.8 off the
    masked path) while every tested shape had as many kv heads as index heads."""
    from m3jax.model import attention
    from m3jax.model.sparse import head_units, sparse_layer_attention
    np.testing.assert_array_equal(head_units(4, 4, 2)[1], [0, 0, 1, 1])
    rng = np.random.default_rng(0)
    cfg = SimpleNamespace(index_block_size=8, index_topk_blocks=2, index_local_blocks=1, head_dim=16,
                          num_attention_heads=4)
    q, k, v = _normal(rng, 1, 48, 4, 16), _normal(rng, 1, 48, 4, 16), _normal(rng, 1, 48, 4, 16)
    iq, ik = _normal(rng, 1, 48, 2, 8), _normal(rng, 1, 48, 8)
    pos = jnp.arange(48)[None]
    want = attention.masked_attention(q, k, v, pos, None, iq, ik, cfg)
    got = sparse_layer_attention(q, k, v, pos, None, iq, ik, cfg, to_chunks=attention._to_chunks,
                                 from_chunks=attention._from_chunks, path="tiles")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
