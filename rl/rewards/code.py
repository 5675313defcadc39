"""``code_tests`` / ``code_tests_frac``: does the completion's program pass the record's test cases?

The program is the last fenced code block (```python ... ```, or a bare ``` ... ```) of the completion's answer
part (after ``</think>`` where it thought first; none while a ``<think>`` is open, `rl.rewards.format.answer_scope`);
no block scores 0. The tests are the record's answer (`data.answer_key`), as JSON text or already parsed, in the
forms the public code-RL sets use:

- standard input / output: ``{"inputs": [...], "outputs": [...]}`` (APPS, TACO, DeepCoder; a list of lines is
  joined with newlines) or a list of ``{"input": ..., "output": ...}``; stdout passes as LiveCodeBench's and APPS'
  graders compare (`same_output`): line by line with surrounding whitespace dropped, then token by token, a number
  equal to the expected one or within 1e-6 (absolute or relative) of an expected fraction;
- call-based: ``{"fn_name": "f", "inputs": [[args...], ...], "outputs": [...]}``, a listed test that names its
  ``fn_name`` (PrimeIntellect's), or LiveCodeBench's ``"testtype": "functional"`` (the function in the test's
  or the row's ``metadata.func_name``, one JSON argument a line): ``f(*args)`` after the stdlib names
  LiveCodeBench's grader gives a program (``from typing import *`` and the like), or first ``Solution().f(*args)``
  where the program defines a LeetCode-style ``class Solution`` with that method (as APPS' checker calls it),
  compared with ``==`` after a JSON round trip (an expected ``[value]`` also matches ``value``, as APPS wraps
  them; ``true`` equals only ``true``, not ``1``);
- assertions: ``{"asserts": ["assert f(1) == 2", ...]}``, a list of such strings (MBPP's test_list), or one
  string (HumanEval-style test code: its ``check(candidate)`` is called with the row's ``entry_point``): each runs
  after the program and passes when the process exits with 0; the tests it defines are then run: ``test*``
  functions (pytest style, KodCode's, whose ``from solution import f`` imports the program) with their
  ``pytest.mark.parametrize`` cases (less those a skip / xfail mark of theirs, their class's or the module's
  drops; async ones awaited), the ``test*`` methods of ``Test*`` classes that pytest collects (inherited ones too;
  ``setup_module``, ``setup_class`` / ``setup_method``, ``setup_function``; not autouse fixtures, nor
  ``indirect`` parametrization), and ``unittest.TestCase`` classes (BigCodeBench's; ``unittest.main()`` at their
  end runs them without exiting); a test that takes a pytest fixture is refused by name, a ``test*`` function the
  test code calls itself is its helper (run there, not again). A test skipped by a ``SkipTest`` raised while it
  runs fails, as does test code none of whose tests ran (unittest's skipped cases do not count). What the runner
  uses is bound before the program runs (a program rebinding ``inspect.signature`` or ``TestResult.wasSuccessful``
  passed them); one rewriting their internals still can: this is not a sandbox. The assertions compare plain copies of
  the program's values (rl.rewards.code_asserts): an object of the program's that equals everything passes none of
  them. Test code that holds no assert, raise or ``assert*`` call is refused, as is a spec with no test, and
  HumanEval's ``check`` without an entry point: every program would pass.

Under call-based and assert tests the program runs as a module (``solution``), not as the script: its
``if __name__ == "__main__":`` block stays out of them, as the graders import it (the test code itself runs as
the script).

``code_tests`` is 1 when every test passes (DeepCoder's sparse reward), ``code_tests_frac`` the share passed.

Each test runs in a fresh ``python -I`` process in its own empty temporary directory (removed after), with a minimal
environment (none of the trainer's variables, API keys included), in a new session: the whole process group is killed
when the test ends, so children it forked die with it, and ``os.kill(0, ...)`` reaches only the test's own group.
``resource`` limits: CPU time, address space (`MEMORY_BYTES`), written file size (`FILE_BYTES`, stdout included: it
goes to a file, not into the trainer's memory), open files, core dumps, and processes (`PROCESSES` more than the user
runs already; the kernel does not apply that one to root). A test gets at most `PER_TEST_S` seconds and what is left
of the sample's ``timeout_s``; tests not reached in time fail. Assert tests and the end-of-tests marker are read and
deleted by the harness before the program runs, so the program cannot copy them from its own file (one that walks
the interpreter's frames still finds them). On Linux the program dies with the reward's process (the pool's kill).
Killed processes go to init: an init that does not reap (a container without ``--init``) keeps them as zombies.

This is not a sandbox: the program runs as the trainer's user. It can read and write whatever that user can (the
checkpoints, the code), open sockets, signal the user's other processes (``os.kill(-1, 9)`` ends the trainer), and
escape the group kill with ``os.setsid()``; as root nothing bounds how many processes it forks, and nothing bounds
how many files of `FILE_BYTES` it writes. Train on untrusted problems in a container without a network, as a user of
its own, with a pids limit (cgroup ``pids.max``) and a disk quota.
Registered with mode ``"process"``: the pool's kill is the backstop of everything here.
"""

from __future__ import annotations

import decimal
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from rl.rewards.code_asserts import guard_comparisons
from rl.rewards.code_harness import CALL, HARNESS
from rl.rewards.code_specs import row_func_name, parse_tests
from rl.rewards.format import answer_scope
from rl.rewards.registry import register_reward

__all__ = ["extract_program", "parse_tests", "run_tests"]

PER_TEST_S = 4.0
MEMORY_BYTES = 2 << 30
FILE_BYTES = 16 << 20  # each file it writes, stdout included
PROCESSES = 64  # more than the user runs already (threads count too)
OPEN_FILES = 256
TESTS_SHARE = 0.8  # of a sample's timeout_s, what its tests may take in all
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
def extract_program(completion: str) -> str | None:
    """The last fenced code block's text (a python-tagged or untagged one) in the completion's answer part
    (`answer_scope`: after ``</think>`` where it thought first, so a draft inside the thinking is not the program;
    none while a ``<think>`` is open), or None."""
    scope = answer_scope(completion)
    if scope is None:
        return None
    blocks = [body for lang, body in _FENCE.findall(scope) if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else None


def run_tests(program: str, tests, timeout_s: float | None = None) -> tuple[int, int]:
    """(tests passed, tests) of `program` against `tests` (`parse_tests`), within `timeout_s` in all."""
    deadline = time.monotonic() + (timeout_s if timeout_s else PER_TEST_S * len(tests))
    passed = 0
    for kind, given, expected in tests:
        left = min(PER_TEST_S, deadline - time.monotonic())
        if left <= 0.05:
            break
        passed += _one(program, kind, given, expected, left)
    return passed, len(tests)


def _one(program: str, kind: str, given, expected, limit_s: float) -> bool:
    check = None
    if kind == "io":
        code, stdin = program, given
    elif kind == "call":
        fn, args = given
        code, stdin, check = program, json.dumps(args), "call\n" + CALL.format(fn=fn)
    else:  # the run must reach the end of the tests: a program that exits early (sys.exit(0)) passed them all
        finished = secrets.token_hex(8)
        code, stdin, check = program, "", f"tests\n{finished}\n{guard_comparisons(given)}"
    # a directory per test: what one test's run left there (files, a symlink in place of main.py) cannot reach the
    # next; what cannot be removed (written by an escaped process) is left rather than failing the sample
    with tempfile.TemporaryDirectory(prefix="m3jax-code-", ignore_cleanup_errors=True) as work, \
            tempfile.TemporaryFile(dir=work) as inp, tempfile.TemporaryFile(dir=work) as out:
        args = [sys.executable, "-I", "-c", HARNESS, str(int(limit_s) + 1), str(MEMORY_BYTES), str(FILE_BYTES),
                str(PROCESSES), str(OPEN_FILES), str(os.getpid()), _write(work, "main.py", code)]
        if check is not None:
            args.append(_write(work, "tests.py", check))
        inp.write(stdin.encode())
        inp.seek(0)
        # files, not pipes: stdout is bounded by RLIMIT_FSIZE, and a child that keeps a pipe open cannot stall us.
        # The limits are set by the child itself: a preexec_fn is unsafe in a process with threads (JAX's).
        proc = subprocess.Popen(args, stdin=inp, stdout=out, stderr=subprocess.DEVNULL, cwd=work,
                                env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work,
                                     "TMPDIR": work}, start_new_session=True)
        try:
            returncode = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            _kill_group(proc)
        if returncode != 0:
            return False
        out.seek(0)
        stdout = out.read(FILE_BYTES).decode("utf-8", errors="replace")
    if kind == "io":
        return same_output(stdout, expected)
    if kind == "call":
        try:
            got = json.loads(stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return False
        want = json.loads(json.dumps(expected))
        return _same_json(got, want) or _same_json([got], want)
    return _lines(stdout)[-1:] == [finished]


def _same_json(got, want) -> bool:
    """JSON values equal as JSON has them: Python's ==, except that true and false equal only booleans (Python's
    True == 1 gave a function returning 1 the marks of one returning true, and the reverse)."""
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_same_json(g, w) for g, w in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_same_json(got[k], want[k]) for k in got)
    return got == want


def _write(work: str, name: str, text: str) -> str:
    path = os.path.join(work, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the test's process group (its session: what it forked and left behind too), then reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
    proc.wait()


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def same_output(got: str, want: str) -> bool:
    """Standard output against the expected, as the code-RL graders compare it (LiveCodeBench's grade_stdio, APPS'
    testing_util): line by line, each line's surrounding whitespace and the text's leading and trailing empty lines
    dropped; where a line differs, token by token (any run of spaces between), a number equal to the expected one
    exactly (2.0 for 2) or, where the expected one has a fraction, within an absolute or relative error of 1e-6 (the
    competitive-programming tolerance). Compared exactly, 0.3333333333333333 for 0.333333333 scored 0 (an audit)."""
    got_lines, want_lines = _lines(got), _lines(want)
    return len(got_lines) == len(want_lines) and all(
        g == w or _same_tokens(g.split(), w.split()) for g, w in zip(got_lines, want_lines))


def _same_tokens(got: list[str], want: list[str]) -> bool:
    return len(got) == len(want) and all(g == w or _same_number(g, w) for g, w in zip(got, want))


def _same_number(got: str, want: str) -> bool:
    try:
        g, w = decimal.Decimal(got), decimal.Decimal(want)
    except decimal.InvalidOperation:
        return False
    if not (g.is_finite() and w.is_finite()):
        return False
    if g == w:
        return True
    if not any(c in want for c in ".eE"):  # an integer is expected: only itself
        return False
    try:
        return abs(g - w) <= decimal.Decimal("1e-6") * max(decimal.Decimal(1), abs(w))
    except decimal.DecimalException:  # beyond the context's exponents (1e999999999)
        return False


def _tests_of(answer, meta) -> list:
    """The row's tests (`parse_tests` with its entry_point and function name); ValueError for a spec that is not."""
    return parse_tests(answer, (meta or {}).get("entry_point"), row_func_name(meta or {}))


def _score(completion: str, answer, timeout_s: float | None, meta) -> tuple[int, int]:
    # a bad spec raises: a data problem, counted as a failure, not a wrong answer
    tests = _tests_of(answer, meta)
    program = extract_program(completion)
    if program is None or not tests:
        return 0, len(tests)
    # the pool kills a worker timeout_s after handing it the sample, before this clock started: the tests stop
    # earlier, so those that passed count (at the whole limit, a slow last test lost code_tests_frac's credit)
    return run_tests(program, tests, TESTS_SHARE * timeout_s if timeout_s else None)


@register_reward("code_tests", mode="process", scores=(0, 1))
def code_tests_reward(completion: str, answer, *, timeout_s: float | None = 20.0, truncated: bool = False,
                      meta: dict | None = None) -> float:
    passed, total = _score(completion, answer, timeout_s, meta)
    return 1.0 if total and passed == total else 0.0


@register_reward("code_tests_frac", mode="process", scores=(0, 1))
def code_tests_frac_reward(completion: str, answer, *, timeout_s: float | None = 20.0, truncated: bool = False,
                           meta: dict | None = None) -> float:
    passed, total = _score(completion, answer, timeout_s, meta)
    return passed / total if total else 0.0


# the row fields they read: HumanEval's entry_point, LiveCodeBench's metadata (func_name) (a row's reference
# solutions stay out of the pickles)
code_tests_reward.meta_keys = code_tests_frac_reward.meta_keys = ("entry_point", "metadata", "func_name")


def check_tests_answer(answer, meta: dict | None = None) -> str | None:
    """None where `answer` reads as tests (rl.rewards.code_specs.parse_tests), else why not: checked for every
    record as its file loads (rl.answer_checks), where a spec that is not tests used to fail only when scored."""
    try:
        _tests_of(answer, meta)
    except ValueError as e:
        return str(e)
    return None


code_tests_reward.check_answer = code_tests_frac_reward.check_answer = check_tests_answer
