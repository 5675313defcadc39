"""GSPO, CISPO and REINFORCE (rl/grpo/objectives.py) through the loss, against values and gradients worked
out by hand in the comments (never with the functions under test). ppo_clip has its own cases in
tests/test_grpo_loss.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.grpo import POLICY_LOSSES, LossConfig, get_policy_loss, grpo_loss

PLAIN = dict(dual_clip=None, is_correction="none")   # no importance weight: the objective alone


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def _value_and_grad(lp, lo, adv, mask, **cfg):
    c = LossConfig(**{**PLAIN, **cfg})
    (loss, st), g = jax.value_and_grad(lambda x: grpo_loss(x, lo, lo, adv, mask, c), has_aux=True)(jnp.asarray(lp))
    return float(loss), st, np.asarray(g)


def test_registry():
    assert tuple(POLICY_LOSSES) == ("ppo_clip", "gspo", "cispo", "reinforce", "kl_cov")
    with pytest.raises(ValueError, match=r"'ppo'.*ppo_clip.*gspo.*cispo.*reinforce"):
        get_policy_loss("ppo")


# ---------------------------------------------------------------- GSPO
# Sequence 0: 2 valid tokens (and a padding slot holding garbage), log-ratios lp - lo = 0.2, -0.1
#   s0 = exp(mean) = exp(0.05) = 1.051271; its tokens alone would be 1.2214 and 0.9048.
# Sequence 1: 3 tokens, log-ratios 0.3, 0.0, -0.6: s1 = exp(-0.1) = 0.904837.
GSPO_LO = np.array([[-1.0, -2.0, -np.inf], [-0.5, -1.5, -1.0]], np.float32)
GSPO_LP = GSPO_LO + np.array([[0.2, -0.1, 0.0], [0.3, 0.0, -0.6]], np.float32)
GSPO_LP[0, 2] = np.nan
GSPO_MASK = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
S0, S1 = math.exp(0.05), math.exp(-0.1)


def test_gspo_unclipped_value_and_gradient():
    # eps 0.1 / 0.1: both sequences inside [0.9, 1.1]. Per token -s*A; gradient -A*s through each token.
    adv = np.array([1.0, 2.0], np.float32)
    loss, st, g = _value_and_grad(GSPO_LP, GSPO_LO, adv, GSPO_MASK, loss="gspo", gspo_eps_low=0.1, gspo_eps_high=0.1)
    close(loss, -2 * S0 - 3 * 2 * S1)                       # -2.102542 - 5.429025
    close(g, [[-S0, -S0, 0.0], [-2 * S1, -2 * S1, -2 * S1]])
    close(st["ratio_sum"], 2 * S0 + 3 * S1)
    assert float(st["clipped_tokens"]) == 0


def test_gspo_sequence_mean_is_the_papers_objective():
    # aggregation sequence_mean: loss_i = -s_i A_i, d/dlp_t = -A_i s_i / |y_i|  (d s_i / d lp_t = s_i / |y_i|)
    adv = np.array([1.0, 2.0], np.float32)
    loss, _, g = _value_and_grad(GSPO_LP, GSPO_LO, adv, GSPO_MASK, loss="gspo", gspo_eps_low=0.1, gspo_eps_high=0.1,
                                 aggregation="sequence_mean")
    close(loss, -S0 - 2 * S1)
    close(g, [[-S0 / 2, -S0 / 2, 0.0], [-2 * S1 / 3] * 3])


def test_gspo_clips_whole_sequences():
    # eps_low 0.05, eps_high 0.04: [0.95, 1.04].
    # seq 0, A = 1: s0 = 1.0513 > 1.04 -> min(s0, 1.04) = 1.04 on BOTH tokens (token 1's own ratio 0.905 is
    #   inside the band: the decision is the sequence's), no gradient.
    # seq 1, A = 2: s1 = 0.9048 < 0.95 -> min(2 s1, 2*0.95) = 2 s1, unclipped: gradient -2 s1.
    adv = np.array([1.0, 2.0], np.float32)
    loss, st, g = _value_and_grad(GSPO_LP, GSPO_LO, adv, GSPO_MASK, loss="gspo", gspo_eps_low=0.05,
                                  gspo_eps_high=0.04)
    close(loss, -2 * 1.04 - 3 * 2 * S1)                     # -7.509025
    close(g, [[0.0, 0.0, 0.0], [-2 * S1] * 3])
    assert float(st["clipped_tokens"]) == 2
    # A = -1 on sequence 0: min(-s0, -1.04) = -s0 (unclipped, pessimistic side): loss +s0 per token, gradient +s0
    loss, st, g = _value_and_grad(GSPO_LP, GSPO_LO, np.array([-1.0, 2.0], np.float32), GSPO_MASK, loss="gspo",
                                  gspo_eps_low=0.05, gspo_eps_high=0.04)
    close(loss, 2 * S0 - 3 * 2 * S1)
    close(g[0], [S0, S0, 0.0])


# ---------------------------------------------------------------- CISPO
# three one-token rows, lo = -1, ratios r = 1.5, 0.5, 1.1, so lp = -1 + log r = -0.594535, -1.693147, -0.904690

CISPO_LO = np.full((3, 1), -1.0, np.float32)
CISPO_LP = CISPO_LO + np.log(np.array([[1.5], [0.5], [1.1]], np.float32))
CISPO_ADV = np.array([1.0, 1.0, -2.0], np.float32)


def test_cispo_value_and_gradient():
    # eps_low None (no lower bound), eps_high 0.28: r_hat = 1.28, 0.5, 1.1; loss_t = -r_hat * A * lp
    #   = -(1.28)(1)(-0.594535) + -(0.5)(1)(-1.693147) + -(1.1)(-2)(-0.904690) = 0.761005 + 0.846574 - 1.990318
    # gradient -r_hat * A = -1.28, -0.5, 2.2: row 0 keeps a gradient where ppo_clip's would be 0
    loss, st, g = _value_and_grad(CISPO_LP, CISPO_LO, CISPO_ADV, np.ones((3, 1), np.float32), loss="cispo")
    close(loss, 0.761005 + 0.846574 - 1.990318)
    close(g[:, 0], [-1.28, -0.5, 2.2])
    assert float(st["clipped_tokens"]) == 1
    _, _, g_ppo = _value_and_grad(CISPO_LP, CISPO_LO, CISPO_ADV, np.ones((3, 1), np.float32), loss="ppo_clip")
    assert g_ppo[0, 0] == 0.0


def test_cispo_lower_bound():
    # cispo_eps_low 0.4: row 1's weight 0.5 is raised to 0.6 -> loss -(0.6)(1)(-1.693147) = 1.015888, gradient -0.6
    loss, st, g = _value_and_grad(CISPO_LP, CISPO_LO, CISPO_ADV, np.ones((3, 1), np.float32), loss="cispo",
                                  cispo_eps_low=0.4, cispo_eps_high=0.28)
    close(loss, 0.761005 + 1.015888 - 1.990318)
    close(g[:, 0], [-1.28, -0.6, 2.2])
    assert float(st["clipped_tokens"]) == 2


# ---------------------------------------------------------------- REINFORCE

def test_reinforce_value_and_gradient():
    # loss_t = -A * lp: -(1.5)(-0.5) + -(-1)(-2.0) = 0.75 - 2.0; gradient -A = -1.5, 1 whatever the ratio
    # (lo is far from lp: r = 2, which ppo_clip would clip)
    lp = np.array([[-0.5], [-2.0]], np.float32)
    loss, st, g = _value_and_grad(lp, lp - 0.7, np.array([1.5, -1.0], np.float32), np.ones((2, 1), np.float32),
                                  loss="reinforce")
    close(loss, -1.25)
    close(g[:, 0], [-1.5, 1.0])
    assert float(st["clipped_tokens"]) == 0


# ---------------------------------------------------------------- KL-Cov
# Six valid tokens, A = +1 (row 0) and -1 (row 1); lp row 0 [-1, -2, -3], row 1 [-0.5, -1.5, -2.5] (+ a padding
# slot each, holding garbage). mean lp = -10.5 / 6 = -1.75, mean A = 0, so cov = (lp + 1.75) A:
#   row 0: 0.75, -0.25, -1.25    row 1: -1.25, -0.25, 0.75
# k = floor(ratio * 6): ratio 0.2 -> 1 token, the tie at 0.75 going to the earlier position (0, 0); ratio 0.34 -> 2.
# log-ratios lp - lo: (0, 0) 0.1, (1, 2) -0.2, the rest 0.
KC_LP = np.array([[-1.0, -2.0, -3.0, np.nan], [-0.5, -1.5, -2.5, 7.0]], np.float32)
KC_LO = KC_LP - np.array([[0.1, 0, 0, 0], [0, 0, -0.2, 0]], np.float32)
KC_MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], np.float32)
KC_ADV = np.array([1.0, -1.0], np.float32)


@pytest.mark.parametrize("ratio, selected", [(0.2, [(0, 0)]), (0.34, [(0, 0), (1, 2)])])
def test_kl_cov_penalises_the_tokens_of_largest_covariance(ratio, selected):
    loss, st, g = _value_and_grad(KC_LP, np.nan_to_num(KC_LO), KC_ADV, KC_MASK, loss="kl_cov", kl_cov_ratio=ratio,
                                  kl_cov_coef=0.5)
    r = np.exp(np.nan_to_num(KC_LP - KC_LO))
    pg = -r * KC_ADV[:, None]
    want_g = pg.copy()  # d(-r A)/d lp = -r A
    pen = np.zeros_like(pg)
    for i, j in selected:  # + 0.5 |lp - lo|, gradient 0.5 sign(lp - lo)
        pen[i, j] = 0.5 * abs(float(KC_LP[i, j] - KC_LO[i, j]))
        want_g[i, j] += 0.5 * np.sign(KC_LP[i, j] - KC_LO[i, j])
    close(loss, float(np.sum(KC_MASK * (pg + pen))))
    close(g, KC_MASK * want_g)
    assert float(st["clipped_tokens"]) == len(selected)
    close(want_g[0, 0], -math.exp(0.1) + 0.5)  # the hand number: -1.10517 + 0.5


def test_kl_cov_selects_nothing_without_valid_tokens():
    loss, st, g = _value_and_grad(KC_LP, np.nan_to_num(KC_LO), KC_ADV, np.zeros_like(KC_MASK), loss="kl_cov")
    assert loss == 0.0 and float(st["clipped_tokens"]) == 0 and not np.any(g)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        LossConfig(kl_cov_ratio=0.0)


# ---------------------------------------------------------------- all of them

@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_on_policy_gradient_is_the_same_and_importance_weight_applies(name):
    """lp == lo: every objective's gradient is -w_eff * A per token; the truncated weight (w = 3 -> 2, 0.5) and a
    -inf generator log-prob (weight 0) act on each of them as on ppo_clip."""
    lo = np.array([[-1.0, -2.0], [-0.5, -1.5]], np.float32)
    lg = lo - np.log(np.array([[3.0, 0.5], [1.0, 1.0]], np.float32))
    lg[1, 1] = -np.inf
    adv = np.array([1.0, -2.0], np.float32)
    c = LossConfig(loss=name, dual_clip=None, is_correction="truncate", is_cap=2.0)
    g = jax.grad(lambda x: grpo_loss(x, lo, lg, adv, np.ones((2, 2), np.float32), c)[0])(jnp.asarray(lo))
    close(g, [[-2.0, -0.5], [2.0, 0.0]])


def test_config_section_reaches_the_loss():
    from rl.config import GrpoSection
    g = GrpoSection(loss="cispo", cispo_eps_low=0.1, cispo_eps_high=4.0, is_floor=0.5, kl="k2", kl_coef=0.1,
                    kl_on_policy=True, gspo_eps_high=1e-3, kl_cov_ratio=0.01, kl_cov_coef=0.5)
    c = g.loss_config(5)
    assert (c.kl_cov_ratio, c.kl_cov_coef) == (0.01, 0.5)
    assert (c.loss, c.cispo_eps_low, c.cispo_eps_high, c.is_floor, c.kl, c.kl_on_policy, c.gspo_eps_high) == \
        ("cispo", 0.1, 4.0, 0.5, "k2", True, 1e-3)
    assert GrpoSection().loss_config().loss == "ppo_clip"
