"""GSPO, GMPO, SAPO, CISPO, REINFORCE, KL-Cov and Clip-Cov (rl/grpo/objectives.py) through the loss, against values
and gradients worked out by hand in the comments (never with the functions under test). ppo_clip has its own
cases in tests/test_grpo_loss.py.
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
    assert tuple(POLICY_LOSSES) == ("ppo_clip", "gspo", "gmpo", "sapo", "cispo", "reinforce", "kl_cov", "clip_cov")
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


# ---------------------------------------------------------------- GMPO
# eps 0.4 / 0.4 on the log-ratio d. Sequence 0, A = +1, d = 0.2, 0.5 (+ a padding slot): c = 0.2, 0.4 (the second
#   capped: no gradient), s0 = exp(0.3) = 1.349859.
# Sequence 1, A = -2, d = -0.6, 0.1, 0.3: for A < 0 only the floor binds: c = -0.4 (no gradient), 0.1, 0.3,
#   s1 = exp(0) = 1 (its 0.3 would be capped for A > 0, not here).
# Per token loss -A s_i; gradient -A s_i on the unclipped tokens.
GMPO_LO = np.array([[-1.0, -2.0, -np.inf], [-0.5, -1.5, -1.0]], np.float32)
GMPO_LP = GMPO_LO + np.array([[0.2, 0.5, 0.0], [-0.6, 0.1, 0.3]], np.float32)
GMPO_LP[0, 2] = np.nan
S_G0 = math.exp(0.3)


@pytest.mark.parametrize("aggregation", ["token", "sequence_mean"])
def test_gmpo_value_and_gradient(aggregation):
    adv = np.array([1.0, -2.0], np.float32)
    loss, st, g = _value_and_grad(GMPO_LP, GMPO_LO, adv, GSPO_MASK, loss="gmpo", aggregation=aggregation)
    if aggregation == "token":
        close(loss, 2 * -S_G0 + 3 * 2.0)
        close(g, [[-S_G0, 0.0, 0.0], [0.0, 2.0, 2.0]])
    else:  # the paper's objective: -A_i s_i per sequence, gradient -A_i s_i / |y_i| per unclipped token
        close(loss, -S_G0 + 2.0)
        close(g, [[-S_G0 / 2, 0.0, 0.0], [0.0, 2.0 / 3, 2.0 / 3]])
    close(st["ratio_sum"], 2 * S_G0 + 3 * 1.0)
    assert float(st["clipped_tokens"]) == 2


def test_gmpo_clip_is_per_token_where_gspos_is_per_sequence():
    # the same batch under gspo with a range as wide in ratio (e^0.4 - 1 = 0.49): sequence 0's ratio exp(0.35) =
    # 1.419 is inside it, so gspo keeps both tokens' gradients (the 0.5 token's too), gmpo drops the 0.5 one
    adv = np.array([1.0, -2.0], np.float32)
    _, _, g_gspo = _value_and_grad(GMPO_LP, GMPO_LO, adv, GSPO_MASK, loss="gspo", gspo_eps_low=0.33,
                                   gspo_eps_high=0.49)
    assert g_gspo[0, 1] != 0.0
    _, _, g = _value_and_grad(GMPO_LP, GMPO_LO, adv, GSPO_MASK, loss="gmpo")
    assert g[0, 1] == 0.0 and g[0, 0] != 0.0


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


# ---------------------------------------------------------------- SAPO
def test_sapo_value_and_gradient():
    # the CISPO rows: r = 1.5 (A = +1, tau 1), 0.5 (A = +1), 1.1 (A = -2, tau 2): loss -sigmoid(tau (r - 1)) 4 / tau A,
    # gradient -4 sigmoid'(tau (r - 1)) r A with sigmoid' = s (1 - s)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    cases = [(1.5, 1.0, 1.0), (0.5, 1.0, 1.0), (1.1, -2.0, 2.0)]
    loss, st, g = _value_and_grad(CISPO_LP, CISPO_LO, np.array([1.0, 1.0, -2.0], np.float32),
                                  np.ones((3, 1), np.float32), loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    close(loss, sum(-sig(t * (r - 1)) * 4 / t * a for r, a, t in cases))
    close(g[:, 0], [-4 * sig(t * (r - 1)) * (1 - sig(t * (r - 1))) * r * a for r, a, t in cases])
    assert float(st["clipped_tokens"]) == 0
    # a sharper gate (tau 20) keeps less of row 0's gradient than a soft one (tau 1), where ppo_clip keeps none
    _, _, sharp = _value_and_grad(CISPO_LP, CISPO_LO, np.array([1.0, 1.0, -2.0], np.float32),
                                  np.ones((3, 1), np.float32), loss="sapo", sapo_tau_pos=20.0)
    assert 0 < -sharp[0, 0] < -g[0, 0]


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


# ---------------------------------------------------------------- Clip-Cov
# The KL-Cov batch above (cov row 0: 0.75, -0.25, -1.25; row 1: -1.25, -0.25, 0.75), drawn from the band (0.5, 1):
# candidates (0, 0) and (1, 2). Their ratios exp(0.1) = 1.105171 (A = +1) and exp(-0.2) = 0.818731 (A = -1) lie
# inside ppo_clip's [0.8, 1.28]; every other token has r = 1. Unclipped, loss_t = -r A and d/dlp_t = -r A.
CC = dict(loss="clip_cov", clip_cov_lb=0.5, clip_cov_ub=1.0)
R00, R12 = math.exp(0.1), math.exp(-0.2)
CC_FULL_GRAD = np.array([[-R00, -1.0, -1.0, 0.0], [1.0, 1.0, R12, 0.0]])


def _zeroed(g):
    return {tuple(int(i) for i in ix) for ix in np.argwhere((g == 0) & (KC_MASK > 0))}


def test_clip_cov_draws_k_tokens_of_the_band_and_stops_their_gradient():
    # ratio 0.2: k = floor(1.2) = 1 of the two candidates; ratio 0.34: k = 2, both
    loss, st, g = _value_and_grad(KC_LP, np.nan_to_num(KC_LO), KC_ADV, KC_MASK, clip_cov_ratio=0.2, **CC)
    (drawn,) = _zeroed(g)
    assert drawn in {(0, 0), (1, 2)}
    want = CC_FULL_GRAD.copy()
    want[drawn] = 0.0
    close(g, want)
    close(loss, np.sum(want))  # loss_t = -r A = the gradient's value here; the drawn token's loss is 0
    assert float(st["clipped_tokens"]) == 1
    loss, st, g = _value_and_grad(KC_LP, np.nan_to_num(KC_LO), KC_ADV, KC_MASK, clip_cov_ratio=0.34, **CC)
    assert _zeroed(g) == {(0, 0), (1, 2)} and float(st["clipped_tokens"]) == 2
    # a band no token's covariance reaches: at least one is still asked for, none is drawn
    _, st, g = _value_and_grad(KC_LP, np.nan_to_num(KC_LO), KC_ADV, KC_MASK, **{**CC, "clip_cov_lb": 2.0,
                                                                              "clip_cov_ub": 3.0})
    close(g, CC_FULL_GRAD)
    assert float(st["clipped_tokens"]) == 0


def test_clip_cov_leaves_ppo_clipped_tokens_out_of_the_draw():
    # eps_high 0.05: (0, 0)'s ratio 1.105 > 1.05 with A > 0 is clipped (gradient 0, loss -1.05), so the draw's one
    # token is (1, 2), the only candidate left
    loss, st, g = _value_and_grad(KC_LP, np.nan_to_num(KC_LO), KC_ADV, KC_MASK, eps_high=0.05, **CC)
    want = CC_FULL_GRAD.copy()
    want[0, 0] = want[1, 2] = 0.0
    close(g, want)
    close(loss, -1.05 + np.sum(want))
    assert float(st["clipped_tokens"]) == 2


def test_clip_cov_draw_is_the_batchs_and_uniform_over_batches():
    """The same batch draws the same token; shifting lp and lo together (the ratios and covariances unchanged, the
    seed not) draws each of the two candidates about half the time."""
    draws = []
    for shift in range(64):
        lp, lo = KC_LP - 0.01 * shift, np.nan_to_num(KC_LO) - 0.01 * shift
        g = _value_and_grad(lp, lo, KC_ADV, KC_MASK, clip_cov_ratio=0.2, **CC)[2]
        assert _zeroed(g) == _zeroed(_value_and_grad(lp, lo, KC_ADV, KC_MASK, clip_cov_ratio=0.2, **CC)[2])
        draws.append(_zeroed(g) == {(0, 0)})
    assert 16 <= sum(draws) <= 48, sum(draws)  # binomial(64, 1/2): 4 standard deviations either side


def test_clip_cov_acts_on_policy():
    # lp == lo: unlike the other objectives the drawn token has no gradient (the others -A)
    lo = np.nan_to_num(KC_LO)
    _, _, g = _value_and_grad(lo, lo, KC_ADV, KC_MASK, **{**CC, "clip_cov_lb": -1.3, "clip_cov_ub": -1.2})
    (drawn,) = _zeroed(g)  # at lp = lo (mean -1.7333) cov of (0, 2) is -1.2667, of (1, 0) -1.2333
    assert drawn in {(0, 2), (1, 0)}
    want = np.array([[-1.0, -1.0, -1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    want[drawn] = 0.0
    close(g, want)


def test_clip_cov_config_errors():
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        LossConfig(clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="clip_cov_ub"):
        LossConfig(clip_cov_lb=2.0, clip_cov_ub=2.0)


# ---------------------------------------------------------------- all of them

@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_on_policy_gradient_is_the_same_and_importance_weight_applies(name):
    """lp == lo: every objective's gradient is -w_eff * A per token; the truncated weight (w = 3 -> 2, 0.5) and a
    -inf generator log-prob (weight 0) act on each of them as on ppo_clip. (No token's covariance here, at most
    0.375, lies in clip_cov's default band (1, 5): its on-policy draw is tested above.)"""
    lo = np.array([[-1.0, -2.0], [-0.5, -1.5]], np.float32)
    lg = lo - np.log(np.array([[3.0, 0.5], [1.0, 1.0]], np.float32))
    lg[1, 1] = -np.inf
    adv = np.array([1.0, -2.0], np.float32)
    c = LossConfig(loss=name, dual_clip=None, is_correction="truncate", is_cap=2.0)
    g = jax.grad(lambda x: grpo_loss(x, lo, lg, adv, np.ones((2, 2), np.float32), c)[0])(jnp.asarray(lo))
    close(g, [[-2.0, -0.5], [2.0, 0.0]])


@pytest.mark.parametrize("name, bound", [("ppo_clip", "eps_low"), ("ppo_clip", "eps_high"), ("clip_cov", "eps_low"),
                                         ("gspo", "gspo_eps_low"), ("gspo", "gspo_eps_high"), ("gmpo", "gmpo_eps_low"),
                                         ("gmpo", "gmpo_eps_high")])
def test_a_clip_range_of_zero_keeps_the_whole_on_policy_gradient(name, bound):
    """eps 0 puts r = 1 on the clip's bound: jnp.clip's gradient there is 1/2, and the objectives lost a quarter of
    the gradient (-0.75 A per token; a helper's audit). torch.clamp's is 1, and so is the objectives' now."""
    lo = np.array([[-1.0, -2.0]], np.float32)

    def grad(**eps):
        c = LossConfig(loss=name, **PLAIN, **eps)
        return jax.grad(lambda x: grpo_loss(x, lo, lo, np.array([1.0], np.float32), np.ones((1, 2), np.float32),
                                            c)[0])(jnp.asarray(lo))
    inside = grad()  # the default ranges: r = 1 strictly inside
    close(inside, [[-1.0, -1.0]])  # -A per token
    close(grad(**{bound: 0.0}), inside)


def test_config_section_reaches_the_loss():
    from rl.config import GrpoSection
    assert GrpoSection(loss="gmpo", gmpo_eps_low=0.3).loss_config().gmpo_eps_low == 0.3
    g = GrpoSection(loss="cispo", cispo_eps_low=0.1, cispo_eps_high=4.0, is_floor=0.5, kl="k2", kl_coef=0.1,
                    kl_on_policy=True, gspo_eps_high=1e-3, kl_cov_ratio=0.01, kl_cov_coef=0.5, clip_cov_ratio=0.01,
                    clip_cov_lb=0.5, clip_cov_ub=2.0, high_entropy_fraction=0.2)
    c = g.loss_config(5)
    assert (c.kl_cov_ratio, c.kl_cov_coef) == (0.01, 0.5)
    assert (c.clip_cov_ratio, c.clip_cov_lb, c.clip_cov_ub, c.high_entropy_fraction) == (0.01, 0.5, 2.0, 0.2)
    assert (c.loss, c.cispo_eps_low, c.cispo_eps_high, c.is_floor, c.kl, c.kl_on_policy, c.gspo_eps_high) == \
        ("cispo", 0.1, 4.0, 0.5, "k2", True, 1e-3)
    assert GrpoSection().loss_config().loss == "ppo_clip"


def test_clip_cov_and_the_entropy_selection_draw_the_same_tokens_on_a_mesh():
    """A micro-batch cut over 8 devices (rows x positions) draws the same Clip-Cov tokens and keeps the same
    high-entropy tokens as on one device: the seed is an integer sum, the draw and the quantile are global."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    rng = np.random.default_rng(7)
    lo = -rng.random((4, 16)).astype(np.float32) * 3
    lp = lo + 0.05 * rng.standard_normal((4, 16)).astype(np.float32)
    mask = (rng.random((4, 16)) < 0.8).astype(np.float32)
    adv, ent = rng.standard_normal(4).astype(np.float32), rng.random((4, 16)).astype(np.float32)
    cfg = LossConfig(**{**PLAIN, **CC, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0, "clip_cov_ratio": 0.1,
                        "high_entropy_fraction": 0.5})

    def grads(lp, lo, mask, ent):
        return jax.grad(lambda x: grpo_loss(x, lo, lo, adv, mask, cfg, entropy=ent)[0])(lp)

    want = np.asarray(jax.jit(grads)(lp, lo, mask, ent))
    mesh = jax.make_mesh((2, 4), ("rows", "positions"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("rows", "positions")))  # noqa: E731
    got = np.asarray(jax.jit(grads)(put(lp), put(lo), put(mask), put(ent)))
    assert 0 < int(np.sum((want == 0) & (mask > 0))) < int(np.sum(mask)) // 2 + 4  # something was dropped, not all
    np.testing.assert_array_equal(got == 0, want == 0)
    close(got, want)


@pytest.mark.parametrize("loss", ["kl_cov", "clip_cov"])
def test_the_covariance_losses_are_refused_on_one_sequence_micro_batches(loss):
    """Along one response the advantage is constant: every token's covariance is 0 up to rounding, so kl_cov
    penalised the tokens the rounding ranked first and clip_cov trained as ppo_clip (an audit, 2026-12-08)."""
    from rl.config import ConfigError, load_config
    from tests.test_run_config import TINY
    one_row = [f"grpo.loss={loss}", "grpo.dual_clip=null", "grpo.micro_batch_size=1"]
    with pytest.raises(ConfigError, match=rf"grpo.loss = \"{loss}\" with one sequence in each loss micro-batch "
                                          r"\(grpo.micro_batch_size x mesh.data x mesh.expert = 1\)"):
        load_config(TINY, one_row)
    load_config(TINY, [*one_row[:-1], "grpo.micro_batch_size=2"])
    load_config(TINY, [*one_row, "mesh.data=2"])  # two ranks' rows share the loss micro-batch
