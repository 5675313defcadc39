"""The code-execution rewards (rl/rewards/code.py): programs run against stdin/stdout, call-based and assert tests,
with the failures that must score 0 (wrong output, crash, endless loop, memory bomb, no code) and specs that must be
refused."""

import json
import time

import pytest

from rl.rewards import get_reward, score_batch
from rl.rewards.code import extract_program, parse_tests, run_tests

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
IO = json.dumps({"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7", ["0"]]})


def test_the_last_python_block_is_the_program():
    text = "first\n```python\nprint(1)\n```\nthen\n```\nprint(2)\n```\n```bash\nls\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("no code here") is None


def test_stdin_stdout_tests():
    tests = parse_tests(IO)
    assert run_tests(extract_program(ADD), tests) == (3, 3)
    assert get_reward("code_tests")(ADD, IO) == 1.0
    off_by_one = ADD.replace("a + b", "a + b + (a == 10)")
    assert run_tests(extract_program(off_by_one), tests) == (2, 3)
    assert get_reward("code_tests")(off_by_one, IO) == 0.0
    assert get_reward("code_tests_frac")(off_by_one, IO) == pytest.approx(2 / 3)
    as_list = [{"input": "4 5", "output": "9"}]
    assert get_reward("code_tests")(ADD, as_list) == 1.0


def test_call_based_and_assert_tests():
    prog = "```python\ndef f(xs, k):\n    return sorted(xs)[:k]\n```"
    # f returns [1, 2] and [5]; APPS wraps an expected value in a list ([[1, 2]]), plain values match too ([5])
    spec = {"fn_name": "f", "inputs": [[[3, 1, 2], 2], [[5], 1]], "outputs": [[[1, 2]], [5]]}
    assert get_reward("code_tests")(prog, json.dumps(spec)) == 1.0
    spec["outputs"] = [[[1, 2]], [[6]]]
    assert get_reward("code_tests_frac")(prog, spec) == pytest.approx(0.5)
    asserts = ["assert f([2, 1], 1) == [1]", "assert f([], 3) == []", "assert f([1], 1) == [2]"]
    assert get_reward("code_tests_frac")(prog, asserts) == pytest.approx(2 / 3)
    assert get_reward("code_tests")(prog, "assert f([2, 1], 1) == [1]\nassert f([3], 1) == [3]") == 1.0
    assert get_reward("code_tests")(prog, json.dumps("assert f([3], 1) == [4]")) == 0.0  # test code as JSON text
    # LeetCode-style (TACO, DeepCoder): the method of a class Solution, as APPS' checker calls it (it scored 0)
    leetcode = "```python\nclass Solution:\n    def twoSum(self, xs, t):\n        return [0, 1] if xs[0] + xs[1] == t " \
               "else [1, 2]\n```"
    spec = {"fn_name": "twoSum", "inputs": [[[2, 7, 11], 9], [[3, 2, 4], 6]], "outputs": [[0, 1], [1, 2]]}
    assert get_reward("code_tests")(leetcode, spec) == 1.0


def test_what_must_fail_fails_in_time():
    tests = parse_tests(IO)
    t0 = time.monotonic()
    assert run_tests("while True:\n    pass\n", tests, timeout_s=3.0) == (0, 3)  # the budget, not 3 x 4 s
    assert time.monotonic() - t0 < 6.0
    assert run_tests("x = bytearray(8 << 30)\nprint(3)\n", tests[:1]) == (0, 1)  # over the address-space limit
    assert run_tests("raise SystemExit(1)\n", tests[:1]) == (0, 1)
    assert get_reward("code_tests")("the answer is 3", IO) == 0.0


@pytest.mark.parametrize("exit_early", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"])
def test_a_program_that_exits_before_the_asserts_fails_them(exit_early):
    """Assert tests run after the program in one process: one that exited with status 0 before them passed every
    test (MBPP, HumanEval's check()), a reward a policy would learn to take."""
    prog = f"```python\ndef add(a, b):\n    return a + b\n{exit_early}\n```"
    asserts = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
    assert get_reward("code_tests_frac")(prog, asserts) == 0.0
    humaneval = "def check(candidate):\n    assert candidate(1, 2) == 3\n\ncheck(add)"
    assert get_reward("code_tests")(prog, humaneval) == 0.0
    assert get_reward("code_tests")(prog.replace(exit_early, ""), humaneval) == 1.0


def test_specs_it_cannot_read_are_refused():
    with pytest.raises(ValueError, match="2 inputs for 1 outputs"):
        parse_tests({"inputs": ["1", "2"], "outputs": ["1"]})
    with pytest.raises(ValueError, match="expected"):
        parse_tests({"tests": []})


@pytest.mark.parametrize("answer, why", [
    # a plain-layout file's "solution" field taken for the tests: every program that ran scored 1.0, a wrong one too
    ("def add(a, b):\n    return a + b\n", "checks nothing"),
    ("# tests TBD", "checks nothing"), ('""', "checks nothing"), ('"   "', "checks nothing"),
    ({"inputs": [], "outputs": []}, "no test"), ([], "no test"), ({"asserts": []}, "no test"),  # scored 0 uncounted
    ("assert add(1, 2) ==", "not Python"),
])
def test_specs_that_test_nothing_are_refused(answer, why):
    with pytest.raises(ValueError, match=why):
        parse_tests(answer)


def test_pytest_style_test_functions_are_called():
    """KodCode-style test code defines test_* functions and never calls them: every program that ran passed."""
    tests = parse_tests("def test_sum():\n    assert add(1, 2) == 3\n\n"
                        "def test_zero(n=0):\n    assert add(n, n) == 0\n")
    assert run_tests("def add(a, b):\n    return a + b\n", tests, 10) == (1, 1)
    assert run_tests("def add(a, b):\n    return a - b\n", tests, 10) == (0, 1)
    # KodCode's tests import the program as `solution` (every program failed them on a ModuleNotFoundError)
    kodcode = parse_tests("from solution import add\nimport solution\n\ndef test_sum():\n"
                          "    assert add(1, 2) == 3 and solution.add(2, 2) == 4\n")
    assert run_tests("def add(a, b):\n    return a + b\n", kodcode, 10) == (1, 1)
    assert run_tests("def add(a, b):\n    return a - b\n", kodcode, 10) == (0, 1)


def test_humaneval_check_is_called_with_the_rows_entry_point():
    """HumanEval's test code defines check(candidate) and leaves the call to the harness: nothing called it, and a
    wrong program scored 1.0. It is called with the row's entry_point, given as the reward's meta; without one the
    spec is a data error."""
    from rl.data import PromptRecord
    from rl.rewards.registry import score_specs
    from rl.rewards.code import code_tests_reward
    test = "METADATA = {}\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"
    right, wrong = ("```python\ndef add(a, b):\n    return a {} b\n```".format(op) for op in "+-")
    with pytest.raises(ValueError, match="defines check\\(candidate\\) and never calls it, and the row names no "
                                         "entry_point \\(got None\\)"):
        parse_tests(test)
    with pytest.raises(ValueError, match="got 'add\\(\\)'"):  # a name, not code
        parse_tests(test, "add()")
    assert code_tests_reward(right, test, meta={"entry_point": "add"}) == 1.0
    assert code_tests_reward(wrong, test, meta={"entry_point": "add"}) == 0.0
    with pytest.raises(ValueError):  # the data error: score_batch scores it 0 and counts it
        code_tests_reward(wrong, test)
    assert code_tests_reward(wrong, test + "\ncheck(add)\n") == 0.0  # test code that calls it itself

    class Spec:
        name, weight, timeout_s = "code_tests", 1.0, 20.0
    rows = [PromptRecord("p", test, {"entry_point": "add", "canonical_solution": "x" * 10_000})] * 2
    total, failures, _ = score_specs([Spec()], [right, wrong], [test, test], [False, False], rows)
    assert list(total) == [1.0, 0.0] and failures == 0


def test_a_reward_with_meta_keys_gets_only_those_fields():
    from rl.rewards.calls import context_value
    from rl.rewards.code import code_tests_reward
    meta = {"entry_point": "add", "solutions": ["x" * 100_000]}
    assert context_value(code_tests_reward, "meta", meta) == {"entry_point": "add"}
    assert context_value(lambda c, a, meta=None: 0.0, "meta", meta) is meta


def test_test_code_that_can_fail_is_taken():
    for code in ("assert add(1, 2) == 3", "if add(1, 2) != 3:\n    raise SystemExit(1)",
                 "import unittest\nunittest.TestCase().assertEqual(add(1, 2), 3)",
                 "def check(candidate):\n    assert candidate(1, 2) == 3\n\ncheck(add)"):
        assert parse_tests(code) == [("assert", code, None)]


def test_through_the_process_pool():
    """The registered mode (a worker process per chunk): scores and a bad spec counted as a failure."""
    total, failures = score_batch([("code_tests", 1.0)], [ADD, "no code", ADD], [IO, IO, json.dumps({"tests": 1})],
                                  timeout_s=30.0)
    assert list(total) == [1.0, 0.0, 0.0] and failures == 1


def test_tests_stop_before_the_pool_kills_the_worker():
    """Tests that use a sample's whole time limit outlived the pool's kill (its clock starts first): the worker was
    killed and code_tests_frac scored 0, with a failure counted, where the first test had passed."""
    prog = "```python\nline = input()\nwhile line == 'hang':\n    pass\nprint(int(line) + 1)\n```"
    spec = json.dumps({"inputs": ["1", "hang", "hang"], "outputs": ["2", "0", "0"]})
    total, failures = score_batch([("code_tests_frac", 1.0)], [prog], [spec], timeout_s=5.0)
    assert failures == 0 and list(total) == [pytest.approx(1 / 3)]
