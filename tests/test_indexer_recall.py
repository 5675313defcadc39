"""indexer/recall (issue 14 item 3): the share of a sparse layer's full attention (no indexer mask) in the key
blocks its indexer selects: the pure function against a brute force, the model's own recall per sparse layer,
the trainer's metric every logging.indexer_recall_every steps, and its panel in curves.png."""

import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax.model.norms import rms_norm
from m3jax.model.recall import indexer_recall
from m3jax.model.rope import apply_rope, rope_cos_sin
from m3jax.tiny import m3_config, m3_model, random_ids
from rl import phases

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
# Three sparse layers in two stacks (dense MLP, dense, MoE; the first reads the embedding); 4-token blocks,
# 2 kept per query.
CFG = m3_config(layers=3, full_attention_layers=0, dense_layers=2, hidden_size=32, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=16, dense_intermediate_size=32,
                num_local_experts=8, index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2,
                vocab_size=64)


def brute_force(q, k, positions, key_valid, block_ids, block_size, query_mask):
    """Per-query recall [B, S, H] and the layer mean, in float64 loops (the module docstring's formula)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, s, h, d = q.shape
    sk, kvh, hi = k.shape[1], k.shape[2], block_ids.shape[2]
    out, num, den = np.ones((b, s, h)), 0.0, 0
    for bb in range(b):
        for i in range(s):
            visible = [j for j in range(sk) if j <= positions[bb, i] and key_valid[bb, j]]
            for hh in range(h):
                if not visible:
                    continue
                logits = np.array([q[bb, i, hh] @ k[bb, j, hh // (h // kvh)] for j in visible]) * d ** -0.5
                p = np.exp(logits - logits.max())
                p /= p.sum()
                kept = set(block_ids[bb, i, hh // (h // hi)].tolist()) - {-1}
                out[bb, i, hh] = sum(pj for pj, j in zip(p, visible) if j // block_size in kept)
                if query_mask[bb, i]:
                    num, den = num + out[bb, i, hh], den + 1
    return out, num / den


def random_case(seed=0, b=2, s=13, h=4, kvh=2, hi=2, d=8, bs=3, k_blocks=2):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, s, h, d)).astype(np.float32) * 2
    k = rng.normal(size=(b, s, kvh, d)).astype(np.float32) * 2
    positions = np.broadcast_to(np.arange(s), (b, s)).copy()
    key_valid = np.ones((b, s), bool)
    key_valid[1, -3:] = False  # right padding
    key_valid[1, 0] = False  # row 1's first query sees no key
    nb = -(-s // bs)
    block_ids = rng.integers(-1, nb, size=(b, s, hi, k_blocks)).astype(np.int32)
    cfg = types.SimpleNamespace(head_dim=d, index_block_size=bs)
    return q, k, positions, key_valid, block_ids, cfg


@pytest.mark.parametrize("tile", [4, 128])
def test_recall_equals_a_brute_force(tile):
    q, k, pos, kval, ids, cfg = random_case()
    want, want_mean = brute_force(q, k, pos, kval, ids, cfg.index_block_size, kval)
    got = indexer_recall(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(kval), jnp.asarray(ids), cfg,
                         tile=tile, query_mask=jnp.asarray(kval), reduce=False)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
    assert np.asarray(got)[1, 0].tolist() == [1.0] * 4  # no visible key: 1, and left out of the mean
    mean = indexer_recall(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(kval), jnp.asarray(ids),
                          cfg, tile=tile, query_mask=jnp.asarray(kval))
    assert mean.shape == () and abs(float(mean) - want_mean) < 2e-6
    assert 0.0 < float(mean) < 1.0


def test_recall_is_one_when_every_past_block_is_selected():
    """S <= K * block_size: every query's past blocks fit in its K; with -1 beyond them, or every block."""
    q, k, pos, kval, _, cfg = random_case(seed=1, s=12, bs=3, k_blocks=4)
    past = np.where(np.arange(4) <= pos[..., None] // 3, np.arange(4), -1)  # [B, S, 4]
    for ids in (np.broadcast_to(past[:, :, None], (2, 12, 2, 4)), np.broadcast_to(np.arange(4), (2, 12, 2, 4))):
        got = indexer_recall(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(kval), jnp.asarray(ids),
                             cfg, tile=5, reduce=False)
        np.testing.assert_allclose(np.asarray(got), 1.0, atol=1e-6)
    # one past block dropped from every query of block 2 and 3: less than 1 there, 1 before
    dropped = np.where(past == 1, -1, past)
    got = np.asarray(indexer_recall(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(kval),
                                    jnp.asarray(np.broadcast_to(dropped[:, :, None], (2, 12, 2, 4))), cfg,
                                    reduce=False))
    np.testing.assert_allclose(got[:, :3], 1.0, atol=1e-6)
    assert (got[0, 6:] < 1.0).all()


# ----------------------------------------------------------------------------------------------- the model
@jax.jit(static_argnums=(0,))
def _recall(graphdef, params, rest, ids, mask):
    return nnx.merge(graphdef, params, rest).indexer_recall(ids, attention_mask=mask)


def model_recall(model, ids, mask=None):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mask = jnp.ones(ids.shape, jnp.int32) if mask is None else mask
    return np.asarray(_recall(graphdef, params, rest, jnp.asarray(ids), jnp.asarray(mask)))


@pytest.fixture(scope="module")
def model():
    return m3_model(CFG, seed=2)


def test_model_recall_is_one_for_short_sequences_and_less_when_blocks_are_dropped(model):
    assert model.num_sparse_layers == 3
    short = model_recall(model, random_ids(CFG, 2, 8, seed=1))  # 2 blocks <= K = 2: nothing dropped
    assert short.shape == (3,) and short.dtype == np.float32
    np.testing.assert_allclose(short, 1.0, atol=1e-6)
    ids = random_ids(CFG, 2, 32, seed=1)  # 8 blocks, 2 kept per query
    long = model_recall(model, ids)
    assert ((0.0 < long) & (long < 1.0)).all(), long
    # right padding: the padded queries do not count, the real ones score as without the padding
    padded = np.concatenate([ids, np.full((2, 8), 3, np.int32)], axis=1)
    mask = np.concatenate([np.ones((2, 32)), np.zeros((2, 8))], axis=1).astype(np.int32)
    np.testing.assert_allclose(model_recall(model, padded, mask), long, rtol=1e-5)


def test_model_recall_is_the_first_sparse_layers_brute_force(model):
    """Layer 0 reads the embedding: its q, k and the indexer's own blocks by hand, against the brute force."""
    ids = jnp.asarray(random_ids(CFG, 1, 20, seed=5))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    blocks = np.asarray(jax.jit(lambda p, r, x: nnx.merge(graphdef, p, r)(x, return_block_ids=True)[1])(
        params, rest, ids))[:, :, 0]
    stack = model.stacks[0]
    p = {name: getattr(stack, name)[...][0] for name in stack.param_names}
    pos = jnp.broadcast_to(jnp.arange(20), (1, 20))
    x = rms_norm(jnp.take(model.embed[...], ids, axis=0), p["input_norm"], CFG.rms_norm_eps)
    cos, sin = rope_cos_sin(pos, CFG.rotary_dim, CFG.rope_theta, x.dtype)
    q = apply_rope(rms_norm(jnp.einsum("bse,hde->bshd", x, p["q_proj"]), p["q_norm"], CFG.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(jnp.einsum("bse,hde->bshd", x, p["k_proj"]), p["k_norm"], CFG.rms_norm_eps), cos, sin)
    ones = np.ones((1, 20), bool)
    _, want = brute_force(q, k, np.asarray(pos), ones, blocks, 4, ones)
    assert abs(model_recall(model, ids)[0] - want) < 1e-5


@pytest.mark.parametrize("options", [dict(sparse_attention="masked"), dict(sparse_attention="masked",
                                                                           attention_impl="flash"),
                                     dict(sparse_attention="masked", attention_query_chunk=8)])
def test_every_attention_impl_gives_the_same_recall(model, options):
    ids = random_ids(CFG, 2, 32, seed=1)
    np.testing.assert_allclose(model_recall(m3_model(CFG, seed=2, **options), ids), model_recall(model, ids),
                               rtol=1e-5)


def test_asking_for_the_recall_changes_no_logit(model):
    ids = jnp.asarray(random_ids(CFG, 2, 32, seed=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    plain = jax.jit(lambda p, r, x: nnx.merge(graphdef, p, r)(x))(params, rest, ids)
    logits, recall = jax.jit(lambda p, r, x: nnx.merge(graphdef, p, r)(x, return_indexer_recall=True))(params, rest,
                                                                                                      ids)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain))
    np.testing.assert_allclose(np.asarray(recall), model_recall(model, ids), rtol=1e-6)
    with pytest.raises(ValueError, match="no decode cache"):
        model(ids[:, :1], cache=model.init_cache(2, 8), return_indexer_recall=True)


# --------------------------------------------------------------------------------------------- the trainer
def _cfg(tmp_path, *overrides):
    from rl.config import load_config
    return load_config(str(TINY), [f"run.out_dir={tmp_path}", "grpo.prompts_per_step=4", "grpo.group_size=4",
                                   "grpo.micro_batch_size=8", "logging.tensorboard=false", *overrides])


def test_off_by_default_and_on_in_the_tiny_demo(tmp_path):
    from rl.config.schema import LoggingSection
    assert LoggingSection().indexer_recall_every == 0
    assert _cfg(tmp_path).logging.indexer_recall_every == 10


def test_phase_logs_the_mean_and_each_layer_on_the_first_micro_batch(tmp_path):
    """The policy's recall pass on a micro-batch's real tokens, as the trainer calls it."""
    from rl.policy import build_policy, make_indexer_recall
    policy = build_policy(_cfg(tmp_path))
    recall = make_indexer_recall(policy)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 16, (2, 8, 12)).astype(np.int32)  # [micro-batches, rows, seq]
    mask = np.ones((2, 8, 12), np.int32)
    mask[:, :, 10:] = 0
    micro = {"input_ids": ids, "attention_mask": mask, "targets": ids}
    metrics = phases.indexer_recall(recall, policy.state, micro)
    assert set(metrics) == {"indexer/recall", "indexer/recall/layer_0"}  # tiny.yaml: one sparse layer
    assert 0.0 < metrics["indexer/recall"] <= 1.0 and metrics["indexer/recall"] == metrics["indexer/recall/layer_0"]
    want = np.asarray(policy.model().indexer_recall(jnp.asarray(ids[0]), attention_mask=jnp.asarray(mask[0])))
    assert metrics["indexer/recall"] == pytest.approx(float(want[0]), rel=1e-6)


@pytest.mark.extended  # widens a check the default run keeps (the suite's 15-minute bound)
@pytest.mark.slow  # one tiny trainer, two GRPO steps (~15 s on the shared 2-core CPU)
def test_trainer_logs_the_recall_every_n_steps(tmp_path):
    from rl.trainer import GRPOTrainer
    trainer = GRPOTrainer(_cfg(tmp_path, "logging.indexer_recall_every=2"))
    try:
        first, second = trainer.step(0), trainer.step(1)
    finally:
        trainer.engine.shutdown()
    assert 0.0 < first["indexer/recall"] <= 1.0 and first["indexer/recall"] == first["indexer/recall/layer_0"]
    assert "indexer/recall" not in second and "time/indexer_recall" not in second


def test_curves_have_a_recall_panel_only_when_logged(tmp_path):
    from rl.observe import PLOTS, RECALL_PANEL, panels, plot_run
    rows = [{"step": s, "reward/mean": 0.1 * s} for s in range(1, 6)]
    assert panels(rows) == PLOTS
    for r in rows[::2]:
        r.update({"indexer/recall": 0.9, "indexer/recall/layer_10": 0.8, "indexer/recall/layer_2": 1.0})
    assert panels(rows)[RECALL_PANEL] == ("indexer/recall", "indexer/recall/layer_2", "indexer/recall/layer_10")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_run(str(tmp_path))
    assert Path(out).stat().st_size > 10_000


@pytest.mark.extended  # widens a check the default run keeps (the suite's 15-minute bound)
@pytest.mark.slow  # compiles the forward on an 8-device mesh, two impls (~10 s on the shared 2-core CPU)
@pytest.mark.parametrize("impl", ["gather", "masked"])
def test_recall_under_context_parallelism_equals_one_device(impl):
    """On a 2 (data) x 4 (context) mesh, through the trainer's pass (3 rows: one padding row added for the
    data axis, not counted), the recall is the single device's."""
    from rl.policy import make_indexer_recall
    from sharding.mesh import MeshConfig, build_mesh

    options = {} if impl == "gather" else dict(sparse_attention="masked")
    ids = random_ids(CFG, 3, 32, seed=2)
    mask = np.ones((3, 32), np.int32)
    mask[2, 20:] = 0
    want = model_recall(m3_model(CFG, seed=3, **options), ids, mask)
    layout = build_mesh(MeshConfig(data=2, context=4), CFG, seq_len=32, batch=4)
    sharded = m3_model(CFG, seed=3, layout=layout, **options)
    graphdef, params, rest = nnx.split(sharded, nnx.Param, ...)
    recall = make_indexer_recall(types.SimpleNamespace(graphdef=graphdef, layout=layout))
    got = np.asarray(phases._on_host(recall(params, rest, {"input_ids": ids, "attention_mask": mask})))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert (got < 1.0).all()
