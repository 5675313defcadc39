"""rl.score_once: in a multi-host run process 0 scores a batch's rewards and every process gets its values."""

import functools
from types import SimpleNamespace

import jax
import numpy as np

from rl import phases
from rl.config.schema import RewardSpec
from rl.rewards import registry
from rl.score_once import score_once


def test_process_zero_scores_and_every_process_gets_its_values():
    """Each process scored the batch itself: N times a judge's requests, and a reward depending on time or chance
    (a timeout on one host only) gave two hosts different rewards for one sample."""
    calls = []

    def noisy(completion, answer, truncated=False):
        calls.append(completion)
        return float(len(calls))  # another value at every call, as a judge sampled above temperature 0

    sent = []

    def zero_sends(value):
        sent.append(value)
        return value

    def other_receives(value):
        want = sent.pop(0)  # the same tree of shapes and dtypes as process 0's, or the collective would fail
        for a, b in zip(value[:2] + tuple(value[2].values()), want[:2] + tuple(want[2].values())):
            assert np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype
        assert list(value[2]) == list(want[2])
        return want

    try:
        registry.register_reward("_test_noisy", mode="inline")(noisy)
        specs = (RewardSpec("_test_noisy", 2.0, 5.0), RewardSpec("copy_digits", 1.0, 5.0))
        args = (specs, ["12", "34", "56"], ["12", "33", "56"], [False] * 3)
        zero = score_once(*args, process_index=0, process_count=2, broadcast=zero_sends)
        assert calls == ["12", "34", "56"]
        other = score_once(*args, process_index=1, process_count=2, broadcast=other_receives)
        assert calls == ["12", "34", "56"]  # process 1 scored nothing
        for a, b in ((zero[0], other[0]), *((zero[2][k], other[2][k]) for k in zero[2])):
            np.testing.assert_array_equal(a, b)
        assert zero[1] == other[1] == 0 and zero[0].tolist() == [3.0, 4.5, 7.0]  # 2 x (1, 2, 3) + copy_digits
        assert score_once(*args, process_count=1)[0].tolist() == [9.0, 10.5, 13.0]  # one process: scored here
    finally:
        registry._REGISTRY.pop("_test_noisy", None)


def test_the_values_received_from_process_zero_can_be_added_to():
    """Across hosts jax's broadcast returns read-only arrays (jax.device_get); DAPO's overlong punishment adds to the
    total in place, so every multi-host step with grpo.overlong_buffer > 0 stopped at ValueError: read-only."""
    def broadcast_as_across_hosts(tree):
        return jax.tree.map(lambda x: jax.device_get(jax.device_put(np.expand_dims(x, 0)).addressable_data(0))[0],
                            tree)

    assert not broadcast_as_across_hosts(np.zeros(2, np.float32)).flags.writeable  # as jax's across hosts
    specs = (RewardSpec("copy_digits", 1.0, 5.0),)
    rollout = SimpleNamespace(truncated=np.array([False, False]), lengths=np.array([3, 5]))
    samples = SimpleNamespace(completions=["12", "34"], answers=["12", "33"], rollout=rollout, records=None)
    # process 1 receives its own zeros here (no second host); the punishment of the 5-token row applies on both
    for index, want in ((0, [1.0, -0.5]), (1, [0.0, -1.0])):
        scorer = functools.partial(score_once, process_index=index, process_count=2,
                                   broadcast=broadcast_as_across_hosts)
        total, _, parts = phases.rewards(specs, samples, max_new_tokens=5, overlong_buffer=2, scorer=scorer)
        assert total.tolist() == want and all(v.flags.writeable for v in parts.values())
