"""The exact entropy of the sampling distribution: its formula, its gradient, the chunked path, the loss's bonus
(`grpo.entropy_coef`) and its metric (`logging.entropy`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.generation.base import sampling_logits, token_logprobs, token_logprobs_and_entropy
from rl.grpo.loss import LossConfig, grpo_loss
from rl.logprobs import chunked_token_logprobs

SETTINGS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 7), (1.0, 0.5, 5)]  # temperature, top_p, top_k


def _kept_np(z: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """The tokens the sampler may draw, from the definitions: the k largest, then the smallest prefix of the
    descending order whose mass before a token is < top_p."""
    keep = np.ones_like(z, bool)
    if top_k:
        keep &= z >= np.sort(z, axis=-1)[..., -top_k][..., None]
    zk = np.where(keep, z, -np.inf)
    order = np.argsort(-zk, axis=-1)
    p = np.exp(zk - zk.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    before = np.cumsum(np.take_along_axis(p, order, -1), -1) - np.take_along_axis(p, order, -1)
    nucleus = np.zeros_like(keep)
    np.put_along_axis(nucleus, order, before < top_p, -1)
    return keep & nucleus


def _entropy_np(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    kept = _kept_np(z, top_p, top_k)
    z = np.where(kept, z, -np.inf)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return -np.sum(np.where(kept, p * np.log(np.where(kept, p, 1.0)), 0.0), axis=-1)


@pytest.mark.parametrize("temperature, top_p, top_k", SETTINGS)
def test_entropy_is_the_sampling_distributions_and_logp_is_unchanged(temperature, top_p, top_k):
    rng = np.random.default_rng(0)
    logits = (2.0 * rng.standard_normal((3, 5, 50))).astype(np.float32)
    tokens = rng.integers(0, 50, (3, 5))
    lp, h = token_logprobs_and_entropy(jnp.asarray(logits), jnp.asarray(tokens), temperature, top_p, top_k)
    np.testing.assert_allclose(np.asarray(h), _entropy_np(logits, temperature, top_p, top_k), rtol=2e-5, atol=1e-6)
    # the same logp as token_logprobs, bit for bit (-inf where the transform drops the token)
    want = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), temperature, top_p, top_k)
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(want))
    if top_p < 1 or top_k:
        assert np.all(_kept_np(logits / temperature, top_p, top_k).sum(-1) < 50)  # the case has dropped tokens


@pytest.mark.parametrize("temperature, top_p, top_k", SETTINGS)
def test_entropy_gradient_is_the_formula_and_finite_where_tokens_are_dropped(temperature, top_p, top_k):
    """dH/dz_v = -p_v (log p_v + H) / temperature on the kept tokens, 0 on the dropped ones."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray((2.0 * rng.standard_normal((4, 40))).astype(np.float32))
    tokens = jnp.zeros((4,), jnp.int32)
    grad = jax.grad(lambda x: jnp.sum(token_logprobs_and_entropy(x, tokens, temperature, top_p, top_k)[1]))(logits)
    z = sampling_logits(logits, temperature, top_p, top_k)
    logp = jax.nn.log_softmax(z, axis=-1)
    h = token_logprobs_and_entropy(logits, tokens, temperature, top_p, top_k)[1]
    kept = jnp.isfinite(z)
    want = jnp.where(kept, -jnp.exp(logp) * (logp + h[:, None]) / temperature, 0.0)
    assert np.all(np.isfinite(np.asarray(grad)))
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk", [4, 13])
def test_chunked_entropy_and_its_gradients_equal_the_full_logits(chunk):
    rng = np.random.default_rng(2)
    h = jnp.asarray(rng.standard_normal((2, 13, 8)).astype(np.float32))
    w = jnp.asarray((0.5 * rng.standard_normal((30, 8))).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 30, (2, 13)).astype(np.int32))
    ct_lp, ct_h = (jnp.asarray(rng.standard_normal((2, 13)).astype(np.float32)) for _ in range(2))
    s = (0.8, 0.9, 0)

    def full(h, w):
        return token_logprobs_and_entropy(jnp.einsum("btd,vd->btv", h, w), y, *s)

    def chunked(h, w):
        return chunked_token_logprobs(h, w, y, *s, chunk_tokens=chunk, with_entropy=True)

    def weighted(f):
        return lambda h, w: jnp.sum(ct_lp * f(h, w)[0]) + jnp.sum(ct_h * f(h, w)[1])

    for got, want in zip(chunked(h, w), full(h, w)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    g_got = jax.grad(weighted(chunked), argnums=(0, 1))(h, w)
    g_want = jax.grad(weighted(full), argnums=(0, 1))(h, w)
    for got, want in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_sharded_chunked_entropy_equals_one_device():
    """Batch, sequence and vocabulary cut over data 2 x context 2 x tensor 2, the head gradient summed per batch
    shard (`rl.logprobs.HEAD_PARTIALS`): the entropy and both gradients are one device's."""
    from sharding.mesh import MeshConfig, build_mesh
    layout = build_mesh(MeshConfig(2, 2, 1, 2))
    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.standard_normal((4, 32, 16)).astype(np.float32))
    w = jnp.asarray((0.5 * rng.standard_normal((40, 16))).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 40, (4, 32)).astype(np.int32))
    ct = jnp.asarray(rng.standard_normal((4, 32)).astype(np.float32))
    s = (0.7, 0.9, 5)

    def value_and_grads(fn, h, w):
        loss = lambda h, w: jnp.sum(ct * fn(h, w)[1])  # noqa: E731  (the entropy's gradient alone)
        return jax.jit(lambda h, w: (fn(h, w)[1], jax.grad(loss, argnums=(0, 1))(h, w)))(h, w)

    want = value_and_grads(lambda h, w: token_logprobs_and_entropy(jnp.einsum("btd,vd->btv", h, w), y, *s), h, w)
    h_s = jax.device_put(h, layout.sharding(("act_batch", "act_seq", "act_embed")))
    w_s = jax.device_put(w, layout.sharding(("vocab", "embed")))
    with jax.set_mesh(layout.mesh):
        got = value_and_grads(lambda h, w: chunked_token_logprobs(
            h, w, jax.device_put(y, layout.sharding(("act_batch", "act_seq"))), *s, chunk_tokens=8, layout=layout,
            head_axes=("vocab", "embed"), with_entropy=True), h_s, w_s)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_the_loss_subtracts_the_bonus_and_needs_the_entropy():
    rng = np.random.default_rng(3)
    lp = jnp.asarray(-rng.random((2, 6)).astype(np.float32))
    ent = jnp.asarray(rng.random((2, 6)).astype(np.float32))
    mask = jnp.asarray(np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], np.float32))
    adv = jnp.asarray([0.5, -1.0])
    cfg0, cfg = LossConfig(), LossConfig(entropy_coef=0.05)
    base, stats0 = grpo_loss(lp, lp, lp, adv, mask, cfg0)
    assert "entropy_sum" not in stats0
    with_bonus, stats = grpo_loss(lp, lp, lp, adv, mask, cfg, entropy=ent)
    assert float(stats["entropy_sum"]) == pytest.approx(float(jnp.sum(mask * ent)), rel=1e-6)
    assert float(with_bonus) == pytest.approx(float(base) - 0.05 * float(jnp.sum(mask * ent)), rel=1e-6)
    d_ent = jax.grad(lambda e: grpo_loss(lp, lp, lp, adv, mask, cfg, entropy=e)[0])(ent)
    np.testing.assert_allclose(np.asarray(d_ent), -0.05 * np.asarray(mask), rtol=1e-6)
    with pytest.raises(ValueError, match="entropy_coef=0.05 needs the per-token entropy"):
        grpo_loss(lp, lp, lp, adv, mask, cfg)
    with pytest.raises(ValueError, match="entropy_coef"):
        LossConfig(entropy_coef=-0.1)


def test_config_fields():
    from rl.config import ConfigError, load_config
    from tests.tiny_runs import TINY
    cfg = load_config(str(TINY), ["grpo.entropy_coef=0.01", "logging.entropy=true"])
    assert cfg.grpo.loss_config().entropy_coef == 0.01 and cfg.logging.entropy is True
    with pytest.raises(ConfigError, match="grpo.entropy_coef"):
        load_config(str(TINY), ["grpo.entropy_coef=-1"])


@pytest.mark.slow  # three one-step runs of the tiny trainer
def test_a_run_logs_the_entropy_and_the_bonus_moves_the_loss_by_it(tmp_path):
    from tests.tiny_runs import first_step

    plain = first_step(tmp_path, "plain")
    logged = first_step(tmp_path, "logged", "logging.entropy=true")
    bonus = first_step(tmp_path, "bonus", "grpo.entropy_coef=0.05")
    assert "entropy" not in plain and "entropy" in logged and "entropy" in bonus
    # the metric changes nothing the step computes; on policy, mean -log p of the sampled tokens estimates it
    for k in ("loss", "grad_norm", "entropy_approx", "reward/mean"):
        assert logged[k] == pytest.approx(plain[k], rel=1e-5), k
    assert logged["entropy"] == pytest.approx(logged["entropy_approx"], rel=0.1)
    # the same samples and weights: the bonus lowers the loss by coef x the token-mean entropy
    assert bonus["entropy"] == pytest.approx(logged["entropy"], rel=1e-6)
    assert bonus["loss"] == pytest.approx(plain["loss"] - 0.05 * logged["entropy"], rel=1e-5, abs=1e-6)
    assert bonus["grad_norm"] != pytest.approx(plain["grad_norm"], rel=1e-6)  # and its gradient reaches the weights


def test_top_k_one_below_the_vocabulary_drops_the_least_likely_token():
    """Only a top_k of the vocabulary's size or more keeps every token: V - 1 must still drop the smallest."""
    logits = jnp.array([[0.5, 2.0, -1.0, 1.0]])
    kept = np.isfinite(np.asarray(sampling_logits(logits, 1.0, 1.0, 3)))
    np.testing.assert_array_equal(kept, [[True, True, False, True]])
    assert np.isfinite(np.asarray(sampling_logits(logits, 1.0, 1.0, 4))).all()


def test_top_p_drops_a_token_whose_preceding_mass_equals_top_p():
    """The nucleus is the smallest prefix whose mass reaches top_p: a token whose preceding mass equals top_p
    exactly is outside it (that prefix already reached top_p), and one ulp more of top_p takes it in. top_p is
    set to the preceding mass computed as `sampling_logits` computes it, so the equality is exact in fp32."""
    z = jnp.array([2.0, 1.0, 0.0, -1.0])                  # already sorted, descending
    probs = jax.nn.softmax(z)
    before = float((jnp.cumsum(probs) - probs)[1])         # mass before the second token
    kept = np.isfinite(np.asarray(sampling_logits(z[None], 1.0, before)))[0]
    np.testing.assert_array_equal(kept, [True, False, False, False])
    above = float(np.nextafter(np.float32(before), np.float32(1.0)))
    kept = np.isfinite(np.asarray(sampling_logits(z[None], 1.0, above)))[0]
    np.testing.assert_array_equal(kept, [True, True, False, False])
