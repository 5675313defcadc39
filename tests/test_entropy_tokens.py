"""The high-entropy token selection (`grpo.high_entropy_fraction`, rl/grpo/token_selection.py): the masked quantile
against numpy's, and the loss keeping the policy term of the selected tokens only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.grpo.loss import LossConfig, grpo_loss
from rl.grpo.token_selection import high_entropy_tokens, masked_quantile


@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 0.95, 1.0])
def test_masked_quantile_is_numpys_over_the_valid_entries(q):
    rng = np.random.default_rng(int(q * 100))
    for n_valid in (1, 2, 7, 40):
        x = rng.standard_normal((5, 8)).astype(np.float32)
        valid = np.zeros(40, bool)
        valid[rng.choice(40, n_valid, replace=False)] = True
        valid = valid.reshape(5, 8)
        x[~valid] = 1e30  # padding holds garbage: it must not count
        got = float(masked_quantile(jnp.asarray(x), jnp.asarray(valid), q))
        assert got == pytest.approx(float(np.quantile(x[valid].astype(np.float64), q)), rel=1e-6, abs=1e-6)
    assert float(masked_quantile(jnp.ones((2, 3)), jnp.zeros((2, 3), bool), q)) == 0.0


# Four valid tokens with entropies 0.1, 0.9 | 0.5, 0.3 and padding holding 100 (ignored). high_entropy_fraction 0.5:
# the 0.5 quantile of [0.1, 0.3, 0.5, 0.9] is 0.4, so (0, 1) and (1, 0) keep their policy term.
ENT = np.array([[0.1, 0.9, 100.0], [0.5, 0.3, 100.0]], np.float32)
MASK = np.array([[1, 1, 0], [1, 1, 0]], np.float32)
LP = np.array([[-1.0, -2.0, 0.0], [-0.5, -1.5, 0.0]], np.float32)
ADV = np.array([1.0, -2.0], np.float32)


def test_selection_keeps_the_top_share():
    got = np.asarray(high_entropy_tokens(jnp.asarray(ENT), jnp.asarray(MASK > 0), 0.5))
    np.testing.assert_array_equal(got, [[False, True, False], [True, False, False]])
    # 0.25: the 0.75 quantile is 0.5 + 0.25 (0.9 - 0.5) = 0.6, one token
    got = np.asarray(high_entropy_tokens(jnp.asarray(ENT), jnp.asarray(MASK > 0), 0.25))
    np.testing.assert_array_equal(got, [[False, True, False], [False, False, False]])


def test_the_loss_keeps_the_policy_term_of_the_high_entropy_tokens_only():
    """On policy the policy term's gradient is -A on the kept tokens and 0 on the others; the entropy bonus and the
    KL reach every token; the normaliser and the other sums do not change."""
    cfg = LossConfig(dual_clip=None, is_correction="none", high_entropy_fraction=0.5, entropy_coef=0.1, kl="k2",
                     kl_coef=0.5, kl_clamp=None, kl_log_ratio_clamp=None)
    ref = LP - 0.3  # k2 = (lp - ref)^2 / 2: gradient 0.3 per token

    def loss(lp, ent):
        return grpo_loss(lp, LP, LP, ADV, MASK, cfg, logp_ref=ref, entropy=ent)

    (value, stats), (d_lp, d_ent) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(jnp.asarray(LP),
                                                                                           jnp.asarray(ENT))
    np.testing.assert_allclose(np.asarray(d_lp), [[0.15, -1.0 + 0.15, 0.0], [2.0 + 0.15, 0.15, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(d_ent), -0.1 * MASK, rtol=1e-6)  # the bonus: every token
    # value: policy -A r on the kept tokens (-1 + 2), KL 0.5 * 0.045 on four, bonus -0.1 x (0.1 + 0.9 + 0.5 + 0.3)
    assert float(value) == pytest.approx(1.0 + 4 * 0.5 * 0.045 - 0.1 * 1.8, rel=1e-5)
    assert float(stats["low_entropy_tokens"]) == 2 and float(stats["tokens"]) == 4
    off = LossConfig(dual_clip=None, is_correction="none")
    assert "low_entropy_tokens" not in grpo_loss(LP, LP, LP, ADV, MASK, off)[1]


def test_it_needs_the_entropy_and_a_share_in_range():
    cfg = LossConfig(high_entropy_fraction=0.2)
    assert cfg.needs_entropy and not LossConfig().needs_entropy
    with pytest.raises(ValueError, match="LossConfig.high_entropy_fraction=0.2 needs the per-token entropy"):
        grpo_loss(LP, LP, LP, ADV, MASK, cfg)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="high_entropy_fraction"):
            LossConfig(high_entropy_fraction=bad)
    from rl.config import ConfigError, load_config
    from tests.tiny_runs import TINY
    with pytest.raises(ConfigError, match="grpo.high_entropy_fraction"):
        load_config(str(TINY), ["grpo.high_entropy_fraction=0"])
    with pytest.raises(ConfigError, match="grpo.clip_cov_ub"):
        load_config(str(TINY), ["grpo.loss=clip_cov", "grpo.clip_cov_lb=3", "grpo.clip_cov_ub=2"])


@pytest.mark.slow  # two one-step runs of the tiny trainer
def test_a_run_drops_the_low_entropy_tokens_policy_term(tmp_path):
    from tests.tiny_runs import first_step

    plain = first_step(tmp_path, "plain", "logging.entropy=true")
    top = first_step(tmp_path, "top", "grpo.high_entropy_fraction=0.2")
    assert "low_entropy_frac" not in plain
    assert 0.75 <= top["low_entropy_frac"] <= 0.8  # the top fifth kept (ties can only keep more)
    # the same samples and weights: the entropy the selection read is the one logging.entropy reports
    assert top["entropy"] == pytest.approx(plain["entropy"], rel=1e-6)
    assert top["reward/mean"] == plain["reward/mean"]
    assert top["grad_norm"] != pytest.approx(plain["grad_norm"], rel=1e-3)
