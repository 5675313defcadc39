"""rl.rewards.batch: a reward whose one call scores many samples (a reward model, a judge behind a batching service)."""

import threading
import time

import numpy as np
import pytest

from rl.config.schema import RewardSpec
from rl.data import PromptRecord
from rl.rewards import register_reward, score_components
from rl.rewards import registry
from rl.rewards.batch import chunk_bounds


@pytest.fixture
def registered():
    """register(name, fn, mode="batch"): registered for the test only."""
    names = []

    def register(name, fn, mode="batch"):
        names.append(name)
        return register_reward(name, mode=mode)(fn)

    yield register
    for name in names:
        registry._REGISTRY.pop(name, None)


def _records(n):
    return [PromptRecord(f"say {i}", str(i), {"id": i}) for i in range(n)]


def test_one_call_gets_the_batch_as_lists_and_its_args_once(registered):
    calls = []

    def rm(completions, answers, *, truncated, prompt, meta, scale, timeout_s):
        calls.append(dict(completions=completions, answers=answers, truncated=truncated, prompt=prompt, meta=meta,
                          scale=scale, timeout_s=timeout_s))
        return [scale * float(c == a) for c, a in zip(completions, answers)]

    registered("_test_rm", rm)
    records = _records(4)
    spec = RewardSpec("_test_rm", 2.0, 7.0, args={"scale": 0.5})
    completions = ["0", "x", "2", "3"]
    total, failures, parts = registry.score_specs([spec], completions, [r.answer for r in records],
                                                  [False, True, False, False], records)
    assert failures == 0
    assert parts["_test_rm"].tolist() == [0.5, 0.0, 0.5, 0.5] and total.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert calls == [dict(completions=completions, answers=["0", "1", "2", "3"], truncated=[False, True, False, False],
                          prompt=[f"say {i}" for i in range(4)], meta=[{"id": i} for i in range(4)], scale=0.5,
                          timeout_s=7.0)]


def test_a_value_that_is_not_a_finite_number_fails_its_sample_only(registered):
    registered("_test_rm", lambda completions, answers, **kw: [1.0, None, float("nan"), "0.5", True, np.float32(2)])
    s = score_components([("_test_rm", 1.0)], ["c"] * 6, ["a"] * 6)
    assert s.components["_test_rm"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 2.0]
    assert s.failures["_test_rm"] == 3 and s.timeouts["_test_rm"] == 0


@pytest.mark.parametrize("returned, why", [
    ([1.0, 1.0], "returned 2 values for 3 samples"),
    ("1.0", "returned str, expected a sequence of 3 floats"),
    (1.0, "returned float, expected a sequence of 3 floats"),
    ({0: 1.0, 1: 1.0, 2: 1.0}, "returned dict, expected a sequence of 3 floats"),
])
def test_a_call_that_returns_the_wrong_shape_fails_every_sample(registered, returned, why):
    registered("_test_rm", lambda completions, answers, **kw: returned)
    s = score_components([("_test_rm", 1.0)], ["c"] * 3, ["a"] * 3)
    assert s.failures["_test_rm"] == 3 and s.components["_test_rm"].tolist() == [0.0] * 3
    assert why in s.errors["_test_rm"][0]


def test_a_call_that_raises_fails_every_sample_and_names_the_error(registered):
    def down(completions, answers, **kw):
        raise ConnectionError("reward model unreachable")

    registered("_test_rm", down)
    total, failures = registry.score_batch([("_test_rm", 1.0)], ["c"] * 3, ["a"] * 3)
    assert failures == 3 and total.tolist() == [0.0] * 3
    s = score_components([("_test_rm", 1.0)], ["c"] * 3, ["a"] * 3)
    assert "ConnectionError: reward model unreachable" in s.errors["_test_rm"][0]


def test_timeout_s_bounds_the_whole_call(registered):
    release = threading.Event()

    def hangs(completions, answers, **kw):
        release.wait(30)
        return [1.0] * len(completions)

    registered("_test_rm", hangs)
    try:
        t0 = time.monotonic()
        s = score_components([("_test_rm", 1.0)], ["c"] * 5, ["a"] * 5, timeout_s=0.3)
        took = time.monotonic() - t0
        late = score_components([("_test_rm", 1.0)], ["c"] * 2, ["a"] * 2, timeout_s=5, batch_timeout_s=0.2)
    finally:
        release.set()
    assert 0.3 <= took < 5, took  # one limit for the call, not 0.3 s per sample
    assert s.failures["_test_rm"] == 5 and s.timeouts["_test_rm"] == 5
    assert "timed out after 0.3 s" in s.errors["_test_rm"][0]
    assert late.timeouts["_test_rm"] == 2 and "batch time limit" in late.errors["_test_rm"][0]


def test_workers_cut_the_batch_into_chunks_called_at_once(registered):
    sizes, inside, peak, lock = [], [0], [0], threading.Lock()

    def rm(completions, answers, *, truncated):
        with lock:
            sizes.append(len(completions))
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        time.sleep(0.2)
        with lock:
            inside[0] -= 1
        return [float(a) + 0.5 * t for a, t in zip(answers, truncated)]

    registered("_test_rm", rm)
    answers = [str(i) for i in range(7)]
    truncated = [i % 2 == 1 for i in range(7)]
    spec = RewardSpec("_test_rm", 1.0, 10.0, workers=3)
    _, failures, parts = registry.score_specs([spec], ["c"] * 7, answers, truncated)
    assert failures == 0 and parts["_test_rm"].tolist() == [i + 0.5 * (i % 2) for i in range(7)]  # slices line up
    assert sorted(sizes) == [2, 2, 3] and peak[0] == 3


@pytest.mark.parametrize("n, calls, bounds", [
    (7, 3, [(0, 2), (2, 5), (5, 7)]), (2, 5, [(0, 1), (1, 2)]), (4, 1, [(0, 4)]), (5, 0, [(0, 5)]),
])
def test_chunk_bounds(n, calls, bounds):
    assert chunk_bounds(n, calls) == bounds


def test_a_batch_reward_and_a_per_sample_mode_do_not_mix(registered):
    registered("_test_rm", lambda completions, answers, **kw: [1.0] * len(completions))
    registered("_test_one", lambda completion, answer, **kw: 1.0, mode="thread")
    with pytest.raises(ValueError, match="registered in batch mode and cannot run in mode 'thread'"):
        score_components([("_test_rm", 1.0)], ["c"], ["a"], mode="thread")
    with pytest.raises(ValueError, match="registered in thread mode and cannot run in mode 'batch'"):
        score_components([("_test_one", 1.0)], ["c"], ["a"], mode="batch")
    # a bare function the caller declares a batch reward
    s = score_components([(lambda completions, answers: [0.5] * len(completions), 1.0)], ["c"] * 2, ["a"] * 2,
                         mode="batch")
    assert s.total.tolist() == [0.5, 0.5]


def test_registration_refuses_a_batch_reward_that_cannot_take_the_call():
    with pytest.raises(TypeError, match=r"cannot be called as fn\(completions, answers, truncated=\[\.\.\.\]\)"):
        register_reward("_test_rm_bad", mode="batch")(lambda completions, answers: [1.0])
    assert "_test_rm_bad" not in registry._REGISTRY


def test_config_args_are_checked_at_load_for_a_batch_reward(registered):
    from rl.config.reward_checks import reward_problems

    registered("_test_rm", lambda completions, answers, *, url, **kw: [1.0] * len(completions))
    assert reward_problems([RewardSpec("_test_rm", args={"url": "http://rm"})], "reward") == []
    (problem,) = reward_problems([RewardSpec("_test_rm", args={"ulr": "http://rm"})], "reward")
    assert problem.key == "reward[0].args" and "url" in problem.text


def test_an_empty_batch_makes_no_call(registered):
    calls = []
    registered("_test_rm", lambda completions, answers, **kw: calls.append(1) or [])
    s = score_components([("_test_rm", 1.0)], [], [])
    assert calls == [] and s.total.shape == (0,)


@pytest.mark.parametrize("mode", ["thread", "batch"])
def test_keyword_only_parameters_the_run_passes_are_accepted(registered, mode):
    """`*, truncated, prompt` without defaults: the run passes them itself; registration counted them twice (once
    as config args) and refused the function."""
    fn = registered("_test_kwonly", lambda c, a, *, truncated, prompt, timeout_s, level: 1.0, mode=mode)
    assert registry.get_reward("_test_kwonly") is fn
