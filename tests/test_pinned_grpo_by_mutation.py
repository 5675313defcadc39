"""RL math a mutation audit changed without any test failing (session 55): the covariance KL-Cov and Clip-Cov rank
tokens by, the high-entropy selection's ties, the mismatch figures rebuilt from sums, and the step's logged loss and
dual-clip share. Each test names the slip it catches."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

# numpy here: a jax array at import would start jax's backend before tests/conftest.py sets its flags
LP = np.array([[-0.5, -2.0, -1.0, -3.0], [-0.2, -1.5, -0.7, -2.5]], np.float32)
LO = LP - np.array([[0.1, -0.1, 0.2, 0.05], [-0.2, 0.1, 0.05, -0.1]], np.float32)
ADV = np.array([[1.5] * 4, [-0.5] * 4], np.float32)  # a token mean of 0.5: rows of one sign dominate a micro-batch


def test_the_covariance_centres_the_advantages_too():
    """cov_t = (lp_t - mean lp) (A_t - mean A): which tokens KL-Cov penalises does not move when every advantage
    shifts by one constant. Uncentred advantages (a mutant) picked other tokens whenever their mean was not 0, the
    usual case: loss 4.284 -> 4.184, two tokens' gradients changed (one sign)."""
    from rl.grpo.objectives import _covariance, kl_cov
    v = np.ones(LP.shape, bool)
    v[1, 3] = False
    want = np.where(v, (LP - LP[v].mean()) * (ADV - ADV[v].mean()), 0.0)
    np.testing.assert_allclose(np.asarray(_covariance(jnp.asarray(LP), jnp.asarray(ADV), jnp.asarray(v))), want,
                               rtol=1e-5, atol=1e-6)
    m = jnp.asarray(v, jnp.float32)
    picked = [np.asarray(kl_cov(jnp.asarray(LP), jnp.asarray(LO), jnp.asarray(ADV + c), m, ratio=0.25,
                                coef=1.0).clipped) for c in (0.0, -0.5, 3.0)]
    assert picked[0].sum() >= 1 and all((p == picked[0]).all() for p in picked), picked


def test_tokens_tied_at_the_entropy_threshold_are_kept():
    """Under top-k / top-p many tokens have entropy exactly 0: with high_entropy_fraction 0.5 and the quantile at 0,
    every tied token keeps its policy term (the docstring's "more where values tie"); `>` for `>=` kept 2 of 8 and
    counted 6 as low-entropy."""
    from rl.grpo.loss import LossConfig, grpo_loss
    from rl.grpo.token_selection import high_entropy_tokens
    h = jnp.array([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 2.0]])
    assert int(high_entropy_tokens(h, jnp.ones(h.shape, bool), 0.5).sum()) == 8
    lp, m = -jnp.ones((2, 4)), jnp.ones((2, 4))
    _, stats = grpo_loss(lp, lp, lp, jnp.array([1.0, -1.0]), m, LossConfig(high_entropy_fraction=0.5), entropy=h)
    assert float(stats["low_entropy_tokens"]) == 0


def test_the_mismatch_figures_rebuilt_from_sums_are_the_direct_ones():
    """With grpo.old_logprobs: update the step logs them through `mismatch_from_sums`; gen_kl_error built from the
    policy-direction sum logged KL(train||gen) under KL(gen||train)'s name (0.0896 for 0.0797)."""
    from rl.grpo.mismatch import MISMATCH_SUMS, generation_mismatch_metrics, mismatch_from_sums
    lg, lo, mk = jnp.array([[-1.0, -0.5, -2.0]]), jnp.array([[-1.3, -0.1, -2.5]]), jnp.ones((1, 3))
    direct = generation_mismatch_metrics(lg, lo, mk)
    rebuilt = mismatch_from_sums({"mismatch/" + k: float(direct[k]) for k in MISMATCH_SUMS})
    assert set(rebuilt) == {"token_mult_prob_error", "gen_kl_error", "policy_kl_error"}
    assert abs(float(direct["gen_kl_error"]) - float(direct["policy_kl_error"])) > 1e-3  # the directions differ
    for name, value in rebuilt.items():
        assert value == pytest.approx(float(direct[name]), rel=1e-6), name


def test_a_step_logs_its_updates_mean_loss_and_each_clip_share_from_its_own_count():
    """Two updates of losses 1 and 3: the step's loss is 2 (the last update's, 3, under a mutant); dual_clip_frac is
    the dual-clipped tokens' share (clip_frac's under another)."""
    from rl import phases
    calls = iter([
        {"loss": 1.0, "grad_norm": 2.0, "skipped": 0, "empty": 0,
         "sums": {"tokens": 10.0, "clipped_tokens": 3.0, "dual_clipped_tokens": 1.0}},
        {"loss": 3.0, "grad_norm": 4.0, "skipped": 0, "empty": 0,
         "sums": {"tokens": 10.0, "clipped_tokens": 5.0, "dual_clipped_tokens": 0.0}}])
    _, stats = phases.update(lambda state, part: (state, next(calls)), None, {"x": np.zeros((2, 1, 3))}, 2)
    assert (stats.loss, stats.grad_norm) == (2.0, 3.0)
    assert stats.sums == {"tokens": 20.0, "clipped_tokens": 8.0, "dual_clipped_tokens": 1.0}
    rollout = types.SimpleNamespace(lengths=np.array([3, 3]), truncated=np.array([False, False]))
    samples = types.SimpleNamespace(completions=["a", "b"], rollout=rollout)
    adv = phases.Advantages(np.zeros(2), np.ones(2, np.float32), np.array([False]))
    micro = {"logp_gen": np.zeros((1, 2, 3), np.float32), "logp_old": np.zeros((1, 2, 3), np.float32),
             "loss_mask": np.ones((1, 2, 3), np.float32)}
    out = phases.step_metrics(samples, np.array([1.0, 0.0]), 0, adv, micro, stats, 1e-3, {}, 1.0)
    assert (out["loss"], out["clip_frac"], out["dual_clip_frac"]) == (2.0, 0.4, 0.05)


def test_the_policy_terms_sum_carries_the_importance_weight():
    """pg_loss_sum is the policy term as it enters the loss: with no KL and no entropy bonus it is loss_sum, also
    where a token's importance weight is truncated (taken before the weight, -2 for -3)."""
    from rl.grpo.loss import LossConfig, grpo_loss
    lp = jnp.array([[-1.0, -1.0]])
    loss, stats = grpo_loss(lp, lp, jnp.array([[-2.0, -1.0]]), jnp.array([1.0]), jnp.ones((1, 2)), LossConfig())
    assert float(stats["pg_loss_sum"]) == pytest.approx(float(loss)) == pytest.approx(-3.0)
