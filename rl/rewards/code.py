"""``code_tests`` / ``code_tests_frac``: does the completion's program pass the record's test cases?

The program is the last fenced code block of the completion (```python ... ```, or a bare ``` ... ```); no block
scores 0. The tests are the record's answer (`data.answer_key`), as JSON text or already parsed, in the forms the
public code-RL sets use:

- standard input / output: ``{"inputs": [...], "outputs": [...]}`` (APPS, TACO, DeepCoder; a list of lines is
  joined with newlines) or a list of ``{"input": ..., "output": ...}``; stdout passes when it equals the expected
  output line by line after trailing whitespace is dropped (and trailing empty lines);
- call-based: ``{"fn_name": "f", "inputs": [[args...], ...], "outputs": [...]}``: ``f(*args)`` after the program,
  or ``Solution().f(*args)`` where the program defines no ``f`` but a LeetCode-style ``class Solution`` (as APPS'
  checker calls it), compared with ``==`` after a JSON round trip (an expected ``[value]`` also matches ``value``, as
  APPS wraps them);
- assertions: ``{"asserts": ["assert f(1) == 2", ...]}``, a list of such strings (MBPP's test_list), or one
  string (HumanEval-style test code): each runs after the program and passes when the process exits with 0.

``code_tests`` is 1 when every test passes (DeepCoder's sparse reward), ``code_tests_frac`` the share passed.

Each test runs in a fresh ``python -I`` process in an empty temporary directory, with ``resource`` limits on CPU
time, address space (`MEMORY_BYTES`) and written file size. A test gets at most `PER_TEST_S` seconds and what is
left of the sample's ``timeout_s``; tests not reached in time fail. This is not a sandbox: the program runs as the
trainer's user and can read files and open sockets. Train on untrusted problems in a container without a network.
Registered with mode ``"process"``: the pool's kill is the backstop of everything here.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time

from rl.rewards.registry import register_reward

__all__ = ["extract_program", "parse_tests", "run_tests"]

PER_TEST_S = 4.0
MEMORY_BYTES = 2 << 30
FILE_BYTES = 16 << 20
TESTS_SHARE = 0.8  # of a sample's timeout_s, what its tests may take in all
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_LIMITED = """
import resource, runpy, sys
for limit, value in zip((resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_FSIZE), sys.argv[1:4]):
    resource.setrlimit(limit, (int(value), int(value)))
sys.argv = sys.argv[4:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
_CALL = """
import json, sys
_args = json.loads(sys.stdin.read())
_fn = globals()[{fn!r}] if {fn!r} in globals() else getattr(globals()["Solution"](), {fn!r})
print(json.dumps(_fn(*_args)))
"""


def extract_program(completion: str) -> str | None:
    """The last fenced code block's text (a python-tagged or untagged one), or None."""
    blocks = [body for lang, body in _FENCE.findall(completion) if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else None


def parse_tests(answer) -> list[tuple[str, object, object]]:
    """The tests of an answer as (kind, input, expected): kind "io" (stdin text, stdout text), "call" (argument
    list, expected value; the function name rides in `input` as (name, args)) or "assert" (code, None).
    Raises ValueError naming what was wrong with a spec it cannot read."""
    spec = answer
    if isinstance(answer, str):
        try:
            spec = json.loads(answer)
        except json.JSONDecodeError:
            return [("assert", answer, None)]  # test code
    if isinstance(spec, str):  # test code stored as a JSON string
        return [("assert", spec, None)]
    if isinstance(spec, dict) and "asserts" in spec:
        spec = spec["asserts"]
    if isinstance(spec, list) and all(isinstance(t, str) for t in spec):
        return [("assert", t, None) for t in spec]
    if isinstance(spec, list) and all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in spec):
        return [("io", _text(t["input"]), _text(t["output"])) for t in spec]
    if isinstance(spec, dict) and isinstance(spec.get("inputs"), list) and isinstance(spec.get("outputs"), list):
        if len(spec["inputs"]) != len(spec["outputs"]):
            raise ValueError(f"code tests: {len(spec['inputs'])} inputs for {len(spec['outputs'])} outputs")
        if spec.get("fn_name"):
            return [("call", (spec["fn_name"], list(i) if isinstance(i, (list, tuple)) else [i]), o)
                    for i, o in zip(spec["inputs"], spec["outputs"])]
        return [("io", _text(i), _text(o)) for i, o in zip(spec["inputs"], spec["outputs"])]
    raise ValueError("code tests: expected {'inputs': [...], 'outputs': [...]} (with 'fn_name' for call-based "
                     "tests), a list of {'input', 'output'}, {'asserts': [...]}, a list of assert strings or test "
                     f"code; got {type(spec).__name__} {str(spec)[:80]!r}")


def run_tests(program: str, tests, timeout_s: float | None = None) -> tuple[int, int]:
    """(tests passed, tests) of `program` against `tests` (`parse_tests`), within `timeout_s` in all."""
    deadline = time.monotonic() + (timeout_s if timeout_s else PER_TEST_S * len(tests))
    passed = 0
    with tempfile.TemporaryDirectory(prefix="m3jax-code-") as work:
        for kind, given, expected in tests:
            left = min(PER_TEST_S, deadline - time.monotonic())
            if left <= 0.05:
                break
            passed += _one(program, kind, given, expected, work, left)
    return passed, len(tests)


def _one(program: str, kind: str, given, expected, work: str, limit_s: float) -> bool:
    if kind == "io":
        code, stdin = program, given
    elif kind == "call":
        fn, args = given
        code, stdin = program + "\n" + _CALL.format(fn=fn), json.dumps(args)
    else:  # the run must reach the end of the tests: a program that exits early (sys.exit(0)) passed them all
        finished = secrets.token_hex(8)
        code, stdin = program + "\n\n" + given + f"\nprint({finished!r})\n", ""
    path = os.path.join(work, "main.py")
    with open(path, "w") as f:
        f.write(code)
    try:  # the limits are set by the child itself: a preexec_fn is unsafe in a process with threads (JAX's)
        done = subprocess.run([sys.executable, "-I", "-c", _LIMITED, str(int(limit_s) + 1), str(MEMORY_BYTES),
                               str(FILE_BYTES), path], input=stdin, capture_output=True, text=True, cwd=work,
                              timeout=limit_s, errors="replace")
    except subprocess.TimeoutExpired:
        return False
    if done.returncode != 0:
        return False
    if kind == "io":
        return _lines(done.stdout) == _lines(expected)
    if kind == "call":
        try:
            got = json.loads(done.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return False
        want = json.loads(json.dumps(expected))
        return got == want or [got] == want
    return _lines(done.stdout)[-1:] == [finished]


def _text(x) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _score(completion: str, answer, timeout_s: float | None) -> tuple[int, int]:
    tests = parse_tests(answer)  # a bad spec raises: a data problem, counted as a failure, not a wrong answer
    program = extract_program(completion)
    if program is None or not tests:
        return 0, len(tests)
    # the pool kills a worker timeout_s after handing it the sample, before this clock started: the tests stop
    # earlier, so those that passed count (at the whole limit, a slow last test lost code_tests_frac's credit)
    return run_tests(program, tests, TESTS_SHARE * timeout_s if timeout_s else None)


@register_reward("code_tests", mode="process")
def code_tests_reward(completion: str, answer, *, timeout_s: float | None = 20.0, **_: object) -> float:
    passed, total = _score(completion, answer, timeout_s)
    return 1.0 if total and passed == total else 0.0


@register_reward("code_tests_frac", mode="process")
def code_tests_frac_reward(completion: str, answer, *, timeout_s: float | None = 20.0, **_: object) -> float:
    passed, total = _score(completion, answer, timeout_s)
    return passed / total if total else 0.0
