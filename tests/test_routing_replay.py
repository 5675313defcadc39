"""Routing replay (issue 14 item 1): the forward returns the expert ids it used and can replay given ids
with weights from the live router; replaying its own routes changes nothing, on one device and under
expert parallelism (the replayed ids drive the exchange)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax.model.moe import replay_route, route
from m3jax.tiny import m3_config, m3_model, random_ids
from rl.generation.base import SamplingParams
from rl.generation.jax_engine import JaxEngine
from rl.grpo.mismatch import route_mismatch_frac
from sharding.mesh import MeshConfig, build_mesh
from tests.tiny_runs import numbers, tiny_trainer, two_steps

# 1 full-attention dense layer, then 2 sparse MoE layers; SEQ = 2 x (topk blocks x block size): sparse layers select.
CFG = m3_config(layers=3, hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                intermediate_size=32, dense_intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                index_head_dim=16, index_block_size=8, index_topk_blocks=2, vocab_size=128,
                routed_scaling_factor=2.5)
BATCH, SEQ, N_MOE, K = 8, 32, 2, 2


@jax.jit(static_argnums=(0, 4))
def _program(graphdef, params, rest, ids, return_routes, routes):
    def loss(params):
        out = nnx.merge(graphdef, params, rest)(ids[:, :-1], routes=routes, return_routes=return_routes)
        logits, used = out if return_routes else (out, None)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)), (logits, used)

    return jax.value_and_grad(loss, has_aux=True)(params)


def loss_logits_routes_grads(model, ids, routes=None, return_routes=False):
    """One jitted program (one compile per model layout and replay on/off): (loss, logits, routes or None,
    gradients of the loss)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    (value, (logits, used)), grads = _program(graphdef, params, rest, ids, return_routes, routes)
    return float(value), np.asarray(logits), None if used is None else np.asarray(used), grads


def assert_grads_close(got, want, rel):
    got = dict(nnx.to_flat_state(got))
    for path, g in nnx.to_flat_state(want):
        g, h = np.asarray(g.get_value()), np.asarray(got[path].get_value())
        scale = np.max(np.abs(g))
        assert np.max(np.abs(h - g)) <= rel * max(scale, 1e-30), path


@pytest.fixture(scope="module")
def single():
    model = m3_model(CFG, seed=5)
    ids = jnp.asarray(random_ids(CFG, BATCH, SEQ + 1, seed=2))
    plain = loss_logits_routes_grads(model, ids)
    routed = loss_logits_routes_grads(model, ids, return_routes=True)
    return model, ids, plain, routed


def test_replay_route_formula():
    x = jax.random.normal(jax.random.key(0), (5, 16))
    w_router = jax.random.normal(jax.random.key(1), (8, 16))
    bias = jnp.zeros(8).at[3].set(4.0)  # expert 3 always chosen: the bias only selects
    w, idx = route(x, w_router, bias, top_k=2)
    np.testing.assert_array_equal(np.asarray(replay_route(x, w_router, idx)), np.asarray(w))
    ids = jnp.array([[0, 7]] * 5)
    p = jax.nn.sigmoid(x @ w_router.T)
    want = p[:, [0, 7]] / p[:, [0, 7]].sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(replay_route(x, w_router, ids)), np.asarray(want), rtol=1e-6)
    # the router gets a gradient through the replayed experts' scores only
    g = jax.grad(lambda r: jnp.sum(replay_route(x, r, ids)[:, 0] ** 2))(w_router)
    assert np.any(np.asarray(g[0])) and np.any(np.asarray(g[7])) and not np.any(np.asarray(g[1:7]))


@pytest.mark.xla_defaults  # programs with and without the routes returned, bit for bit
def test_routes_returned_and_replay_off_unchanged(single):
    _, _, (loss, logits, none, grads), (loss_r, logits_r, routes, grads_r) = single
    assert none is None
    assert routes.shape == (BATCH, SEQ, N_MOE, K) and routes.dtype == np.int32
    assert routes.min() >= 0 and routes.max() < CFG.num_local_experts
    assert np.all(np.sort(routes, -1)[..., 0] != np.sort(routes, -1)[..., 1])  # k distinct experts
    np.testing.assert_array_equal(logits_r, logits)  # returning the routes changes no number
    assert loss_r == loss
    assert_grads_close(grads_r, grads, 0.0)


def test_foreign_routes_are_obeyed(single):
    model, ids, _, (_, _, routes, _) = single
    other = (routes + 1) % CFG.num_local_experts
    _, logits_other, chosen, _ = loss_logits_routes_grads(model, ids, routes=jnp.asarray(other), return_routes=True)
    # under replay the returned routes are the router's own choice: the first MoE layer sees the same input
    np.testing.assert_array_equal(chosen[:, :, 0], routes[:, :, 0])
    assert np.mean(chosen != other) > 0.5
    assert np.max(np.abs(logits_other - single[2][1])) > 1e-3


def test_replaying_own_routes_is_the_same_forward_and_gradient(single):
    model, ids, (loss, logits, _, grads), (_, _, routes, _) = single
    loss_p, logits_p, used, grads_p = loss_logits_routes_grads(model, ids, routes=jnp.asarray(routes),
                                                               return_routes=True)
    np.testing.assert_array_equal(used, routes)
    assert np.max(np.abs(logits_p - logits)) <= 1e-6 * np.max(np.abs(logits))
    assert abs(loss_p - loss) <= 1e-6 * abs(loss)
    assert_grads_close(grads_p, grads, 1e-6)
    router = dict(nnx.to_flat_state(grads_p))
    assert any("router" in "/".join(map(str, path)) and np.any(np.asarray(g.get_value()))
               for path, g in router.items())  # the router keeps its gradient under replay


@pytest.mark.slow  # two 8-device compiles of forward + backward: ~30 s on the shared 2-core CPU
def test_expert_parallel_replay_equals_single_device(single):
    """On a 2 (data) x 4 (expert) mesh the replayed ids drive the exchange: replaying the model's own routes
    equals the unreplayed sharded forward, and a foreign routing equals the single device's replay of it."""
    model, ids, (loss, logits, _, grads), (_, _, routes, _) = single
    other = jnp.asarray((routes + 3) % CFG.num_local_experts)  # a routing the router would not choose
    _, logits_other, _, grads_other = loss_logits_routes_grads(model, ids, routes=other, return_routes=True)
    layout = build_mesh(MeshConfig(data=2, expert=4), CFG, seq_len=SEQ, batch=BATCH)
    sharded = m3_model(CFG, seed=5, layout=layout)
    with jax.set_mesh(layout.mesh):
        loss_s, logits_s, used_s, grads_s = loss_logits_routes_grads(sharded, ids, return_routes=True)
        loss_sr, logits_sr, _, grads_sr = loss_logits_routes_grads(sharded, ids, routes=jnp.asarray(used_s),
                                                                   return_routes=True)
        _, logits_so, _, grads_so = loss_logits_routes_grads(sharded, ids, routes=other, return_routes=True)
    np.testing.assert_array_equal(used_s, routes)
    scale = np.max(np.abs(logits))
    assert np.max(np.abs(logits_s - logits)) <= 1e-5 * scale
    assert np.max(np.abs(logits_sr - logits_s)) <= 1e-6 * scale
    assert abs(loss_sr - loss_s) <= 1e-6 * abs(loss_s)
    assert_grads_close(grads_sr, grads_s, 1e-6)
    assert np.max(np.abs(logits_so - logits_other)) <= 1e-5 * np.max(np.abs(logits_other))
    assert_grads_close(grads_so, grads_other, 1e-5)


def test_route_mismatch_frac_by_hand():
    # B=1, S=3 tokens, L=2 layers, k=2; token 2 is padding
    gen = np.array([[[[0, 1], [2, 3]],
                     [[4, 5], [6, 7]],
                     [[0, 1], [0, 1]]]], np.int16)
    trainer = np.array([[[[1, 0], [2, 3]],    # same sets (order differs): 0 of 2 pairs differ
                         [[4, 6], [6, 7]],    # layer 0: {4,6} vs {4,5} differs: 1 of 2
                         [[7, 6], [5, 4]]]],  # padding: not counted
                       np.int32)
    mask = np.array([[1, 1, 0]])
    assert float(route_mismatch_frac(trainer, gen, mask)) == pytest.approx(1 / 4)
    assert float(route_mismatch_frac(trainer, gen, np.array([[1, 1, 1]]))) == pytest.approx(3 / 6)
    assert float(route_mismatch_frac(gen, gen, np.ones((1, 3)))) == 0.0
    assert np.isnan(float(route_mismatch_frac(trainer, gen, np.zeros((1, 3)))))
    with pytest.raises(ValueError):
        route_mismatch_frac(trainer[:, :2], gen, mask)


@pytest.mark.slow  # compiles the engine's generate program with routes; the model-level tests above stay fast
def test_jax_engine_returns_the_routes_of_prompt_and_response_tokens(single):
    """Prefill and decode steps record each token's routes at its place in prompt + response; they are the
    routes a full forward of that sequence takes (so the trainer, replaying them, routes as the sampler did)."""
    model = single[0]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(3, CFG.vocab_size, n)) for n in (5, 11, 8)]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0)
    key = jax.random.key(1)
    plain = JaxEngine(graphdef, params, rest).generate(prompts, sp, key)
    out = JaxEngine(graphdef, params, rest, return_routes=True).generate(prompts, sp, key)
    assert plain.routes is None
    np.testing.assert_array_equal(out.tokens, plain.tokens)  # recording routes changes no sample
    np.testing.assert_array_equal(out.logprobs, plain.logprobs)
    assert out.routes.dtype == np.int16 and out.routes.shape == (3, 11 + 12, N_MOE, K)
    assert out.routes[0].nbytes // out.routes.shape[1] == N_MOE * K * 2  # bytes per token
    seq = np.zeros((3, SEQ), np.int32)
    mask = np.zeros((3, SEQ))
    for i, p in enumerate(prompts):
        n = len(p) + int(out.lengths[i])
        seq[i, :n] = list(p) + list(out.tokens[i, :out.lengths[i]])
        mask[i, :n] = 1
    _, full = jax.jit(lambda s: model(s, return_routes=True))(jnp.asarray(seq))
    assert float(route_mismatch_frac(full[:, :23], out.routes, mask[:, :23])) == 0.0


@pytest.mark.extended  # as the indexer-replay trainer runs: the model-level replay, EP replay and engine tests
@pytest.mark.slow  # stay in the default run. Three tiny trainers, two GRPO steps each (~1 min on the 2-core CPU)
def test_trainer_routing_replay(tmp_path):
    """grpo.routing_replay=none: every metric of two steps is what the trainer logged before routes existed
    (an engine that returns none), plus moe/route_mismatch_frac; rollout: the steps run, replay, and log it."""
    today = tiny_trainer(tmp_path, "today")
    today.engine.return_routes = False  # the generator of before: no routes anywhere in the step
    today.engine.return_block_ids = False  # nor key blocks (tests/test_indexer_replay.py checks those)
    want = two_steps(today)
    got = two_steps(tiny_trainer(tmp_path, "none"))
    replayed = two_steps(tiny_trainer(tmp_path, "rollout", "grpo.routing_replay=rollout"))
    for w, g, r in zip(want, got, replayed):
        assert "moe/route_mismatch_frac" not in w
        frac = g.pop("moe/route_mismatch_frac")
        g.pop("indexer/selection_mismatch_frac")
        r.pop("indexer/selection_mismatch_frac")
        assert numbers(g) == numbers(w)  # bitwise: equal floats
        assert 0.0 <= frac <= 0.05  # one fp32 program family: the engine and the trainer route alike
        assert 0.0 <= r["moe/route_mismatch_frac"] <= 0.05
        assert np.isfinite(r["loss"]) and set(numbers(r)) == set(numbers(w)) | {"moe/route_mismatch_frac"}


@pytest.mark.extended  # the engine on a 2x4 mesh (~10 s); tests/test_jax_engine.py runs sharded generation in the suite
@pytest.mark.slow  # compiles the engine's generate program on one device and on an 8-device mesh (~30 s)
def test_jax_engine_routes_under_expert_parallelism():
    """On a 2 (data) x 4 (expert) mesh the engine samples the same tokens and records the same routes."""
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(3, CFG.vocab_size, n)) for n in (5, 11, 8, 3, 7, 9, 4, 6)]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0)
    outs = []
    for layout in (None, build_mesh(MeshConfig(data=2, expert=4), CFG)):
        graphdef, params, rest = nnx.split(m3_model(CFG, seed=5, layout=layout), nnx.Param, ...)
        outs.append(JaxEngine(graphdef, params, rest, return_routes=True).generate(prompts, sp, jax.random.key(1)))
    np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
    np.testing.assert_array_equal(outs[1].routes, outs[0].routes)
