"""A token whose log-ratio lp - lo passes float32's exp (88.7) leaves every objective's loss and gradient finite
(rl.grpo.objectives.LOG_RATIO_CAP): r was inf, and the branch a clip does not select passed 0 * inf = NaN back, a
NaN gradient for the whole step from one token the clip covers (an audit, 2026-12-08)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.grpo import POLICY_LOSSES, LossConfig, grpo_loss
from rl.grpo.objectives import LOG_RATIO_CAP, _ratio

LO = np.array([[-90.0, -1.0, -2.0, -1.5], [-0.5, -1.5, -1.0, -2.0]], np.float32)
MOVED = np.array([[89.0, 0.1, -0.1, 0.0], [0.1, 0.0, -0.6, 0.05]], np.float32)  # token (0, 0): past exp's range


def value_and_grad(loss, adv, dual_clip=None):
    cfg = LossConfig(loss=loss, dual_clip=dual_clip, is_correction="none")
    lo, mask = jnp.asarray(LO), jnp.ones(LO.shape, jnp.float32)
    (value, _), grad = jax.value_and_grad(lambda lp: grpo_loss(lp, lo, lo, jnp.asarray(adv), mask, cfg),
                                          has_aux=True)(jnp.asarray(LO + MOVED))
    return float(value), np.asarray(grad)


@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
@pytest.mark.parametrize("a", [-1.0, 0.0, 1.0])
def test_the_loss_and_gradient_stay_finite(loss, a):
    value, grad = value_and_grad(loss, np.array([a, 0.5], np.float32))
    assert np.isfinite(value) and np.isfinite(grad).all(), (value, grad)


@pytest.mark.parametrize("a", [-1.0, 1.0])
def test_a_token_the_clip_covers_has_no_gradient(a):
    """ppo_clip with the recipe's dual clip: A > 0 is clipped at 1 + eps_high, A < 0 held at the dual clip's c A."""
    _, grad = value_and_grad("ppo_clip", np.array([a, 0.5], np.float32), dual_clip=10.0)
    assert grad[0, 0] == 0.0 and np.all(grad[1] != 0.0)


def test_below_the_cap_the_ratio_is_exp_itself():
    d = jnp.linspace(-100.0, LOG_RATIO_CAP, 10001)
    np.testing.assert_array_equal(np.asarray(_ratio(d, jnp.zeros_like(d))), np.asarray(jnp.exp(d)))
    grad = jax.grad(lambda x: jnp.sum(_ratio(x, jnp.zeros_like(x))))(d)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(jnp.exp(d)))
