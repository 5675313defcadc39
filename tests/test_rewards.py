"""rl.rewards: registry, the built-in rewards, and score_batch's failure / time-limit handling;
rl.tasks: the digit tokenizer and the synthetic tasks."""

import math
import time

import numpy as np
import pytest

import rl.rewards as rewards
from rl.rewards import UnknownRewardError, get_reward, list_rewards, register_reward, score_batch, score_components
from rl.rewards import registry
from rl.tasks import (
    AddModTask,
    CopyDigitsTask,
    DigitTokenizer,
    ReverseDigitsTask,
    SortDigitsTask,
    make_task,
)


# Rewards used by the failure tests. Module-level so that the process pool can import them by name.
def raises_on_bad(completion, answer, **kw):
    if answer == "bad":
        raise RuntimeError("reward exploded")
    return 1.0


def sleeps_on_slow(completion, answer, **kw):
    if answer == "slow":
        time.sleep(30)
    return 1.0


def returns_nan(completion, answer, **kw):
    return float("nan") if answer == "nan" else 0.25


def returns_string(completion, answer, **kw):
    return "high"


# ------------------------------------------------------------------------------------------ registry

def test_builtins_registered():
    assert {"math_verify", "format", "reverse_digits", "copy_digits", "sort_digits", "exact_digits"} <= set(list_rewards())
    assert rewards.reward_mode("reverse_digits") == "inline"
    assert rewards.reward_mode("math_verify") == "process"


def test_unknown_reward_lists_names():
    with pytest.raises(UnknownRewardError) as e:
        get_reward("math_verfy")
    msg = str(e.value)
    assert "math_verfy" in msg and "math_verify" in msg and "reverse_digits" in msg
    with pytest.raises(UnknownRewardError):  # score_batch resolves names before running anything
        score_batch([("nope", 1.0)], ["x"], ["y"])


def test_register_and_duplicate():
    try:
        @register_reward("_test_len")
        def length(completion, answer, **kw):
            return len(completion)

        assert get_reward("_test_len") is length
        assert score_batch({"_test_len": 0.5}, ["abcd", ""], ["", ""])[0].tolist() == [2.0, 0.0]
        with pytest.raises(ValueError, match="already registered"):
            register_reward("_test_len")(lambda c, a, **kw: 0.0)
        register_reward("_test_len", replace=True)(raises_on_bad)
        assert get_reward("_test_len") is raises_on_bad
    finally:
        registry._REGISTRY.pop("_test_len", None)


def test_a_factorys_function_of_other_values_is_not_taken_for_the_same_one():
    """Closures of one factory share module and qualname; make(100.0) silently replaced make(1.0)'s reward."""
    def make(scale):
        def scaled(completion, answer, truncated=False):
            return scale * float(completion == answer)
        return scaled

    try:
        register_reward("_test_scaled")(make(1.0))
        register_reward("_test_scaled")(make(1.0))  # the same definition and values again (a module reloaded): fine
        with pytest.raises(ValueError, match="already registered"):
            register_reward("_test_scaled")(make(100.0))
        with pytest.raises(ValueError, match="already registered"):
            register_reward("_test_scaled")(lambda completion, answer, truncated=False: 5.0)
        assert score_batch({"_test_scaled": 1.0}, ["x"], ["x"])[0].tolist() == [1.0]
    finally:
        registry._REGISTRY.pop("_test_scaled", None)


def test_a_reward_that_cannot_take_a_runs_call_is_refused_at_registration():
    """A run calls every reward as fn(completion, answer, truncated=...): `def r(completion, answer)` failed on
    every sample of every step (scored 0, the run went on); it is refused when registered, naming the call."""
    def two_args(completion, answer):
        return 1.0

    with pytest.raises(TypeError, match=r"reward '_test_two': .*two_args\(completion, answer\) cannot be called as "
                                        r"fn\(completion, answer, truncated=...\)"):
        register_reward("_test_two")(two_args)
    assert "_test_two" not in registry._REGISTRY

    def positional_scale(completion, answer, scale, truncated=False):
        return scale

    with pytest.raises(TypeError, match=r"missing a required argument: 'scale'.*config's args give must be keyword-"
                                        r"only: def positional_scale\(completion, answer, \*, scale, ...\)"):
        register_reward("_test_two")(positional_scale)
    try:  # what is accepted: **kw, or a truncated parameter (and timeout_s)
        register_reward("_test_two")(lambda completion, answer, truncated=False, timeout_s=None: 1.0)
        register_reward("_test_two", replace=True)(lambda c, a, **kw: 1.0)
    finally:
        registry._REGISTRY.pop("_test_two", None)


# ------------------------------------------------------------------------------------------ digit task

def test_digit_tokenizer_roundtrip():
    tok = DigitTokenizer()
    assert tok.vocab_size == len(tok) == 16
    assert (tok.bos_token_id, tok.sep_token_id, tok.eos_token_id, tok.pad_token_id) == (10, 11, 12, 13)
    ids = tok.encode("3141")
    assert ids == [10, 3, 1, 4, 1, 11]
    assert tok.encode("3141", add_special_tokens=False) == [3, 1, 4, 1]
    assert tok.decode(ids) == "<bos>3141<sep>"
    assert tok.decode(ids, skip_special_tokens=True) == "3141"
    assert tok.decode(np.array([4, 3, 12, 13, 13])) == "43<eos><pad><pad>"
    assert tok.encode(tok.decode([1, 2, 12]), add_special_tokens=False) == [1, 2, 12]
    with pytest.raises(ValueError, match="unknown character"):
        tok.encode("12a")
    # a model whose vocabulary is larger than the task's samples ids past it: decoded as one unknown character,
    # which the rewards score as a wrong position (they used to stop the run)
    assert tok.decode([3, 16, 4, 200]) == "3\ufffd4\ufffd"
    assert get_reward("copy_digits")(tok.decode([3, 16, 4, 1]), "3141") == 0.75
    with pytest.raises(ValueError, match="negative token id -1"):
        tok.decode([-1])


def test_tasks_records():
    recs = ReverseDigitsTask(num_digits=4, seed=0).dataset(50)
    assert recs == ReverseDigitsTask(num_digits=4, seed=0).dataset(50)  # deterministic
    assert recs != ReverseDigitsTask(num_digits=4, seed=1).dataset(50)
    for r in recs:
        assert len(r.prompt) == 4 and r.answer == r.prompt[::-1]
        assert r.meta["prompt_ids"] == [10, *map(int, r.prompt), 11] and r.meta["reward"] == "reverse_digits"
    assert CopyDigitsTask(4).make_record("3141").answer == "3141"
    assert SortDigitsTask(4).make_record("3141").answer == "1134"
    add = AddModTask(seed=0).make_record("78")
    assert (add.prompt, add.answer, add.meta["prompt_ids"]) == ("7+8", "5", [10, 7, 14, 8, 11])
    assert make_task("copy", num_digits=8).dataset(3)[0].meta["reward"] == "copy_digits"
    with pytest.raises(ValueError, match="reverse"):
        make_task("revrse")
    assert ReverseDigitsTask(4).max_new_tokens() == 5


@pytest.mark.parametrize("completion,expected", [
    ("4321<eos>", 1.0),
    ("4321", 1.0),
    ("4300<eos>", 0.5),
    ("43", 0.5),          # missing positions are wrong
    ("1234", 0.0),
    ("4<sep>21", 0.75),   # a special token occupies its position
    ("43<eos>21", 0.5),   # nothing after <eos> counts
    ("432199", 1.0),      # extra digits past the answer are ignored
    ("", 0.0),
])
def test_reverse_digits_partial_credit(completion, expected):
    assert get_reward("reverse_digits")(completion, "4321") == expected


def test_digit_variants_and_exact():
    assert get_reward("copy_digits")("3140", "3141") == 0.75
    assert get_reward("sort_digits")("1134<eos>", "1134") == 1.0
    assert get_reward("exact_digits")("5<eos><pad>", "5") == 1.0
    assert get_reward("exact_digits")("55", "5") == 0.0


def test_tiny_task_scoring_is_fast():
    task = ReverseDigitsTask(4, seed=0)
    tok = task.tokenizer
    recs = task.dataset(32)
    rng = np.random.default_rng(0)
    answers = [r.answer for r in recs for _ in range(8)]  # 32 prompts x 8 samples
    completions = [tok.decode([*rng.integers(0, 10, 4), tok.eos_token_id]) for _ in answers]
    completions[0] = answers[0] + "<eos>"
    score_batch([("reverse_digits", 1.0)], completions, answers)  # warm
    t0 = time.perf_counter()
    r, failures = score_batch([("reverse_digits", 1.0)], completions, answers)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.05, elapsed
    assert failures == 0 and r.shape == (256,) and r.dtype == np.float32 and r[0] == 1.0
    assert 0.0 < r.mean() < 0.3  # random guesses: about 0.1 per position


# ------------------------------------------------------------------------------------------ format

@pytest.mark.parametrize("completion,kw,expected", [
    ("so the answer is \\boxed{42}.", {}, 1.0),
    ("\\boxed{\\frac{1}{2}} $", {}, 1.0),
    ("\\fbox{7}", {}, 1.0),
    ("no box here", {}, 0.0),
    ("\\boxed{1} or \\boxed{2}", {}, 0.0),
    ("\\boxed{}", {}, 0.0),
    ("\\boxed{\\frac{1}{2}", {}, 0.0),   # never closed
    ("\\boxed{42}", {"truncated": True}, 0.0),
    ("\\boxed{a\\}", {}, 0.0),  # an escaped brace does not close the box (it scored 1)
    ("\\boxed{\\left\\{ 1 \\right.}", {}, 1.0),  # nor open a group (it scored 0)
    ("\\boxed{\\{1, 2\\}}", {}, 1.0),
    ("\\boxed{a \\\\ b}", {}, 1.0),  # \\ is a line break, then a plain b
    # a thinking model's drafts are not a second answer; a thought never closed states none
    ("<think>maybe \\boxed{3}? no.</think>So the answer is \\boxed{4}.", {}, 1.0),
    ("<think>maybe \\boxed{3}? no.</think>So the answer is 4.", {}, 0.0),
    ("<think>it is \\boxed{4}", {}, 0.0),
])
def test_format_reward(completion, kw, expected):
    assert get_reward("format")(completion, "", **kw) == expected


def test_format_is_linear_on_hostile_input():
    t0 = time.perf_counter()
    assert get_reward("format")("\\boxed{" * 20000, "") == 0.0
    assert get_reward("format")("\\boxed{" + "{" * 50000, "") == 0.0
    assert time.perf_counter() - t0 < 0.5


# ------------------------------------------------------------------------------------------ math_verify

@pytest.mark.parametrize("completion,answer,expected", [
    ("We get \\boxed{1/2}.", "0.5", 1.0),
    ("We get \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("So $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("First \\boxed{3}, no wait: \\boxed{4}", "4", 1.0),   # the last box counts
    ("First \\boxed{4}, no wait: \\boxed{3}", "4", 0.0),
    ("Reasoning...\nAnswer: 17", "17", 1.0),                # DAPO's requested format
    ("Answer: 3\nNo wait.\nAnswer: 4", "4", 1.0),            # the last Answer: line counts, as the last box
    # a sentence's full stop in the box or the reference, and thousands spaced in LaTeX (a helper's audit: all 0)
    ("\\boxed{5.}", "5", 1.0),
    ("\\boxed{-12.}", "-12", 1.0),
    ("\\boxed{5}", "5.", 1.0),
    ("\\boxed{5.}", "6", 0.0),
    ("\\boxed{1\\,000}", "1000", 1.0),
    ("\\boxed{1~000~000}", "1000000", 1.0),
    ("\\boxed{1\\,5}", "15", 0.0),   # not a group of three: left as written
    ("\\boxed{0.49}", "0.5", 0.0),
    ("\\boxed{2}", "3", 0.0),
    ("I have no idea", "3", 0.0),
    ("", "3", 0.0),
])
def test_math_verify_reward(completion, answer, expected):
    assert get_reward("math_verify")(completion, answer, timeout_s=5) == expected


# An audit of the grader against the conventions of the datasets the recipes train on: the last box anywhere in a
# completion beat a later final line (DAPO-Math-17K asks for "Answer: $Answer" as the last line; a thinking model
# boxes trial values while it thinks), `####` (GSM8K) was never read, a completion cut off mid-thought was graded
# on the last number it held, and a reference with unit words parsed to symbols no prediction equals.
@pytest.mark.parametrize("completion,answer,expected,kw", [
    ("<think>\\boxed{12}? No, it is 13.</think>\nThe sum is 13.\n\nAnswer: 13", "13", 1.0, {}),
    ("<think>The sum is \\boxed{13}. Or 14.</think>\nSo it is 14.\n\nAnswer: 14", "13", 0.0, {}),
    ("The small triangle's area is $\\boxed{6}$, the whole one four times that.\n\nAnswer: 24", "24", 1.0, {}),
    ("First, $a = \\boxed{4}$; then b = 9.\n#### 9", "9", 1.0, {}),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0, {}),
    ("#### 9\nOn reflection the box is right: \\boxed{8}", "8", 1.0, {}),  # the box comes last
    ("<think>I think it is \\boxed{5}</think>The answer is $\\boxed{6}$.", "6", 1.0, {}),
    ("<think>I think it is \\boxed{5}</think>", "5", 0.0, {}),  # what it tried while thinking is not its answer
    ("<think>\nMaybe the count is \\boxed{12}? Let me verify case 1", "12", 0.0, {"truncated": True}),
    ("<think>\nMaybe the count is \\boxed{12}? Let me verify case 1", "12", 0.0, {}),  # never closed its thinking
    ("Let x = 2. Then 3x + 4 = 10, and substituting into y, y equals", "10", 0.0, {"truncated": True}),
    ("Let x = 2. Then 3x + 4 = 10", "10", 1.0, {}),  # not cut off: math-verify's own extraction, as documented
    ("so the total is \\boxed{6", "6", 0.0, {"truncated": True}),
    ("It works out to \\boxed{20}. Answer: 20", "20", 1.0, {"truncated": True}),  # an answer it did state
    ("\\boxed{2}", "2 eggs", 1.0, {}),
    ("\\boxed{18}", "18 dollars", 1.0, {}),
    ("\\boxed{3}", "2 eggs", 0.0, {}),
    ("\\boxed{2}", "2 pi", 0.0, {}),  # a function, not a unit: the text as written
    ("\\boxed{2}", "2 and 3", 0.0, {}),
    ("\\boxed{5}", "5 million", 0.0, {}),  # a multiplier, not a unit
    ("So she has 18 left.\nAnswer: 18 dollars", "18", 1.0, {}),  # the prediction's unit words too (a review)
    ("\\boxed{2 eggs}", "2 eggs", 1.0, {}),
    # a Markdown heading is no GSM8K answer line (a review: "#### Verification" after the box replaced it)
    ("\\boxed{42}\n\n#### Verification\nChecking: 40 + 2 = 42.", "42", 1.0, {}),
    ("So it is 1,234.\n#### $1,234.", "1234", 1.0, {}),
])
def test_math_verify_grades_the_answer_a_completion_ends_on(completion, answer, expected, kw):
    assert get_reward("math_verify")(completion, answer, timeout_s=5, **kw) == expected


def test_many_unclosed_boxes_are_read_in_linear_time():
    """extract_final_answer rescanned to the end from each unclosed box: 56 KB of them took 24 s (an audit's), in the
    trainer's eval.majority_answer: boxed with no time limit."""
    from rl.rewards.math import extract_final_answer
    t0 = time.perf_counter()
    assert extract_final_answer("\\boxed{" * 8000) is None
    assert extract_final_answer("\\boxed{" * 8000 + "\\boxed{7}") == "7"
    assert extract_final_answer("\\boxed{1} " + "\\boxed{" * 8000) == "1"
    assert extract_final_answer("\\boxed{" * 8000 + "5" + "}" * 8000) == "5"  # nested: 21 s and 710 MB (a review)
    assert time.perf_counter() - t0 < 0.5


def test_the_answer_line_is_read_in_linear_time():
    """A long run of spaces on an Answer: line took 3.8 s at 16k characters (the line's lazy pattern and the
    end-anchored strip, each quadratic): eval.majority_answer: boxed reads it in the trainer, with no time limit."""
    from rl.rewards.math import extract_final_answer
    t0 = time.perf_counter()
    assert extract_final_answer("Answer: 1" + " " * 50000 + "a") == "1" + " " * 50000 + "a"
    assert extract_final_answer("Answer: 1" + " " * 50000) == "1"
    assert extract_final_answer("Answer: 5\r\nNo wait, Answer: $6$.\r\n") == "5"  # CRLF lines end as LF ones
    assert time.perf_counter() - t0 < 0.5


def test_math_verify_batch_in_pool_and_threads():
    completions = ["\\boxed{1/2}", "\\boxed{\\frac{1}{2}}", "\\boxed{0.3}", "Answer: 204", "\\boxed{x}"]
    answers = ["0.5", "1/2", "0.5", "204", "\\frac{1}{2}"]
    expected = [1.0, 1.0, 0.0, 1.0, 0.0]
    for mode in (None, "thread"):  # None: the registered process pool; thread: math-verify without signals
        r, failures = score_batch([("math_verify", 1.0)], completions, answers, timeout_s=10, mode=mode)
        assert r.tolist() == expected and failures == 0, mode


def test_math_verify_timeout_is_counted():
    # 2^(2^(2^30)) cannot be evaluated in time: math-verify's own alarm (in the worker) or the pool's
    # kill ends it; either way the sample is 0 and counted, and the good sample is unaffected.
    t0 = time.perf_counter()
    s = score_components([("math_verify", 1.0)], ["\\boxed{2^{2^{2^{30}}}}", "\\boxed{7}"], ["1", "7"], timeout_s=1)
    assert time.perf_counter() - t0 < 8
    assert s.total.tolist() == [0.0, 1.0] and s.failures["math_verify"] == 1


# ------------------------------------------------------------------------------------------ failures

@pytest.mark.parametrize("mode", ["inline", "thread", "process"])
def test_raising_reward_scores_zero_and_is_counted(mode):
    answers = ["ok", "bad", "ok", "bad", "ok"]
    s = score_components([(raises_on_bad, 1.0)], ["c"] * 5, answers, mode=mode, timeout_s=5)
    assert s.total.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert s.num_failures == 2 and s.timeouts["raises_on_bad"] == 0
    assert "reward exploded" in s.errors["raises_on_bad"][0]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_slow_reward_times_out_promptly(mode):
    if mode == "process":  # start the pool first so the timing below measures the call, not the start-up
        score_batch([(sleeps_on_slow, 1.0)], ["c"], ["fast"], mode=mode)
    answers = ["fast", "slow", "fast", "fast", "slow", "fast"]
    t0 = time.perf_counter()
    s = score_components([(sleeps_on_slow, 1.0)], ["c"] * 6, answers, mode=mode, timeout_s=0.3, num_workers=2)
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, elapsed
    assert s.total.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert s.num_failures == 2 and s.timeouts["sleeps_on_slow"] == 2
    # the machinery recovers: the next call is clean
    assert score_batch([(sleeps_on_slow, 1.0)], ["c"] * 3, ["fast"] * 3, mode=mode, timeout_s=0.3) == (pytest.approx([1.0] * 3), 0)


def test_batch_time_limit():
    t0 = time.perf_counter()
    r, failures = score_batch([(sleeps_on_slow, 1.0)], ["c"] * 4, ["slow"] * 4, mode="thread", timeout_s=10,
                              batch_timeout_s=0.3)
    assert time.perf_counter() - t0 < 2.0
    assert r.tolist() == [0.0] * 4 and failures == 4


def test_bad_return_values_are_failures():
    r, failures = score_batch([(returns_nan, 1.0)], ["c"] * 3, ["x", "nan", "x"], mode="inline")
    assert r.tolist() == [0.25, 0.0, 0.25] and failures == 1
    r, failures = score_batch([(returns_string, 1.0)], ["c"] * 2, ["x", "y"])
    assert r.tolist() == [0.0, 0.0] and failures == 2
    from rl.rewards.outcome import call_reward  # float() took a numeric string and a one-element array as numbers
    for bad in ("0.75", np.array([0.5]), None, float("inf")):
        assert call_reward(lambda c, a, **k: bad, "c", "a", {})[0] is False
    for good in (np.float32(0.5), np.int64(1), True, np.bool_(True)):
        assert call_reward(lambda c, a, **k: good, "c", "a", {}) == (True, float(good))


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_a_value_beyond_float32_or_floats_range_fails_its_sample_only(mode):
    """1e39 became inf in the float32 sum (every advantage of its group NaN, counted as no failure); 10**400 raised
    OverflowError out of the step inline, and in thread mode killed the lane, failing the good samples after it."""
    def sized(completion, answer, **kw):
        return {"big": 1e39, "huge": 10 ** 5000, "neg": -1e31}.get(answer, 0.5)  # 10**5000: past str() too
    s = score_components([(sized, 1.0)], ["c"] * 5, ["big", "x", "huge", "neg", "y"], mode=mode)
    assert s.total.tolist() == [0.0, 0.5, 0.0, 0.0, 0.5] and s.num_failures == 3 and sum(s.timeouts.values()) == 0
    assert any("beyond +-1e+30" in e for e in s.errors["sized"]), s.errors


def test_weighted_sum_and_components():
    completions = ["\\boxed{4}", "the answer is 4", "\\boxed{5}"]
    answers = ["4", "4", "4"]
    s = score_components([("math_verify", 1.0), ("format", 0.5)], completions, answers, timeout_s=10,
                         sample_kwargs=[{}, {}, {"truncated": True}])
    assert s.components["math_verify"].tolist() == [1.0, 1.0, 0.0]
    assert s.components["format"].tolist() == [1.0, 0.0, 0.0]
    assert s.total.tolist() == [1.5, 1.0, 0.0] and s.num_failures == 0
    assert math.isclose(float(score_batch({"format": 2.0}, ["\\boxed{1}"], ["1"])[0][0]), 2.0)


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="answers"):
        score_batch([("format", 1.0)], ["a", "b"], ["a"])


def sees_its_row(completion, answer, prompt, meta, **kw):
    """1 where the prompt and the row's fields arrived with the sample they belong to."""
    return float(prompt == f"say {answer}" and meta["id"] == int(answer) and "truncated" in kw)


@pytest.mark.parametrize("mode", ["inline", "thread", "process"])
def test_a_reward_that_names_prompt_and_meta_gets_its_rows(mode):
    """A judge needs the prompt and a rubric the row's fields: given to the rewards that name them, sample by
    sample, in every mode; a reward taking only **kw is not sent them (in process mode they would be pickled)."""
    from rl.data import PromptRecord
    from rl.config.schema import RewardSpec
    records = [PromptRecord(f"say {i}", str(i), {"id": i}) for i in range(5)]
    seen = []

    def kw_only(completion, answer, **kw):
        seen.append(sorted(kw))
        return 1.0

    try:
        register_reward("_test_row", mode=mode)(sees_its_row)
        register_reward("_test_kw", mode="inline")(kw_only)
        specs = (RewardSpec("_test_row", 1.0, 10.0), RewardSpec("_test_kw", 1.0, 10.0))
        total, failures, parts = registry.score_specs(specs, ["c"] * 5, [r.answer for r in records], [False] * 5,
                                                       records)
        assert failures == 0 and parts["_test_row"].tolist() == [1.0] * 5
        assert seen == [["truncated"]] * 5
        # without records (a caller that has none), a reward that needs them fails loudly, sample by sample
        total, failures, _ = registry.score_specs(specs[:1], ["c"] * 2, ["0", "1"], [False] * 2)
        assert failures == 2
    finally:
        registry._REGISTRY.pop("_test_row", None)
        registry._REGISTRY.pop("_test_kw", None)


def test_a_reward_that_requires_prompt_is_accepted_and_one_that_cannot_take_the_call_is_not():
    try:
        register_reward("_test_judge")(lambda completion, answer, prompt, truncated=False: 1.0)
        with pytest.raises(TypeError, match="timeout_s, prompt or meta where the function names them"):
            register_reward("_test_judge2")(lambda completion, answer, prompt: 1.0)  # no truncated, no **kw
    finally:
        registry._REGISTRY.pop("_test_judge", None)


def test_a_thread_rewards_workers_score_samples_at_once():
    """`workers` on a reward's config entry: that many samples in flight together (a judge waiting on a service
    would otherwise take one round trip per sample in turn). Each sample waits for all four to be in flight."""
    import threading

    from rl.config.schema import RewardSpec
    barrier = threading.Barrier(4, timeout=3)

    def waits_for_company(completion, answer, **kw):
        barrier.wait()
        return 1.0

    try:
        register_reward("_test_company", mode="thread")(waits_for_company)
        total, failures, _ = registry.score_specs((RewardSpec("_test_company", 1.0, 10.0, workers=4),),
                                                  ["c"] * 4, ["a"] * 4, [False] * 4)
        assert failures == 0 and total.tolist() == [1.0] * 4
        barrier.reset()
        total, failures, _ = registry.score_specs((RewardSpec("_test_company", 1.0, 5.0),), ["c"] * 4, ["a"] * 4,
                                                  [False] * 4)  # one lane: the first sample waits alone, and fails
        assert failures >= 1
    finally:
        registry._REGISTRY.pop("_test_company", None)


def test_score_specs_sums_every_configured_reward():
    """A run's rewards add up: the total is the weighted sum over every spec (not the last one's alone), and each
    reward's own unweighted values come back by name; `truncated` reaches the rewards that read it."""
    from types import SimpleNamespace
    specs = [SimpleNamespace(name="format", weight=0.5, timeout_s=5.0),
             SimpleNamespace(name="exact_digits", weight=2.0, timeout_s=5.0)]
    completions = ["\\boxed{12}", "12", "\\boxed{1}"]
    total, failures, parts = registry.score_specs(specs, completions, ["7", "12", "5"], [False, False, True])
    np.testing.assert_allclose(parts["format"], [1.0, 0.0, 0.0])       # the third was cut off
    np.testing.assert_allclose(parts["exact_digits"], [0.0, 1.0, 0.0])
    np.testing.assert_allclose(total, [0.5, 2.0, 0.0])
    assert failures == 0 and total.dtype == np.float32


def test_a_process_rewards_workers_beyond_its_samples_start_no_idle_processes():
    """A worker process started for a batch smaller than `workers` stayed up, idle, for the rest of the run."""
    from rl.rewards import pool
    score_batch([(raises_on_bad, 1.0)], ["c"], ["ok"], mode="process", num_workers=1)  # the pool is up
    before = len(pool._POOL.workers)
    assert score_batch([(raises_on_bad, 1.0)], ["c"], ["ok"], mode="process", num_workers=before + 3)[1] == 0
    assert len(pool._POOL.workers) == before
