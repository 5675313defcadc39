"""Expert-parallel MoE: every exchange strategy equals the local computation, values and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax import M3Config
from m3jax.model.mlp import dense_mlp
from m3jax.model.moe import grouped_experts, moe_block, route
from sharding.expert import exchanged_experts, local_experts
from sharding.layout import Layout
from sharding.mesh import MeshConfig, build_mesh

E, D, I, K = 8, 32, 16, 2
CFG = M3Config(vocab_size=64, hidden_size=D, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
               head_dim=16, intermediate_size=I, dense_intermediate_size=32, shared_intermediate_size=16,
               num_local_experts=E, num_experts_per_tok=K, layer_types=("full_attention",),
               mlp_layer_types=("sparse",))


def params(seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    bias = jnp.zeros(E).at[1].set(3.0).at[4].set(-3.0).at[7].set(-3.0)  # unbalanced: 1 hot, 4 and 7 idle
    return {"router": jax.random.normal(ks[0], (E, D)) / D**0.5, "router_bias": bias,
            "experts_gate_up": jax.random.normal(ks[1], (E, 2, I, D)) / D**0.5,
            "experts_down": jax.random.normal(ks[2], (E, D, I)) / I**0.5,
            "shared_gate_up": jax.random.normal(ks[3], (2, 16, D)) / D**0.5,
            "shared_down": jax.random.normal(ks[4], (D, 16)) / 4.0}


def run(p, x, exchange, layout=Layout(), capacity_factor=None):
    def f(p, x):
        out = moe_block(p, x, CFG, layout, capacity_factor, exchange)
        return jnp.sum(out ** 2), out
    # No mesh context: the layout alone decides the expert-parallel program.
    return jax.jit(jax.value_and_grad(f, has_aux=True))(p, x)


# The fast loop runs each exchange once (on the meshes that shard experts over 2 axes with data, and with
# tensor); every (mesh, exchange) pair runs in the full suite.
# The padded exchange (CPU's default) runs in the fast loop through tests/test_sharding.py's 2x2x2x1 case.
FAST_EXCHANGES = {((2, 2, 2, 1), "ragged_emulated")}


@pytest.mark.parametrize("shape, exchange", [
    c if c in FAST_EXCHANGES else pytest.param(*c, marks=pytest.mark.slow)
    for c in [(s, e) for s in [(2, 2, 2, 1), (1, 1, 8, 1), (1, 2, 2, 2)] for e in ["padded", "ragged_emulated"]]],
    ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else c)
def test_exchange_equals_local(shape, exchange):
    p = params()
    x = jax.random.normal(jax.random.key(1), (8, 16, D))
    (want_loss, want), want_grads = run(p, x, None)
    mesh = build_mesh(MeshConfig(*shape), CFG)
    (loss, got), grads = run(p, x, exchange, mesh)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    for name in want_grads:
        g, h = np.asarray(want_grads[name]), np.asarray(grads[name])
        np.testing.assert_allclose(h, g, rtol=0, atol=1e-5 * max(float(np.abs(g).max()), 1e-30), err_msg=name)


def test_ragged_collective_lowers_for_gpu_backends():
    """The real ragged_all_to_all path traces and lowers (XLA:CPU cannot compile it; GPU/TPU do)."""
    p = params()
    x = jax.ShapeDtypeStruct((8, 16, D), jnp.float32)
    layout = build_mesh(MeshConfig(2, 2, 2, 1), CFG)
    with jax.set_mesh(layout.mesh):
        text = jax.jit(lambda p, x: moe_block(p, x, CFG, layout, None, "ragged")).lower(p, x).as_text()
    assert "ragged_all_to_all" in text or "ragged-all-to-all" in text


def test_capacity_factor_drops_overflow_and_large_capacity_is_dropless():
    p = params()
    t = jax.random.normal(jax.random.key(2), (64, D))
    w, idx = route(t, p["router"], p["router_bias"], top_k=K)
    fn = lambda rows, sizes: grouped_experts(rows, sizes, p["experts_gate_up"], p["experts_down"],  # noqa: E731
                                             alpha=1.702, limit=7.0)
    local = local_experts(t, w, idx, fn, E)
    np.testing.assert_allclose(exchanged_experts(t, w, idx, fn, E, (), 1, capacity_factor=100.0), local, atol=1e-6)
    # Capacity 0.5 x (T*k): keep the first half of the expert-sorted assignments, drop the rest.
    got = exchanged_experts(t, w, idx, fn, E, (), 1, capacity_factor=0.5)
    order = np.argsort(np.asarray(idx).reshape(-1), kind="stable")
    keep = np.zeros(idx.size, bool)
    keep[order[: idx.size // 2]] = True
    want = local_experts(t, jnp.where(keep.reshape(idx.shape), w, 0.0), idx, fn, E)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    assert not np.allclose(np.asarray(got), np.asarray(local), atol=1e-3)


@pytest.mark.slow  # the fast loop keeps the capacity-factor case of the ragged pool
@pytest.mark.parametrize("n_ep", [8, 2])  # one local expert (packed rows go straight in) and four
def test_ragged_capacity_pools_the_receive_buffer(n_ep):
    """With a capacity, a ragged receiver takes whole source blocks in rank order into one pool of
    ceil(cf * T * k) rows and truncates the first block that overflows; everything else is dropped."""
    p = params()
    cf, t = 0.75, 16
    x = jax.random.normal(jax.random.key(3), (n_ep, t, D))
    layout = build_mesh(MeshConfig(1, 1, n_ep, 1), CFG, devices=jax.devices()[:n_ep])
    with jax.set_mesh(layout.mesh):
        got = jax.jit(lambda p, x: moe_block(p, x, CFG, layout, cf, "ragged_emulated"))(p, x)
    e_loc, pool = E // n_ep, int(np.ceil(cf * t * K))
    fn = lambda rows, sizes: grouped_experts(rows, sizes, p["experts_gate_up"], p["experts_down"],  # noqa: E731
                                             alpha=1.702, limit=7.0)
    routes = [route(x[s], p["router"], p["router_bias"], top_k=K) for s in range(n_ep)]
    taken = np.zeros(n_ep, int)  # rows each destination has accepted so far
    want = []
    for s, (w, idx) in enumerate(routes):  # sources in rank order
        flat = np.asarray(idx).reshape(-1)
        keep = np.zeros(flat.size, bool)
        for dest in range(n_ep):
            rows = [a for a in np.argsort(flat, kind="stable") if flat[a] // e_loc == dest]
            room = max(pool - taken[dest], 0)
            keep[rows[:room]] = True
            taken[dest] += len(rows)
        local = local_experts(x[s], jnp.where(keep.reshape(idx.shape), w, 0.0), idx, fn, E)
        want.append(local * CFG.routed_scaling_factor + dense_mlp(x[s], p["shared_gate_up"], p["shared_down"],
                                                                  CFG.swiglu_alpha, CFG.swiglu_limit))
    assert taken.max() > pool  # the hot expert's device really overflows
    np.testing.assert_allclose(np.asarray(got), np.stack(want), atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("shape", [None, (1, 1, 8, 1)], ids=["local", "ep8"])
def test_experts_are_told_the_balanced_load_not_the_buffer(shape):
    """The bucketed kernel sizes its buckets by `expected_rows`: the rows an expert gets under a balanced load
    (n_ep * T * k / E), never the receive buffer's N / E_loc, which a dropless exchange sizes for the worst
    case (8 devices of one expert each: N = 8 * T * min(k, E_loc) = 128 rows, 4x the balanced 32)."""
    from sharding.expert import routed_experts
    p = params()
    x = jax.random.normal(jax.random.key(1), (8, 16, D))
    seen = []

    def expert_fn(rows, sizes, gate_up, down, *, expected_rows):
        seen.append((rows.shape[0], sizes.shape[0], expected_rows))
        return grouped_experts(rows, sizes, gate_up, down, alpha=1.702, limit=7.0, expected_rows=expected_rows)

    layout = Layout() if shape is None else build_mesh(MeshConfig(*shape), CFG)
    route_fn = functools.partial(route, top_k=K)
    jax.jit(lambda p, x: routed_experts(x, route_fn, (p["router"], p["router_bias"]), expert_fn,
                                        p["experts_gate_up"], p["experts_down"], layout=layout,
                                        exchange="padded"))(p, x)
    n_ep = 1 if shape is None else 8
    tokens = 8 * 16 // n_ep  # per device (the data axis is 1: the expert axis shards the tokens)
    (n, e_here, expected), = seen
    assert e_here == E // n_ep and expected == n_ep * tokens * K / E == 32
    assert n == (tokens * K if n_ep == 1 else n_ep * tokens * min(K, E // n_ep))
