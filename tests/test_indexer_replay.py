"""Indexer selection replay (issue 14 items 2-3): the forward returns the key blocks each sparse layer's
indexer kept and can attend over given blocks instead (every attention impl, and decoding); the JAX engine
records them per prompt and sampled token; `indexer/selection_mismatch_frac` compares block sets."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax.model.attention import indexer_qk
from m3jax.model.indexer import topk_key_blocks
from m3jax.model.norms import rms_norm
from m3jax.model.rope import rope_cos_sin
from m3jax.tiny import m3_config, m3_model, random_ids
from rl import phases
from rl.generation.base import Rollout, SamplingParams
from rl.generation.jax_engine import JaxEngine
from rl.grpo.mismatch import selection_mismatch_frac
from tests.tiny_runs import TINY, numbers, tiny_trainer, two_steps

# Two sparse layers (dense MLPs: nothing but attention differs between the tests' models); SEQ = 7 blocks of 4
# with 2 kept per query, so every query past position 7 really drops blocks.
CFG = m3_config(layers=2, full_attention_layers=0, dense_layers=2, hidden_size=32, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16, intermediate_size=16, dense_intermediate_size=32,
                index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2, vocab_size=64)
BATCH, SEQ, N_SPARSE, HI, K = 2, 28, 2, 2, 2
IMPLS = {"gather": {}, "masked": dict(sparse_attention="masked"),
         "masked_flash": dict(sparse_attention="masked", attention_impl="flash"),
         "masked_chunked": dict(sparse_attention="masked", attention_query_chunk=8)}


@jax.jit(static_argnums=(0, 4))
def _forward(graphdef, params, rest, ids, return_block_ids, block_ids=None):
    return nnx.merge(graphdef, params, rest)(ids, block_ids=block_ids, return_block_ids=return_block_ids)


def run(model, ids, block_ids=None, return_block_ids=False):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    out = _forward(graphdef, params, rest, ids, return_block_ids, block_ids)
    return tuple(map(np.asarray, out)) if return_block_ids else np.asarray(out)


def perturbed(model, scale=0.3, seed=7):
    """A copy of the model with seeded noise on its indexer projections only: a generator whose selection
    differs while every other weight is the trainer's."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = iter(jax.random.split(jax.random.key(seed), len(leaves)))
    out = []
    for path, v in leaves:
        name = "/".join(map(str, path))
        k = next(keys)
        if "index_q_proj" in name or "index_k_proj" in name:
            v = v + scale * jnp.std(v) * jax.random.normal(k, v.shape, v.dtype)
        out.append(v)
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, out), rest)


@pytest.fixture(scope="module")
def model_ids():
    return m3_model(CFG, seed=3), jnp.asarray(random_ids(CFG, BATCH, SEQ, seed=1))


def test_returned_ids_are_the_first_layers_top_k(model_ids):
    model, ids = model_ids
    logits = run(model, ids)
    logits_r, blocks = run(model, ids, return_block_ids=True)
    assert model.num_sparse_layers == N_SPARSE
    assert blocks.shape == (BATCH, SEQ, N_SPARSE, HI, K) and blocks.dtype == np.int32
    np.testing.assert_array_equal(logits_r, logits)  # returning the ids changes no number
    # layer 0's input is the embedding: its indexer's top-K, computed by hand
    stack = model.stacks[0]
    p = {name: getattr(stack, name)[...][0] for name in stack.param_names}
    pos = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
    x = jnp.take(model.embed[...], ids, axis=0)
    cos, sin = rope_cos_sin(pos, CFG.rotary_dim, CFG.rope_theta, x.dtype)
    iq, ik = indexer_qk(p, rms_norm(x, p["input_norm"], CFG.rms_norm_eps), cos, sin, CFG.rms_norm_eps)
    want = topk_key_blocks(iq, ik, pos, block_size=4, topk_blocks=K, local_blocks=CFG.index_local_blocks)
    np.testing.assert_array_equal(blocks[:, :, 0], np.moveaxis(np.asarray(want), 1, 2))
    assert (blocks[:, :4] == -1).any() and (blocks[:, 8:] >= 0).all()  # early queries: fewer past blocks than K


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_replaying_the_returned_ids_is_bitwise_the_same_forward(model_ids, impl):
    _, ids = model_ids
    model = m3_model(CFG, seed=3, **IMPLS[impl])
    logits, blocks = run(model, ids, return_block_ids=True)
    np.testing.assert_array_equal(run(model, ids, block_ids=jnp.asarray(blocks.astype(np.int16))), logits)
    if impl != "gather":  # the first sparse layer reads the embedding: every impl selects the same blocks
        gathered = run(m3_model(CFG, seed=3), ids, return_block_ids=True)[1]
        np.testing.assert_array_equal(blocks[:, :, 0], gathered[:, :, 0])


@pytest.mark.parametrize("impl", ["gather", "masked"])
def test_replay_makes_the_trainer_attend_over_the_generators_blocks(model_ids, impl):
    """A generator whose indexer weights carry noise selects other blocks (mismatch > 0); everything else
    is the trainer's, so the trainer replaying the generator's blocks computes the generator's logits
    bitwise, and still reports its own indexer's choice."""
    _, ids = model_ids
    trainer = m3_model(CFG, seed=3, **IMPLS[impl])
    generator = perturbed(trainer)
    gen_logits, gen_blocks = run(generator, ids, return_block_ids=True)
    own_logits, own_blocks = run(trainer, ids, return_block_ids=True)
    mask = np.ones((BATCH, SEQ))
    assert float(selection_mismatch_frac(own_blocks, gen_blocks, mask)) > 0.05
    assert np.max(np.abs(own_logits - gen_logits)) > 1e-4
    replayed, still_own = run(trainer, ids, block_ids=jnp.asarray(gen_blocks), return_block_ids=True)
    np.testing.assert_array_equal(replayed, gen_logits)
    # the trainer's own choice: layer 0 sees the same input; layer 1's input follows the replayed attention
    np.testing.assert_array_equal(still_own[:, :, 0], own_blocks[:, :, 0])


def test_replay_in_decode_mode(model_ids):
    """With a cache (the engine's prefill), the sparse layers replay and return ids like the full forward."""
    model, ids = model_ids
    _, blocks = run(model, ids, return_block_ids=True)

    @jax.jit
    def prefill(block_ids):
        cache = model.init_cache(BATCH, SEQ + 4)
        valid = jnp.arange(SEQ + 4)[None] < SEQ
        pos = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
        kw = dict(positions=pos, attention_mask=jnp.broadcast_to(valid, (BATCH, SEQ + 4)), cache=cache)
        logits, _, used = model(ids, return_block_ids=True, **kw)
        replayed, _ = model(ids, block_ids=block_ids, **kw)
        return logits, used, replayed

    logits, used, replayed = map(np.asarray, prefill(jnp.asarray(blocks)))
    np.testing.assert_array_equal(used, blocks)
    np.testing.assert_array_equal(replayed, logits)


def test_block_ids_of_the_wrong_shape_are_one_clear_error(model_ids):
    model, ids = model_ids
    with pytest.raises(ValueError, match=r"block_ids \(2, 28, 1, 2, 2\): expected \[B, S, n_sparse_layers, Hi, K\]"):
        model(ids, block_ids=jnp.zeros((BATCH, SEQ, 1, HI, K), jnp.int32))


def test_selection_mismatch_frac_by_hand():
    # B=1, S=3 tokens (token 2 padding), L=1 layer, Hi=2 heads, K=2
    gen = np.array([[[[[0, 1], [2, -1]]],
                     [[[3, 4], [1, 4]]],
                     [[[0, 1], [0, 1]]]]], np.int16)
    trainer = np.array([[[[[1, 0], [-1, 2]]],   # same sets in another order: no mismatch
                         [[[3, 4], [1, 2]]],    # head 1: {1, 2} vs {1, 4}: 1 of 2
                         [[[5, 6], [5, 6]]]]],  # padding: not counted
                       np.int32)
    assert float(selection_mismatch_frac(trainer, gen, np.array([[1, 1, 0]]))) == pytest.approx(1 / 4)
    assert float(selection_mismatch_frac(trainer, gen, np.ones((1, 3)))) == pytest.approx(3 / 6)
    assert float(selection_mismatch_frac(gen, gen, np.ones((1, 3)))) == 0.0
    assert np.isnan(float(selection_mismatch_frac(trainer, gen, np.zeros((1, 3)))))
    with pytest.raises(ValueError):
        selection_mismatch_frac(trainer[..., 0], gen[..., 0], np.ones((1, 3)))


def test_phases_carry_the_block_ids_and_log_the_mismatch():
    """train_batch trims the rollout's block ids to the training positions; the metric compares the pass's
    own ids with them over real tokens; the update keeps them only under replay."""
    n, w, t = 4, 5, 6
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 60, w)) for _ in range(n)]
    tokens = rng.integers(3, 60, (n, t)).astype(np.int32)
    blocks = rng.integers(-1, 3, (n, w + t, N_SPARSE, HI, K)).astype(np.int16)
    ro = Rollout(prompts, tokens, np.zeros((n, t), np.float32), np.full(n, t), np.zeros(n, bool), block_ids=blocks)
    samples = phases.Samples(ro, [None] * n, ["x"] * n)
    adv = phases.Advantages(np.ones(n, np.float32), np.ones(n, np.float32), np.zeros(n // 2, bool))
    micro = phases.train_batch(samples, adv, width=w + t, pad_id=0, num_micro=2)
    assert micro["block_ids"].shape == (2, 2, w + t - 1, N_SPARSE, HI, K)
    np.testing.assert_array_equal(micro["block_ids"].reshape(n, w + t - 1, -1),
                                  blocks[:, :-1].reshape(n, w + t - 1, -1))
    own = micro["block_ids"].astype(np.int32).copy()
    own[0, 0, 2, 1, 0] = [7, 7]  # one (token, layer, head) differs

    def logprob_pass(params, rest, mb):
        return np.zeros(mb["input_ids"].shape, np.float32), {"block_ids": own}

    state = type("S", (), {"params": "P", "rest": "R"})()
    micro = phases.logprobs(logprob_pass, state, micro)
    kept, metrics = phases.route_metrics(micro, replay=False, indexer_replay=True)
    real = micro["attention_mask"].sum()
    assert metrics["indexer/selection_mismatch_frac"] == pytest.approx(1 / (real * N_SPARSE * HI))
    assert "block_ids" in kept and "trainer_block_ids" not in kept
    dropped, metrics_off = phases.route_metrics(micro, replay=False)
    assert "block_ids" not in dropped and metrics_off == metrics



def test_the_mismatch_is_summed_where_the_trainers_ids_are(monkeypatch):
    """The pass's own ids are a global array cut over the rows. They were gathered onto every host (`_on_host`, a
    tiled allgather: at the 32-node recipe's batch 3.8 GB of routes, with the JAX engine 61 GB of key blocks, per
    device) and put whole on one device, for two sums; now the generator's ids and the mask join them on their
    shards and only the sums leave. The fraction is the host formula's."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from rl.grpo.mismatch import route_mismatch_frac
    rng = np.random.default_rng(1)
    gen = rng.integers(0, 4, (2, 8, 6, 3, 2)).astype(np.int16)  # [micro, rows, positions, MoE layers, k]
    own = gen.astype(np.int32)
    own[rng.random(own.shape[:-1]) < 0.2] = [3, 0]
    mask = (rng.random((2, 8, 6)) < 0.8).astype(np.int32)
    rows_cut = NamedSharding(jax.make_mesh((8,), ("data",)), P(None, "data"))

    trainer = jax.device_put(own, rows_cut)
    to_numpy = type(trainer).__array__

    def on_host(x, *args, **kwargs):
        if x.shape == own.shape:
            raise AssertionError(f"the trainer's ids {x.shape} were brought to the host")
        return to_numpy(x, *args, **kwargs)
    monkeypatch.setattr(type(trainer), "__array__", on_host)
    micro = {"routes": gen, "trainer_routes": trainer, "attention_mask": mask}
    _, metrics = phases.route_metrics(micro, replay=False)
    assert phases._beside(trainer, gen).sharding.is_equivalent_to(trainer.sharding, gen.ndim)  # on the ids' shards
    assert phases._beside(trainer, mask).sharding.spec == P(None, "data")
    want = route_mismatch_frac(own.reshape(16, 6, 3, 2), gen.reshape(16, 6, 3, 2), mask.reshape(16, 6))
    assert 0 < metrics["moe/route_mismatch_frac"] == pytest.approx(float(want), rel=1e-6)


def test_vllm_with_indexer_replay_is_a_config_error(tmp_path):
    from rl.config import ConfigError, load_config
    path = tmp_path / "run.yaml"
    path.write_text(f"base: {TINY}\ngrpo: {{indexer_replay: rollout}}\ngeneration: {{backend: vllm}}\n")
    with pytest.raises(ConfigError, match="does not return the indexer's block selection"):
        load_config(str(path), [])
    assert load_config(str(path), ["generation.backend=jax"]).grpo.indexer_replay == "rollout"


def test_jax_engine_returns_the_block_ids_of_prompt_and_response_tokens(model_ids):
    """Prefill and decode steps record each token's key blocks at its place in prompt + response; they are
    the blocks a full forward of that sequence selects (greedy, so the trainer replays the sampler's)."""
    model = model_ids[0]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(3, CFG.vocab_size, n)) for n in (9, 14)]
    sp = SamplingParams(max_new_tokens=12, temperature=0.0)
    out = JaxEngine(graphdef, params, rest, return_block_ids=True).generate(prompts, sp, jax.random.key(1))
    assert out.routes is None
    assert out.block_ids.dtype == np.int16 and out.block_ids.shape == (2, 14 + 12, N_SPARSE, HI, K)
    assert out.block_ids[0].nbytes // out.block_ids.shape[1] == N_SPARSE * HI * K * 2  # bytes per token
    seq = np.zeros((2, 26), np.int32)
    for i, p in enumerate(prompts):
        n = len(p) + int(out.lengths[i])
        seq[i, :n] = list(p) + list(out.tokens[i, :out.lengths[i]])
        _, full = run(model, jnp.asarray(seq[i:i + 1, :n]), return_block_ids=True)
        np.testing.assert_array_equal(out.block_ids[i, :n], full[0])
        assert (out.block_ids[i, n:] == -1).all()  # no stop token: every row ran 12 steps; slots past it: none


@pytest.mark.extended  # widens a check the default run keeps (the suite's 15-minute bound)
@pytest.mark.slow  # three tiny trainers, two GRPO steps each (~1 min on the shared 2-core CPU)
def test_trainer_indexer_replay(tmp_path):
    """grpo.indexer_replay=none: every metric of two steps is what the trainer logged before block ids
    existed (an engine that returns none), plus indexer/selection_mismatch_frac; rollout: the steps run,
    replay the generator's blocks, and log it."""
    today = tiny_trainer(tmp_path, "today")
    assert today.engine.return_block_ids  # tiny.yaml has a sparse layer
    today.engine.return_block_ids = False  # the generator of before: no key blocks anywhere in the step
    want = two_steps(today)
    got = two_steps(tiny_trainer(tmp_path, "none"))
    replayed = two_steps(tiny_trainer(tmp_path, "rollout", "grpo.indexer_replay=rollout"))
    for w, g, r in zip(want, got, replayed):
        assert "indexer/selection_mismatch_frac" not in w
        frac = g.pop("indexer/selection_mismatch_frac")
        assert numbers(g) == numbers(w)  # bitwise: equal floats
        assert 0.0 <= frac <= 0.05  # one fp32 program family: the engine and the trainer select alike
        assert 0.0 <= r["indexer/selection_mismatch_frac"] <= 0.05
        assert np.isfinite(r["loss"]) and set(numbers(r)) == set(numbers(w)) | {"indexer/selection_mismatch_frac"}


@pytest.mark.extended  # widens a check the default run keeps (the suite's 15-minute bound)
@pytest.mark.slow  # compiles the forward on an 8-device mesh, two impls (~10 s on the shared 2-core CPU)
@pytest.mark.parametrize("impl", ["gather", "masked"])
def test_replay_under_context_parallelism_equals_one_device(impl):
    """On a 2 (data) x 4 (context) mesh the sparse layers select the same blocks, and replaying a foreign
    selection (the perturbed generator's) gives the single device's replayed logits."""
    from sharding.mesh import MeshConfig, build_mesh

    ids = jnp.asarray(random_ids(CFG, BATCH, 32, seed=2))
    trainer = m3_model(CFG, seed=3, **IMPLS[impl])
    _, gen_blocks = run(perturbed(trainer), ids, return_block_ids=True)
    logits, own = run(trainer, ids, return_block_ids=True)
    replayed = run(trainer, ids, block_ids=jnp.asarray(gen_blocks))
    layout = build_mesh(MeshConfig(data=2, context=4), CFG, seq_len=32, batch=BATCH)
    sharded = m3_model(CFG, seed=3, layout=layout, **IMPLS[impl])
    with jax.set_mesh(layout.mesh):
        logits_s, own_s = run(sharded, ids, return_block_ids=True)
        replayed_s, still_own_s = run(sharded, ids, block_ids=jnp.asarray(gen_blocks), return_block_ids=True)
    np.testing.assert_array_equal(own_s, own)
    np.testing.assert_array_equal(still_own_s[:, :, 0], own[:, :, 0])
    assert np.max(np.abs(logits_s - logits)) <= 1e-5 * np.max(np.abs(logits))
    assert np.max(np.abs(replayed_s - replayed)) <= 1e-5 * np.max(np.abs(replayed))


def test_a_replay_with_a_repeated_or_out_of_range_block_reads_as_the_set_it_names(model_ids):
    """The gather paths gathered a repeated id twice (its keys weighted double) and clipped an id past the keys to
    the last block, where the masked path reads a set: one replay, two results (an audit's fuzz, errors of 0.2)."""
    _, ids = model_ids
    blocks = -(-SEQ // CFG.index_block_size)
    clean = np.zeros((BATCH, SEQ, N_SPARSE, HI, K), np.int32)
    clean[..., 1] = -1
    messy = clean.copy()
    messy[..., 1] = 0  # block 0 again
    far = clean.copy()
    far[..., 1] = blocks + 3  # past the keys
    outs = {}
    for impl in ("gather", "masked"):
        model = m3_model(CFG, seed=3, **IMPLS[impl])
        outs[impl] = [run(model, ids, block_ids=jnp.asarray(b)) for b in (clean, messy, far)]
    for got in (*outs["gather"], *outs["masked"]):
        np.testing.assert_allclose(got, outs["masked"][0], rtol=1e-5, atol=1e-5)
