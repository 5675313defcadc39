"""eval.correct_threshold against what the evaluation's rewards can score (rl.config.reward_checks.threshold_problems):
a threshold no sample can reach, or one every sample reaches, is refused at load, for rewards that registered
their range (`register_reward(..., scores=)`; the built-ins: [0, 1])."""

import pytest

from rl.config import ConfigError, load_config
from rl.rewards import registry

TINY = "configs/tiny.yaml"


def _load(*overrides):
    return load_config(TINY, list(overrides), check_paths=False)


def test_a_threshold_above_the_most_the_rewards_sum_to_is_refused():
    with pytest.raises(ConfigError) as e:
        _load("eval.reward=[{name: exact_digits, weight: 0.5}]")  # the config's threshold: 1.0
    text = str(e.value)
    assert "eval.correct_threshold = 1.0: no sample can be correct" in text
    assert "exact_digits 0.5 x [0, 1]" in text and "score from 0 to 0.5" in text
    assert "allowed: a threshold in (0, 0.5]" in text
    assert _load("eval.reward=[{name: exact_digits, weight: 0.5}]", "eval.correct_threshold=0.5")


def test_a_threshold_every_sample_reaches_is_refused():
    with pytest.raises(ConfigError, match=r"eval.correct_threshold = 0.0: every sample would be correct, since the "
                                          r"rewards of reward \(copy_digits 1 x \[0, 1\]\) score from 0 to 1"):
        _load("eval.correct_threshold=0.0")
    assert _load("eval.correct_threshold=0.25").eval.correct_threshold == 0.25


def test_weights_sum_and_a_negative_weight_turns_its_range_over():
    cfg = _load("eval.reward=[{name: exact_digits, weight: 2.0}, {name: format, weight: 1.0}]",
                "eval.correct_threshold=3.0")
    assert cfg.eval.correct_threshold == 3.0
    with pytest.raises(ConfigError, match=r"score from -1 to 2; allowed: a threshold in \(-1, 2\]"):
        _load("eval.reward=[{name: exact_digits, weight: 2.0}, {name: format, weight: -1.0}]",
              "eval.correct_threshold=2.5")
    assert _load("eval.reward=[{name: exact_digits, weight: 2.0}, {name: format, weight: -1.0}]",
                 "eval.correct_threshold=2.0")


def test_not_checked_without_evaluation_or_for_a_reward_of_unknown_range():
    assert _load("eval.every_steps=0", "eval.at_start=false", "eval.correct_threshold=5.0")

    def unranged(completion, answer, **kw):
        return 7.0

    def ranged(completion, answer, **kw):
        return 7.0

    try:
        registry.register_reward("_test_unranged", mode="inline")(unranged)
        registry.register_reward("_test_ranged", mode="inline", scores=(0, 10))(ranged)
        assert registry.reward_scores("_test_unranged") is None and registry.reward_scores("_test_ranged") == (0, 10)
        assert _load("eval.reward=[{name: _test_unranged}, {name: exact_digits}]", "eval.correct_threshold=5.0")
        assert _load("eval.reward=[{name: _test_ranged}]", "eval.correct_threshold=5.0")
        with pytest.raises(ConfigError, match=r"_test_ranged 1 x \[0, 10\]\) score from 0 to 10"):
            _load("eval.reward=[{name: _test_ranged}]", "eval.correct_threshold=10.5")
    finally:
        registry._REGISTRY.pop("_test_unranged", None)
        registry._REGISTRY.pop("_test_ranged", None)


@pytest.mark.parametrize("scores", [(1, 0), (0, float("inf")), (0,), "01", (True, 1)])
def test_a_bad_range_is_refused_at_registration(scores):
    with pytest.raises(ValueError, match=r"expected \(least, most\), two finite numbers with least <= most"):
        registry.register_reward("_test_bad_range", scores=scores)(lambda completion, answer: 0.0)
    assert "_test_bad_range" not in registry.list_rewards()


def test_weights_that_sum_to_one_in_float32_allow_the_threshold_one():
    """0.7 + 0.2 + 0.1 is 0.9999999999999999 in float64, and the threshold 1.0 was refused; the run sums a perfect
    sample's rewards in float32 to exactly 1.0 and counts it correct."""
    specs = "[{name: copy_digits, weight: 0.7}, {name: reverse_digits, weight: 0.2}, {name: sort_digits, weight: 0.1}]"
    assert _load(f"eval.reward={specs}").eval.correct_threshold == 1.0
    reward, _, _ = registry.score_specs(_load(f"eval.reward={specs}").eval.reward, ["123"], ["123"], [False])
    assert reward.tolist() == [1.0] and reward[0] >= 1.0
    with pytest.raises(ConfigError, match="no sample can be correct"):
        _load(f"eval.reward={specs}", "eval.correct_threshold=1.001")
