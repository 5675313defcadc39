"""rl.rewards.code_asserts: assert-style code tests compare plain copies of the program's values, so an object that
equals everything (the "always equal" reward hack, which scored 1.0: a helper's audit) passes none of them, while
every honest comparison keeps Python's meaning."""

import json

import pytest

from rl.rewards import get_reward
from rl.rewards.code_asserts import guard_comparisons

HACKS = """
from unittest import mock
class AlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    def __le__(self, other): return True
    def __gt__(self, other): return True
    def __ge__(self, other): return True
    def __bool__(self): return True
    def __contains__(self, item): return True
class LyingInt(int):
    def __eq__(self, other): return True
    __hash__ = int.__hash__
class LyingList(list):
    def __eq__(self, other): return True
class LyingStr(str):
    def __eq__(self, other): return True
    __hash__ = str.__hash__
class Point:
    def __init__(self, x, y): self.x, self.y = x, y
    def __eq__(self, other): return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)
class Bag:
    def __init__(self, *items): self.items = list(items)
    def __contains__(self, item): return item in self.items
"""


def _passes(test_code: str) -> bool:
    """Whether `test_code`, guarded, passes after HACKS ran in the same namespace (as the harness runs them)."""
    namespace = {}
    exec(compile(HACKS, "main.py", "exec"), namespace)
    try:
        exec(compile(guard_comparisons(test_code), "<tests>", "exec"), namespace)
    except (AssertionError, TypeError):
        return False
    return True


@pytest.mark.parametrize("test_code", [
    "assert AlwaysEqual() == 3",
    "assert 3 == AlwaysEqual()",
    "assert AlwaysEqual() < 3",
    "assert [AlwaysEqual()] == [3]",
    "assert {'a': AlwaysEqual()} == {'a': [1]}",
    "assert 3 in [AlwaysEqual()]",
    "assert LyingInt(0) == 3",
    "assert LyingList([0]) == [3]",
    "assert LyingStr('no') == 'yes'",
    "assert mock.ANY == 3",
    "assert AlwaysEqual()",
    "assert not AlwaysEqual()",
    "assert AlwaysEqual() and AlwaysEqual()",
    "assert 1 < AlwaysEqual() < 3",
    "assert all(AlwaysEqual() == y for y in (1, 2))",
    "import unittest\nclass T(unittest.TestCase):\n    def runTest(self):\n        self.assertEqual(AlwaysEqual(), 3, "
    "msg='m')\nT().runTest()",
    "import unittest\nclass T(unittest.TestCase):\n    def runTest(self):\n        self.assertTrue(AlwaysEqual())\n"
    "T().runTest()",
])
def test_an_object_that_claims_every_comparison_passes_none(test_code):
    assert not _passes(test_code)


@pytest.mark.parametrize("test_code", [
    "assert 1 == 1.0 == True",
    "assert [1, 2] != (1, 2)",
    "assert {'a': [1, (2, 3)]} == {'a': [1, (2, 3)]}",
    "assert {1, 2} == frozenset({2, 1})",
    "assert LyingInt(3) == 3 and LyingList([3]) == [3] and LyingStr('y') == 'y'",  # honest values of lying types
    "assert b'a' == bytearray(b'a')",
    "assert 2 in range(5) and 7 not in range(5)",
    "assert 'ell' in 'hello'",
    "assert {1: 2, 3: 4}.keys() == {1, 3} and {1: 2}.items() == {(1, 2)} and {1: 2}.keys() != [1]",
    "assert 2 in Bag(1, 2) and 3 not in Bag(1, 2)",
    "assert Point(1, 2) == Point(1, 2) and Point(1, 2) != Point(2, 1)",
    "assert Point(1, 2) is not None and None is None",
    "import numpy as np\nassert (np.arange(3) == [0, 1, 2]).all() and np.int64(3) == 3 and np.array_equal([1], [1])",
    "from fractions import Fraction\nfrom decimal import Decimal\nassert Fraction(1, 2) == 0.5 and Decimal('2') == 2",
    "import pytest\nassert 0.1 + 0.2 == pytest.approx(0.3)",
    "assert 1 < 2 <= 2 < 3",
    "assert AlwaysEqual() != 3",  # consistent: such an object is no builtin value (== 3 fails above)
    "assert not []",
    "calls = []\ndef f(x):\n    calls.append(x)\n    return x\nassert not (f(2) < f(1) < f(0))\nassert calls == [2, 1]",
    "import unittest\nclass T(unittest.TestCase):\n    def runTest(self):\n        self.assertEqual([1], [1], msg='m')\n"
    "        self.assertIn(2, [1, 2])\n        self.assertFalse(0)\nT().runTest()",
    "def helper(node):\n    if not node:\n        return 0\n    return 1\nassert helper(AlwaysEqual()) == 1",  # not asserts
])
def test_honest_comparisons_keep_their_python_meaning(test_code):
    assert _passes(test_code)


def test_the_always_equal_hack_scores_zero_and_an_honest_program_full_marks():
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
    hack = "```python\nclass E:\n    def __eq__(self, o): return True\ndef add(a, b): return E()\n```"
    honest = "```python\ndef add(a, b):\n    return a + b\n```"
    pytest_style = "def test_add():\n    assert add(1, 2) == 3\n"
    for reward in ("code_tests", "code_tests_frac"):
        assert get_reward(reward)(hack, tests, timeout_s=8) == 0.0
        assert get_reward(reward)(hack, pytest_style, timeout_s=8) == 0.0
        assert get_reward(reward)(honest, tests, timeout_s=8) == 1.0
        assert get_reward(reward)(honest, pytest_style, timeout_s=8) == 1.0


def test_call_based_tests_tell_true_from_one():
    """JSON's true and 1 are different answers; Python's True == 1 scored a function returning either as right."""
    returns_true = "```python\ndef f(x):\n    return True\n```"
    returns_one = "```python\ndef f(x):\n    return 1\n```"
    wants_one = json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [1]})
    wants_true = json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [True]})
    code_tests = get_reward("code_tests")
    assert code_tests(returns_true, wants_one) == 0.0 and code_tests(returns_one, wants_true) == 0.0
    assert code_tests(returns_true, wants_true) == 1.0 and code_tests(returns_one, wants_one) == 1.0
    floats = json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [1.0]})
    assert code_tests(returns_one, floats) == 1.0  # 1 and 1.0 are one number, in JSON as in Python
