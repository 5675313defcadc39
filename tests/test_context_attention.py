"""Context-parallel attention (sharding.context): each device attends only its own query shard, over the keys
gathered from every context shard, and the result equals one device's.

The partitioner cannot split flash attention's scan over query tiles (it gathered every tile onto every
context device); these tests pin that the shard_map path hands the attention local queries and the whole key
sequence, and that flash's values and gradients under it equal the single device's, with GQA, tensor-parallel
heads, right padding and a query tile that does not divide the local shard.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.model.flash import flash_attention
from sharding.context import context_parallel_attention
from sharding.mesh import MeshConfig, build_mesh

B, S, H, KV, D = 4, 96, 4, 2, 16
MESHES = {"context8": (1, 8, 1, 1), "data2_context2_tensor2": (2, 2, 1, 2), "context2_expert2_tensor2": (1, 2, 2, 2)}


def inputs():
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, S, n, D)), jnp.float32) for n in (H, KV, KV))
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    key_valid = jnp.asarray(np.arange(S)[None] < np.array([[S], [S - 7], [S - 40], [S]]))  # right padding
    return q, k, v, positions, key_valid


def flash(q, k, v, positions, key_valid):
    return flash_attention(q, k, v, scale=D ** -0.5, positions=positions, key_valid=key_valid, q_tile=16, k_tile=16)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_attend_sees_local_queries_and_every_key(mesh):
    layout = build_mesh(MeshConfig(*MESHES[mesh]), seq_len=S, batch=B)
    data, ctx, expert, tensor = MESHES[mesh]
    seen = {}

    def attend(q, k, v, positions, key_valid):
        seen.update(q=q.shape, k=k.shape, positions=positions.shape, key_valid=key_valid.shape)
        return flash(q, k, v, positions, key_valid)

    q, k, v, positions, key_valid = inputs()
    jax.jit(lambda *a: context_parallel_attention(attend, layout, *a)).lower(q, k, v, positions, key_valid)
    rows = B // (data * expert)
    assert seen == dict(q=(rows, S // ctx, H // tensor, D), k=(rows, S, KV // tensor, D), positions=(rows, S // ctx),
                        key_valid=(rows, S))


@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "contiguous"])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_flash_values_and_gradients_equal_one_device(mesh, balance):
    layout = build_mesh(MeshConfig(*MESHES[mesh], context_balance=balance), seq_len=S, batch=B)
    q, k, v, positions, key_valid = inputs()
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def value_and_grads(attend_all):
        def f(q, k, v):
            return attend_all(q, k, v, positions, key_valid)

        o, vjp = jax.vjp(f, q, k, v)
        return o, vjp(w)

    want = jax.jit(lambda: value_and_grads(flash))()
    with jax.set_mesh(layout.mesh):
        got = jax.jit(lambda: value_and_grads(
            lambda *a: context_parallel_attention(flash, layout, *a, balance=True)))()
    for name, g, h in zip(("o", "dq", "dk", "dv"), (want[0], *want[1]), (got[0], *got[1])):
        np.testing.assert_allclose(np.asarray(h), np.asarray(g), rtol=1e-5, atol=1e-6, err_msg=name)


def shard_of_each_query(layout, s, balance=True):
    """[S]: the context shard that computed each query's output (attend returns its shard's index)."""
    ctx = layout.axes("act_seq")

    def attend(q, k, v, positions, key_valid):
        return jnp.zeros_like(q) + jax.lax.axis_index(ctx).astype(q.dtype)

    q, k, v = jnp.zeros((B, s, H, D)), jnp.zeros((B, s, KV, D)), jnp.zeros((B, s, KV, D))
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, s))
    with jax.set_mesh(layout.mesh):
        o = jax.jit(lambda *a: context_parallel_attention(attend, layout, *a, balance=balance))(q, k, v, positions,
                                                                                               None)
    return np.asarray(o[0, :, 0, 0]).astype(int)


def test_balanced_shards_attend_for_mirrored_second_halves():
    """With context_balance, for a caller whose work grows with the query's position, shard c computes the first
    half of its own slots and the second half of shard n - 1 - c's: the same causal work on every shard (halves
    2c and 2n - 1 - 2c of 2n). Without it each shard computes its own contiguous slots. An odd number of local
    slots cannot halve: contiguous."""
    n, s = 4, 32
    half = s // n // 2
    balanced = build_mesh(MeshConfig(2, n, 1, 1), seq_len=s, batch=B)
    want = [c if h % 2 == 0 else n - 1 - c for c in range(n) for h in range(2) for _ in range(half)]
    assert shard_of_each_query(balanced, s).tolist() == want
    contiguous = build_mesh(MeshConfig(2, n, 1, 1, context_balance=False), seq_len=s, batch=B)
    assert shard_of_each_query(contiguous, s).tolist() == np.repeat(np.arange(n), s // n).tolist()
    assert shard_of_each_query(balanced, 4 * 3).tolist() == np.repeat(np.arange(n), 3).tolist()
    # a caller whose work per query does not grow with its position (balance=False) keeps contiguous shards
    assert shard_of_each_query(balanced, s, balance=False).tolist() == np.repeat(np.arange(n), s // n).tolist()
    causal = np.arange(s) + 1  # keys each query sees
    work = np.bincount(shard_of_each_query(balanced, s), weights=causal)
    assert len(set(work.tolist())) == 1  # every shard the same number of (query, key) pairs


def test_keys_of_other_slots_are_refused():
    layout = build_mesh(MeshConfig(1, 8, 1, 1), seq_len=S, batch=B)
    q, k, v, positions, key_valid = inputs()
    with pytest.raises(ValueError, match="96 queries, 48 key slots"):
        context_parallel_attention(flash, layout, q, k[:, :48], v[:, :48], positions, key_valid[:, :48])


def test_without_context_shards_attend_runs_as_is():
    layout = build_mesh(MeshConfig(4, 1, 1, 2), seq_len=S, batch=B)
    calls = []

    def attend(*a):
        calls.append(a[0].shape)
        return flash(*a)

    context_parallel_attention(attend, layout, *inputs())
    assert calls == [(B, S, H, D)]  # the whole arrays: the partitioner places them


# The model's layer paths under a context-sharded layout (`m3jax.model.context_shards`), against the same
# function on one device: query-chunked dense and flash, on full layers and on sparse layers as masks (with
# the ids they select), and the gathered sparse path with replayed block ids.
LAYER_PATHS = ["chunked_full", "chunked_sparse", "flash_full", "flash_sparse", "gather_replay"]


def layer_inputs():
    from m3jax import tiny
    cfg = tiny.m3_config(num_attention_heads=H, num_key_value_heads=KV, head_dim=D, index_n_heads=2,
                         index_head_dim=D, index_block_size=8, index_topk_blocks=2)
    r = np.random.default_rng(2)
    s = 64
    q, k, v = (jnp.asarray(r.normal(size=(B, s, n, D)), jnp.float32) for n in (H, KV, KV))
    iq = jnp.asarray(r.normal(size=(B, s, 2, D)), jnp.float32)
    ik = jnp.asarray(r.normal(size=(B, s, D)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, s))
    key_valid = jnp.asarray(np.arange(s)[None] < np.array([[s], [s - 5], [s - 30], [s]]))
    replay = jnp.asarray(r.integers(-1, 8, size=(B, s, 2, 2)), jnp.int32)
    return cfg, (q, k, v), dict(positions=positions, key_valid=key_valid, iq=iq, ik=ik, replay=replay)


def layer_path(name, cfg, kw, layout):
    from m3jax.model import attention as att
    pos, kval, iq, ik = kw["positions"], kw["key_valid"], kw["iq"], kw["ik"]
    if name == "chunked_full":
        return lambda q, k, v: att.chunked_attention(q, k, v, pos, kval, None, None, cfg, 5, layout)
    if name == "chunked_sparse":
        return lambda q, k, v: att.chunked_attention(q, k, v, pos, kval, iq, ik, cfg, 5, layout,
                                                     return_block_ids=True)
    if name == "flash_full":  # the balanced one: its causal walk grows with the query's position
        return lambda q, k, v: att.flash_layer_attention(q, k, v, pos, kval, None, None, cfg, layout=layout)
    if name == "flash_sparse":
        return lambda q, k, v: att.flash_layer_attention(q, k, v, pos, kval, iq, ik, cfg, return_block_ids=True,
                                                         layout=layout)

    def gathered(q, k, v):  # what attention() runs for a sparse layer on "gather"
        from m3jax.model import context_shards
        attend = lambda *a: att.one_device_sparse_attention(cfg, False, layout.backend, *a)  # noqa: E731
        return context_shards.per_context_shard(attend, layout, q, k, v, pos, kval, iq, ik, kw["replay"])

    return gathered


@pytest.mark.parametrize("mesh", ["context8", "data2_context2_tensor2", "data2_context2_tensor2-contiguous"])
@pytest.mark.parametrize("name", LAYER_PATHS)
def test_layer_paths_per_context_shard_equal_one_device(name, mesh):
    from sharding.layout import Layout
    cfg, (q, k, v), kw = layer_inputs()
    shape = MESHES[mesh.removesuffix("-contiguous")]
    layout = build_mesh(MeshConfig(*shape, context_balance=not mesh.endswith("-contiguous")), seq_len=q.shape[1],
                        batch=B)
    w = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)

    def run(f):
        def value(q, k, v):
            out = f(q, k, v)
            return out if isinstance(out, tuple) else (out, jnp.zeros((), jnp.int32))

        (o, ids), vjp = jax.vjp(value, q, k, v)
        return o, ids, vjp((w, np.zeros(ids.shape, jax.dtypes.float0)))

    want = jax.jit(lambda: run(layer_path(name, cfg, kw, Layout())))()
    with jax.set_mesh(layout.mesh):
        got = jax.jit(lambda: run(layer_path(name, cfg, kw, layout)))()
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))  # the block ids selected
    for label, g, h in zip(("o", "dq", "dk", "dv"), (want[0], *want[2]), (got[0], *got[2])):
        np.testing.assert_allclose(np.asarray(h), np.asarray(g), rtol=1e-5, atol=1e-6, err_msg=label)
