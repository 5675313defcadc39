"""The code rewards grade as the datasets' own graders do (rl/rewards/code.py; a helper's audit against KodCode,
BigCodeBench, LiveCodeBench, PrimeIntellect, APPS / TACO / CodeContests): every test form runs, a call-based test
calls the function, a program's demo block stays out of imported tests, and standard output compares by tokens
and numbers."""

import json

import pytest

from rl.rewards import get_reward
from rl.rewards.code import parse_tests, run_tests, same_output

ADD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"


@pytest.mark.parametrize("tests", [
    # pytest.mark.parametrize, stacked, with pytest.param (KodCode)
    "import pytest\nfrom solution import add\n\n@pytest.mark.parametrize('a, b, s', [(1, 2, 3), (2, 2, 4)])\n"
    "def test_add(a, b, s):\n    assert add(a, b) == s\n\n"
    "@pytest.mark.parametrize('a', [1, pytest.param(5)])\n@pytest.mark.parametrize('b', [0, 2])\n"
    "def test_grid(a, b):\n    assert add(a, b) == a + b\n\n"
    "@pytest.mark.parametrize(argnames='a', argvalues=[1, 2], ids=['one', 'two'])\n"
    "def test_named(a):\n    assert add(a, 0) == a\n",
    # a pytest-style class
    "class TestAdd:\n    def setup_method(self, method):\n        self.x = 2\n\n"
    "    def test_add(self):\n        assert add(self.x, 1) == 3\n",
    # unittest cases without unittest.main() (BigCodeBench)
    "import unittest\n\nclass TestCases(unittest.TestCase):\n    def test_add(self):\n"
    "        self.assertEqual(add(1, 2), 3)\n",
    # found by a review of the change that ran the forms above
    # checks run under the test script's own main guard (it ran as module `solution`: every program passed)
    "def check_add():\n    assert add(1, 2) == 3\n\nif __name__ == '__main__':\n    check_add()\n",
    # a test_* helper with arguments that the tests call themselves (refused as taking fixtures)
    "def test_case(a, b, expected):\n    assert add(a, b) == expected\n\ntest_case(1, 2, 3)\ntest_case(0, 0, 0)\n",
    # BigCodeBench: unittest cases whose methods mock.patch decorates (refused, or with every method decorated,
    # never run)
    "import unittest\nfrom unittest.mock import patch\n\nclass TestCases(unittest.TestCase):\n"
    "    @patch('os.listdir')\n    def test_add(self, listdir):\n        self.assertEqual(add(1, 2), 3)\n",
    "import unittest\nfrom unittest.mock import patch\n\nclass TestCases(unittest.TestCase):\n"
    "    @patch('os.sep', new='/')\n    def test_add(self):\n        self.assertEqual(add(1, 2), 3)\n",
    # pytest's skip / xfail, one name listed (values unpacked), a trailing comma, class and function set-ups,
    # tests inherited from a base class
    "import pytest\n\n@pytest.mark.skip(reason='later')\ndef test_skipped():\n    assert False\n\n"
    "@pytest.mark.parametrize('a', [1, pytest.param(9, marks=pytest.mark.xfail)])\ndef test_x(a):\n"
    "    assert add(a, 0) == a and a != 9\n\n"
    "@pytest.mark.parametrize(['a'], [(1,), (2,)])\ndef test_listed(a):\n    assert add(a, a) == 2 * a\n\n"
    "@pytest.mark.parametrize('a,', [3])\ndef test_comma(a):\n    assert add(a, 1) == 4\n\n"
    "ready = []\ndef setup_function(fn):\n    ready.append(fn.__name__)\n\ndef test_setup():\n"
    "    assert ready and add(2, 2) == 4\n\n"
    "class Base:\n    def test_inherited(self):\n        assert add(2, 3) == 5\n\n"
    "class TestAll(Base):\n    @classmethod\n    def setup_class(cls):\n        cls.k = 7\n\n"
    "    def test_k(self):\n        assert add(self.k, 0) == 7\n",
    # and by a third: async tests (never awaited: every program passed), a helper class named Test* (pytest does
    # not collect it), a class-level skip mark, a test the test code runs itself (run twice: a set-up that cannot
    # repeat failed every program), setup_module, a truth test of a stdlib object, a file of pytest.raises tests
    "import asyncio\n\nasync def test_add():\n    await asyncio.sleep(0)\n    assert add(1, 2) == 3\n\n"
    "class TestAsync:\n    async def test_add(self):\n        assert add(2, 2) == 4\n",
    "class TestHelper:\n    def __init__(self, x):\n        self.x = x\n\n    def test_never(self):\n"
    "        assert False\n\nimport pytest\n\n@pytest.mark.skip(reason='todo')\nclass TestLater:\n"
    "    def test_x(self):\n        assert add(1, 2) == 4\n\ndef test_add():\n    assert add(1, 2) == 3\n",
    "import os\n\ndef test_once():\n    os.mkdir('once')\n    assert add(1, 2) == 3\n\n"
    "if __name__ == '__main__':\n    test_once()\n",
    "state = {}\n\ndef setup_module(module):\n    state['k'] = 3\n\n"
    "def test_add():\n    assert add(1, 2) == state['k']\n",
    "import re\n\ndef test_digits():\n    assert re.fullmatch(r'\\d+', str(add(1, 2)))\n    assert add(1, 2) == 3\n",
    "import pytest\n\ndef test_raises():\n    with pytest.raises(TypeError):\n        add(1)\n"
    "    assert add(1, 2) == 3\n",
    # and by a second review
    "import unittest\n\nclass TestCases(unittest.TestCase):\n    def test_add(self):\n"
    "        self.assertEqual(add(1, 2), 3)\n\nif __name__ == '__main__':\n    unittest.main()\n",
    "class TestA:\n    def setup_class(cls):\n        cls.k = 1\n\n    def setup_method(self):\n        self.j = 2\n\n"
    "    def test_a(self):\n        assert add(self.k, self.j) == 3\n\n"
    "def setup_function():\n    pass\n\ndef test_b():\n    assert add(1, 1) == 2\n",
    "import pytest, sys\n\n@pytest.mark.skipif(condition=False, reason='runs')\ndef test_a():\n"
    "    assert add(1, 2) == 3\n\n"
    "@pytest.mark.skipif('sys.version_info < (3, 0)')\ndef test_b():\n    assert add(2, 2) == 4\n",
    "from unittest.mock import patch\n\n@patch('os.getcwd')\ndef test_a(getcwd):\n    assert add(1, 2) == 3\n",
    "import unittest\nfrom unittest.mock import patch\n\nclass Base(unittest.TestCase):\n    pass\n\n"
    "class TestCases(Base):\n    @patch('os.getcwd')\n    def test_a(self, getcwd):\n"
    "        self.assertEqual(add(1, 2), 3)\n",
])
def test_every_form_of_test_code_runs(tests):
    """Defined and never called, these passed every program that defined the names (a wrong add scored 1.0)."""
    spec = parse_tests(tests)
    assert run_tests(ADD, spec, 10) == (1, 1)
    assert run_tests(WRONG, spec, 10) == (0, 1)


def test_tests_that_need_a_fixture_are_refused_by_name():
    with pytest.raises(ValueError, match=r"test_out takes capsys, pytest fixtures this harness does not provide"):
        parse_tests("def test_out(capsys):\n    print(1)\n    assert capsys.readouterr().out == '1\\n'\n")
    with pytest.raises(ValueError, match=r"TestX.test_y takes data"):
        parse_tests("class TestX:\n    def test_y(self, data):\n        assert data\n")
    parse_tests("import pytest\n@pytest.mark.parametrize(['a'], [[1]])\ndef test_a(a, b=2):\n    assert a\n")
    # a file of pytest.raises tests checks something (it was refused as checking nothing: a third review)
    parse_tests("import pytest\ndef test_r():\n    with pytest.raises(ZeroDivisionError):\n        add(1, 0) / 0\n")


def test_a_demo_block_stays_out_of_imported_tests():
    """APPS', LiveCodeBench's and HumanEval's graders import or exec the program without running its
    `if __name__ == "__main__":` block: unittest.main() there exited before the tests' end, input() hit EOF."""
    with_main = ADD + "\nif __name__ == '__main__':\n    import unittest\n    print(add(int(input()), 1))\n"
    assert get_reward("code_tests")(f"```python\n{with_main}```", ["assert add(1, 2) == 3"]) == 1.0
    assert get_reward("code_tests")(f"```python\n{with_main}```",
                                    {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}) == 1.0
    # a program read from standard input still runs as the script
    script = "```python\nif __name__ == '__main__':\n    print(int(input()) + 1)\n```"
    assert get_reward("code_tests")(script, [{"input": "1", "output": "2"}]) == 1.0


def test_livecodebench_and_primeintellect_function_tests_call_the_function():
    """Graded as standard input / output, a correct `class Solution` scored 0 and a program printing the expected
    text 1."""
    lcb = [{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional",
            "metadata": {"func_name": "twoSum"}},
           {"input": "[3, 2, 4]\n6", "output": "[1, 2]", "testtype": "functional", "metadata": {"func_name": "twoSum"}},
           {"input": "1 2", "output": "3", "testtype": "stdin"}]
    solution = ("```python\nclass Solution:\n    def twoSum(self, nums, target):\n"
                "        seen = {}\n        for i, x in enumerate(nums):\n"
                "            if target - x in seen:\n                return [seen[target - x], i]\n"
                "            seen[x] = i\n\nif __name__ == '__main__':\n"
                "    a, b = map(int, input().split())\n    print(a + b)\n```")
    assert get_reward("code_tests")(solution, json.dumps(lcb)) == 1.0
    assert get_reward("code_tests_frac")("```python\nprint('[0, 1]')\n```", json.dumps(lcb)) == 0.0
    prime = [{"type": "function_call", "fn_name": "add", "input": [1, 2], "output": [3]}]
    assert get_reward("code_tests")(f"```python\n{ADD}```", prime) == 1.0
    assert get_reward("code_tests")("```python\nprint(int(input()) + 2)\n```", prime) == 0.0
    with pytest.raises(ValueError, match="names no function"):
        parse_tests([{"input": "1", "output": "1", "testtype": "functional"}])


def test_livecodebench_rows_name_the_function_in_their_metadata():
    """LiveCodeBench's own rows keep `func_name` in a row-level `metadata` JSON text, not in each test (a review):
    its functional tests were refused as naming no function."""
    tests = [{"input": "[2, 7]\n9", "output": "[0, 1]", "testtype": "functional"}]
    solution = ("```python\nclass Solution:\n    def twoSum(self, nums, target):\n"
                "        return [0, 1] if nums[0] + nums[1] == target else []\n```")
    meta = {"metadata": json.dumps({"func_name": "twoSum"}), "question_content": "x" * 1000}
    assert get_reward("code_tests")(solution, tests, meta=meta) == 1.0
    from rl.rewards.calls import context_value
    from rl.rewards.code import code_tests_reward
    assert context_value(code_tests_reward, "meta", meta) == {"metadata": meta["metadata"]}


def test_a_function_that_prints_without_a_newline_still_returns_its_value():
    prog = "```python\ndef add(a, b):\n    print('adding', end='')\n    return a + b\n```"
    assert get_reward("code_tests")(prog, {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}) == 1.0


@pytest.mark.parametrize("got, want, same", [
    ("0.3333333333333333\n", "0.333333333\n", True),  # within 1e-6 of an expected fraction
    ("0.5\n", "0.500000", True),
    ("2.0", "2", True),  # equal numbers
    (" 3", "3", True), ("1  2\n\n", "1 2", True), ("\n1 2", "1 2\n", True),  # whitespace around and between
    ("3\r\n4", "3\n4", True),
    ("0.334", "0.333333333", False),  # past the tolerance
    ("3.0000001", "3", False),  # an integer expected: only itself
    ("1 2", "12", False), ("1\n2", "1 2", False), ("12", "1 2", False),  # tokens and lines still count
    ("abc", "ABC", False), ("nan", "0.5", False), ("1e999999999", "1.5", False), ("", "0", False),
])
def test_standard_output_compares_by_tokens_and_numbers(got, want, same):
    assert same_output(got, want) is same


def test_a_draft_inside_the_thinking_is_not_the_program():
    draft = "<think>\n```python\nprint(int(input()) + 2)\n```\nno, one more</think>\n"
    tests = [{"input": "1", "output": "3"}]
    assert get_reward("code_tests")(draft + "```python\nprint(int(input()) + 2)\n```", tests) == 1.0
    assert get_reward("code_tests")(draft + "So that is it.", tests) == 0.0
    assert get_reward("code_tests")("<think>\n```python\nprint(int(input()) + 2)\n```\nlet me check", tests) == 0.0


def test_a_leetcode_signature_needs_no_import_of_its_types():
    """LiveCodeBench's and APPS' graders run the program after `from typing import *` and the like: a starter
    signature `prices: List[int]` without its import scored 0 (a NameError)."""
    prog = ("```python\nclass Solution:\n    def maxProfit(self, prices: List[int]) -> int:\n"
            "        return max(b - a for a, b in combinations(prices, 2))\n```")
    lcb = [{"input": "[7, 1, 5]", "output": "4", "testtype": "functional", "metadata": {"func_name": "maxProfit"}}]
    assert get_reward("code_tests")(prog, lcb) == 1.0


def test_a_program_that_prints_the_tag_is_still_graded():
    """Only a completion that begins with <think> and never closes it has no answer part."""
    assert get_reward("code_tests")("```python\nprint('<think>')\n```", [{"input": "", "output": "<think>"}]) == 1.0


# A second review of the harness: programs that passed it with a wrong answer.
UNITTEST = ("import unittest\n\nclass TestCases(unittest.TestCase):\n    def test_add(self):\n"
            "        self.assertEqual(add(1, 2), 3)\n")
PYTEST = "import pytest\n\n@pytest.mark.parametrize('a', [1, 2])\ndef test_add(a):\n    assert add(a, 0) == a + 0\n"


@pytest.mark.parametrize("cheat, tests", [
    ("import unittest\ndef add(a, b):\n    raise unittest.SkipTest('later')\n", UNITTEST),
    ("import unittest\nunittest.TestResult.wasSuccessful = lambda self: True\n" + WRONG, UNITTEST),
    ("import inspect\n_s = inspect.signature\n"
     "inspect.signature = lambda f, *a, **k: _s(lambda x, y, z: 0)\n" + WRONG, PYTEST),
    ("import pytest\n_skip = pytest.mark.skip\nclass M:\n    def __getattr__(self, name):\n"
     "        return _skip\npytest.mark = M()\n" + WRONG, PYTEST),  # every test marked skip: "no test ran"
])
def test_a_program_cannot_skip_or_pass_the_tests_by_rewriting_the_runner(cheat, tests):
    assert run_tests(cheat, parse_tests(tests), 10) == (0, 1)


def test_call_based_tests_prefer_the_solution_class_and_ignore_a_rebound_print():
    search = ("```python\nclass Solution:\n    def search(self, nums, target):\n"
              "        return nums.index(target) if target in nums else -1\n```")
    spec = {"fn_name": "search", "inputs": [[[4, 5, 6, 7, 0, 1, 2], 0]], "outputs": [4]}
    assert get_reward("code_tests")(search, spec) == 1.0  # not re.search of the graders' imports
    rebound = "```python\nimport sys\nprint = lambda x: sys.stdout.write(str(x) + '\\n')\n" + ADD + "```"
    assert get_reward("code_tests")(rebound, {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}) == 1.0


def test_unittest_main_runs_each_case_once():
    """The cases unittest.main() ran are not run again (a case whose set-up cannot repeat failed every program)."""
    tests = ("import os, unittest\n\nclass TestCases(unittest.TestCase):\n    def test_add(self):\n"
             "        os.mkdir('once')\n        self.assertEqual(add(1, 2), 3)\n\nif __name__ == '__main__':\n"
             "    unittest.main()\n")
    assert run_tests(ADD, parse_tests(tests), 10) == (1, 1)
    assert run_tests(WRONG, parse_tests(tests), 10) == (0, 1)


def test_a_file_whose_unittest_cases_are_all_skipped_checks_nothing():
    """unittest counts a skipped case as run: every program passed such a file, where the pytest side fails it."""
    tests = ("import unittest\n\nclass TestCases(unittest.TestCase):\n    @unittest.skip('later')\n"
             "    def test_add(self):\n        self.assertEqual(add(1, 2), 3)\n")
    assert run_tests(ADD, parse_tests(tests), 10) == (0, 1)
    assert run_tests("x = 1\n", parse_tests(tests), 10) == (0, 1)
