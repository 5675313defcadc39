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


@pytest.mark.parametrize("mesh", list(MESHES))
def test_flash_values_and_gradients_equal_one_device(mesh):
    layout = build_mesh(MeshConfig(*MESHES[mesh]), seq_len=S, batch=B)
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
            lambda *a: context_parallel_attention(flash, layout, *a)))()
    for name, g, h in zip(("o", "dq", "dk", "dv"), (want[0], *want[1]), (got[0], *got[1])):
        np.testing.assert_allclose(np.asarray(h), np.asarray(g), rtol=1e-5, atol=1e-6, err_msg=name)


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
