"""Group-relative advantages against hand-computed numbers (rl/grpo/advantages.py has the formulas).

Expected values are written out by hand, never computed with the functions under test.
"""

import math

import numpy as np
import pytest

from rl.grpo import (ADVANTAGE_ESTIMATORS, get_advantage_estimator, group_advantages, overlong_mask,
                     zero_variance_groups)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


REWARDS = np.array([1, 0, 0, 0,   1, 1, 1, 1,   0.0, 0.5, 1.0, 0.5], np.float32)


def test_advantages_std():
    # group 0: mean 1/4, Bessel std sqrt((0.75^2 + 3*0.25^2)/3) = 0.5
    # group 1: all equal -> no division, A = r - mean = 0
    # group 2: mean 0.5, std sqrt((0.25 + 0.25)/3) = sqrt(1/6)
    s2 = math.sqrt(1 / 6) + 1e-6
    want = [0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001,
            0, 0, 0, 0,
            -0.5 / s2, 0, 0.5 / s2, 0]
    close(group_advantages(REWARDS, 4), want)
    close(get_advantage_estimator("grpo")(REWARDS, 4), want)


def test_advantages_no_std():
    want = [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, -0.5, 0, 0.5, 0]
    close(group_advantages(REWARDS, 4, scale="none"), want)
    close(get_advantage_estimator("dr_grpo")(REWARDS, 4), want)


def test_advantages_leave_one_out():
    # baseline = mean of the 3 others: group 0 -> [0, 1/3, 1/3, 1/3]; group 2: [2/3, 1/2, 1/3, 1/2]
    want = [1, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0, -2 / 3, 0, 2 / 3, 0]
    close(group_advantages(REWARDS, 4, scale="none", leave_one_out=True), want)
    close(get_advantage_estimator("rloo")(REWARDS, 4), want)
    # RLOO = G/(G-1) * (r - mean)
    close(get_advantage_estimator("rloo")(REWARDS, 4), np.array(get_advantage_estimator("dr_grpo")(REWARDS, 4)) * 4 / 3)


def test_advantages_leave_one_out_std():
    r = np.array([1, 0, 0, 0], np.float32)
    # i=0: others [0,0,0] all equal -> no division: A = 1 - 0
    # i>0: others [1,0,0]: mean 1/3, Bessel std sqrt(((2/3)^2 + 2*(1/3)^2)/2) = sqrt(1/3)
    a = -(1 / 3) / (math.sqrt(1 / 3) + 1e-6)
    close(group_advantages(r, 4, leave_one_out=True), [1, a, a, a])
    # G = 2: the "other" set is one sample -> no division
    close(group_advantages(np.array([1.0, 0.0]), 2, leave_one_out=True), [1, -1])


def test_zero_variance_group():
    r = np.array([0.7, 0.7, 0.7, 0.7, 0.1, 0.3, 0.1, 0.1], np.float32)
    a = np.asarray(group_advantages(r, 4))
    assert np.all(a[:4] == 0.0) and np.all(np.isfinite(a))
    assert np.all(np.abs(a[4:]) > 0.1)
    assert list(np.asarray(zero_variance_groups(r, 4))) == [True, False]
    assert list(np.asarray(zero_variance_groups(REWARDS, 4))) == [False, True, False]
    # "zero variance" is exact (max == min), not a tolerance: a group whose rewards differ by a sliver (a partial
    # credit of 1e-4) still has a signal, and dynamic sampling must not drop it
    assert list(np.asarray(zero_variance_groups(np.array([0.0, 1e-4, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]), 4))) == \
        [False, True]


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_a_group_of_equal_rewards_gets_exactly_zero_advantages(name):
    """Every estimator: 0.3, 0.1, 0.7 and 2000 are not exact in binary, and fp32 means of eight of them leave a
    residue; it used to come out as advantages (REINFORCE++ scaled the residues of an all-constant batch by their own
    std: |A| up to 0.058), with or without a group that has a signal beside them."""
    constant = np.repeat(np.array([0.3, 0.1, 0.7, 2000.0], np.float32), 8)
    for rewards in (constant, np.concatenate([constant, np.array([0, 1, 0, 0, 1, 0, 0, 0], np.float32)])):
        a = np.asarray(get_advantage_estimator(name)(rewards, 8))
        assert np.all(a[:32] == 0.0), (name, np.abs(a[:32]).max())
        assert np.all(np.isfinite(a)) and (len(a) == 32 or np.abs(a[32:]).max() > 0.1)


def test_overlong_mask_and_registry_errors():
    close(overlong_mask(np.array([True, False, True])), [0, 1, 0])
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "grpo_loo", "reinforce_pp"}
    with pytest.raises(ValueError, match=r"'ppo'.*dr_grpo.*grpo.*grpo_loo.*rloo"):
        get_advantage_estimator("ppo")
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(np.zeros(6), 4)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(np.zeros(4), 4, scale="var")


def test_grpo_loo_hand_values():
    """NeMo-RL's default: leave-one-out baseline AND the Bessel std of the same other G-1 samples."""
    r = np.array([0.0, 0.5, 1.0, 0.5,   1, 0, 0, 1], np.float32)
    # group 0, i=0: others [.5, 1, .5]: mean 2/3, deviations -1/6, 1/3, -1/6 -> ss 1/6, var 1/12
    #   A = (0 - 2/3) / sqrt(1/12) = -2.3094; i=2 (others [0, .5, .5]): (1 - 1/3) / sqrt(1/12) = +2.3094
    #   i=1, 3 (others [0, 1, .5]): mean 1/2 -> A = 0
    # group 1, i=0: others [0, 0, 1]: mean 1/3, ss 2/9 + 4/9 -> std sqrt(1/3); A = (2/3) / sqrt(1/3) = 1.1547
    #   i=1: others [1, 0, 1]: mean 2/3, std sqrt(1/3); A = -(2/3) / sqrt(1/3)
    s12, s3 = math.sqrt(1 / 12) + 1e-6, math.sqrt(1 / 3) + 1e-6
    want = [-(2 / 3) / s12, 0, (2 / 3) / s12, 0,   (2 / 3) / s3, -(2 / 3) / s3, -(2 / 3) / s3, (2 / 3) / s3]
    close(get_advantage_estimator("grpo_loo")(r, 4), want)
    close(want[:4], [-2.3094, 0, 2.3094, 0], tol=1e-4)


def test_reinforce_pp_divides_the_group_centred_rewards_by_the_batchs_std():
    """REINFORCE++-baseline: r - group mean, over the Bessel std of all 12 centred rewards."""
    # centred: [.75, -.25, -.25, -.25,  0, 0, 0, 0,  -.5, 0, .5, 0]; squares sum 0.75 + 0.5 = 1.25 -> var 1.25 / 11
    s = math.sqrt(1.25 / 11) + 1e-6
    want = [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0, 0, 0, -0.5 / s, 0, 0.5 / s, 0]
    close(get_advantage_estimator("reinforce_pp")(REWARDS, 4), want)
    close(want[0], 2.2249, tol=1e-4)
    # a small-spread group keeps small advantages (GRPO would scale it up to its own std)
    r = np.array([0.0, 1.0, 0.0, 1.0, 0.50, 0.52, 0.50, 0.52], np.float32)
    a = np.asarray(get_advantage_estimator("reinforce_pp")(r, 4))
    assert np.max(np.abs(a[4:])) < 0.05 * np.max(np.abs(a[:4]))
    # no signal anywhere: zeros, not 0 / eps
    close(get_advantage_estimator("reinforce_pp")(np.full(8, 0.3, np.float32), 4), np.zeros(8))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_large_rewards_keep_their_advantages(name):
    """Every estimator is invariant to a shift of a group's rewards, and now computes as if the least were 0: at
    1e8 the fp32 group mean rounded by half a reward step, and GRPO's advantages of [1e8, 1e8 + 8] were [0, 1.41]
    (a helper's audit)."""
    small = np.array([0.0, 8.0, 8.0, 16.0, 24.0, 40.0, 32.0, 32.0], np.float32)  # fp32 holds each + 1e8 exactly
    estimator = get_advantage_estimator(name)
    np.testing.assert_allclose(np.asarray(estimator(small + 1e8, 4)), np.asarray(estimator(small, 4)), atol=1e-5)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_rewards_up_to_the_largest_taken_keep_their_scaled_advantages(name):
    """The estimators that divide by a std are invariant to a scale of the rewards, up to rl.rewards' largest taken
    value (1e30): the squares of deviations past ~1.8e19 overflowed float32, the std became inf and a group of
    [0, s, 0, s] got advantages 0 for s = 1e20 (an audit), a signal trained as none."""
    from rl.rewards.outcome import MAX_ABS_REWARD
    small = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.5], np.float32)
    estimator = get_advantage_estimator(name)
    unit = np.asarray(estimator(small, 4))
    for s in (1e20, 1e25, MAX_ABS_REWARD):
        got = np.asarray(estimator(small * np.float32(s), 4))
        want = unit * (s if name in ("dr_grpo", "rloo") else 1.0)  # the unscaled estimators scale with the rewards
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * (s if name in ("dr_grpo", "rloo") else 1.0))
