"""Generator-vs-trainer mismatch diagnostics against hand-computed numbers (rl/grpo/mismatch.py)."""

import math

import numpy as np

from rl.grpo import LossConfig, generation_mismatch_metrics, grpo_loss


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def test_mismatch_on_policy():
    lp = np.array([[-0.5, -1.5, -3.0], [-2.0, -0.1, -9.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    for kind in ("k1", "k3"):
        m = generation_mismatch_metrics(lp, lp, mask, kl_type=kind)
        assert float(m["gen_kl_error"]) == 0.0 and float(m["policy_kl_error"]) == 0.0
        assert float(m["token_mult_prob_error"]) == 1.0
        assert float(m["seq_mult_prob_error_median"]) == 1.0
    # and the loss, on policy with A = 1: every token -1, nothing clipped / truncated / out of band
    loss, st = grpo_loss(lp, lp, lp, np.ones(2, np.float32), mask, LossConfig())
    close(loss, -5.0)
    assert float(st["clipped_tokens"] + st["is_truncated_tokens"] + st["is_out_of_band_tokens"]) == 0.0
    close(st["ratio_sum"], 5.0)
    close(st["neg_logp_sum"], 0.5 + 1.5 + 3.0 + 2.0 + 0.1)


def test_mismatch_hand_values():
    lo = np.array([[-1.0, -1.0], [-1.0, -1.0]], np.float32)
    lg = np.array([[-0.9, -1.2], [-1.5, 0.0]], np.float32)      # d = logp_gen - logp_old = .1, -.2 | -.5, (pad)
    mask = np.array([[1, 1], [1, 0]], np.float32)
    m = generation_mismatch_metrics(lg, lo, mask)
    close(m["token_mult_prob_error"], (math.exp(0.1) + math.exp(0.2) + math.exp(0.5)) / 3)
    k3 = lambda x: math.exp(x) - 1 - x                           # noqa: E731
    close(m["gen_kl_error"], (k3(-0.1) + k3(0.2) + k3(0.5)) / 3)  # x = logp_old - logp_gen
    close(m["policy_kl_error"], (k3(0.1) + k3(-0.2) + k3(-0.5)) / 3)
    close(m["seq_mult_prob_error"], [(math.exp(0.1) + math.exp(0.2)) / 2, math.exp(0.5)])
    close(m["seq_mult_prob_error_median"], ((math.exp(0.1) + math.exp(0.2)) / 2 + math.exp(0.5)) / 2)
    m1 = generation_mismatch_metrics(lg, lo, mask, kl_type="k1")
    close(m1["gen_kl_error"], (0.1 - 0.2 - 0.5) / 3)             # mean of logp_gen - logp_old
    close(m["tokens"], 3.0)
    close(m["mult_prob_error_sum"], math.exp(0.1) + math.exp(0.2) + math.exp(0.5))


def test_mismatch_leaves_out_non_finite_generator_logprobs():
    """A -inf (or NaN) generator log-prob on a valid token would make every mean infinite: left out."""
    lo = np.array([[-1.0, -1.0, -1.0]], np.float32)
    lg = np.array([[-0.9, -np.inf, np.nan]], np.float32)
    m = generation_mismatch_metrics(lg, lo, np.ones((1, 3), np.float32))
    close(m["tokens"], 1.0)
    close(m["token_mult_prob_error"], math.exp(0.1))
    close(m["gen_kl_error"], math.exp(-0.1) - 1 + 0.1)
