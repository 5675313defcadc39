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

import ast
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
_LIMITED = r"""
import os, resource, sys, types
def tasks(uid):  # RLIMIT_NPROC caps all of the user's tasks (threads too), not this process's children
    n = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat("/proc/" + pid).st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n
def main():
    cpu, memory, file_bytes, processes, files = map(int, sys.argv[1:6])
    limits = [(resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, file_bytes),
              (resource.RLIMIT_NOFILE, files), (resource.RLIMIT_CORE, 0)]
    if os.getuid() != 0 and os.path.isdir("/proc/self/task"):  # the kernel does not hold root to it
        limits.append((resource.RLIMIT_NPROC, tasks(os.getuid()) + processes))
    for limit, value in limits:
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))
    try:  # Linux: die with the reward's process (the pool kills a worker past its time) instead of living on
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(sys.argv[6]):
        os._exit(1)  # the parent died before prctl
    path, check = sys.argv[7], None
    if len(sys.argv) > 8:  # the tests and the marker, out of the program's reach before it runs
        with open(sys.argv[8]) as f:
            check = f.read()
        os.unlink(sys.argv[8])
    sys.argv = [path]
    # a program read from stdin runs as the script (__main__); one the tests import or call runs as a module, so its
    # `if __name__ == "__main__":` demo (unittest.main(), an input() loop) stays out of the tests, as APPS's and
    # LiveCodeBench's graders import it and HumanEval's exec leaves it out
    module = types.ModuleType("__main__" if check is None else "solution")
    module.__file__ = path
    sys.modules["__main__"] = module  # pickling its classes works, as under runpy
    sys.modules["solution"] = module  # KodCode's tests import the program as `solution`: `from solution import f`
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    if check is None:
        exec(code, module.__dict__)
        return
    mode, _, check = check.partition("\n")
    if mode == "call":  # the names LiveCodeBench's and APPS' graders give a program (List of a LeetCode signature)
        exec(IMPORTS, module.__dict__)
    runner = Runner()  # before the program runs, which could rebind what it uses
    exec(code, module.__dict__)
    if mode == "call":  # the call of a call-based test, which prints its value
        exec(compile(check, "<call>", "exec"), module.__dict__)
        return
    finished, _, check = check.partition("\n")
    module.__dict__["__name__"] = "__main__"  # the tests run as the script: their own `if __name__ == ...` checks run
    runner.guard_main()
    exec(compile(check, "<tests>", "exec"), module.__dict__)
    runner.run(module.__dict__, check)
    print(finished)
IMPORTS = ("from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
           "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\nfrom random import *\n"
           "from statistics import *\nfrom itertools import *\nfrom functools import *\nfrom operator import *\n"
           "from io import *\nfrom sys import *\nfrom json import *\nfrom builtins import *\nfrom typing import *\n"
           "import string, re, datetime, collections, heapq, bisect, copy, math, random, statistics, itertools\n"
           "import functools, operator, io, sys, json\nsys.setrecursionlimit(50000)\n")
class Runner:
    # Runs the tests the test code defines and never calls: pytest-style tests (KodCode's) and unittest cases
    # (BigCodeBench's) passed every program until they ran here. What it uses is bound before the program runs (a
    # program rebinding inspect.signature or TestResult.wasSuccessful skipped or passed them; one rewriting their
    # internals still can: not a sandbox).
    def __init__(self):
        import ast, inspect, unittest
        self.ast, self.signature, self.unittest = ast, inspect.signature, unittest
        self.TestCase, self.TestResult, self.TestProgram = unittest.TestCase, unittest.TestResult, unittest.TestProgram
        self.loader = unittest.TestLoader()
        self.main_ran = False
    def successful(self, result):
        # a skip the test's own decorator asks for is one; a SkipTest raised while it runs (by the program) fails
        raised = [t for t, _ in result.skipped if not (getattr(type(t), "__unittest_skip__", False) or getattr(
            getattr(type(t), getattr(t, "_testMethodName", ""), None), "__unittest_skip__", False))]
        return not (result.failures or result.errors or result.unexpectedSuccesses or raised)
    def guard_main(self):  # unittest.main() closing the test code: its cases run, and it does not exit
        program, successful = self.TestProgram, self.successful
        def main(*args, **kwargs):
            kwargs["exit"] = False
            if not successful(program(*args, **kwargs).result):
                raise AssertionError("unittest.main: a test failed")
            self.main_ran = True
        self.unittest.main = main
    def params(self, fn):
        try:
            return list(self.signature(fn, follow_wrapped=False).parameters.values())
        except (TypeError, ValueError):
            return None
    def optional(self, hook, arg):  # pytest's set-up hooks take their argument or none
        if hook is not None:
            hook(arg) if self.params(hook) else hook()
    def takes(self, fn, kw):  # fn can be called with kw alone (mock.patch's wrapper gives its own arguments)
        params = self.params(fn)
        return params is None or all(p.name in kw or p.default is not p.empty
                                     or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
    def skipped(self, marks):  # pytest's skip, xfail and skipif (its condition, a text one evaluated as pytest does)
        for m in marks or ():
            name = getattr(m, "name", "")
            if name in ("skip", "xfail"):
                return True
            if name == "skipif":
                cond = m.args[0] if m.args else m.kwargs.get("condition", True)
                if isinstance(cond, str):
                    try:
                        cond = eval(cond, {"os": os, "sys": sys, "platform": __import__("platform")})
                    except Exception:
                        cond = False
                if cond:
                    return True
        return False
    def cases(self, fn, inherited=()):  # each call's keyword arguments: pytest's parametrize marks, as a product
        marks = [*getattr(fn, "pytestmark", []), *inherited]  # the function's, its class's and the module's
        if self.skipped(marks):
            return []
        calls = [{}]
        for mark in reversed(marks):
            if getattr(mark, "name", "") != "parametrize":
                continue
            given = {**dict(zip(("argnames", "argvalues"), mark.args)), **getattr(mark, "kwargs", {})}
            names, text = given["argnames"], isinstance(given["argnames"], str)
            names = [n.strip() for n in names.split(",") if n.strip()] if text else list(names)
            rows = []
            for v in given["argvalues"]:
                values = getattr(v, "values", None)  # pytest.param(...): its values, always a tuple
                if values is None:  # one name given as text takes each value whole (pytest's rule), else a tuple
                    values = (v,) if text and len(names) == 1 else tuple(v)
                elif self.skipped(getattr(v, "marks", ())):
                    continue
                rows.append(dict(zip(names, values)))
            calls = [{**c, **r} for c in calls for r in rows]
        return calls
    def call(self, fn, kw):  # an async test awaited, a generator test run through (their bodies passed every program)
        import asyncio, inspect
        result = fn(**kw)
        if inspect.iscoroutine(result):
            asyncio.run(result)
        elif inspect.isgenerator(result):
            for _ in result:
                pass
    def run(self, ns, check):
        ast = self.ast
        tree = ast.parse(check)
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        own = [n.name for n in tree.body if isinstance(n, defs)]  # the tests' own names, not the program's
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        hook = lambda name: ns.get(name) if name in own else None
        module_marks = ns.get("pytestmark", []) if any(  # the test code's own module-level marks
            isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
            for n in tree.body) else []
        module_marks = module_marks if isinstance(module_marks, list) else [module_marks]
        found = ran = 0
        self.optional(hook("setup_module"), sys.modules["__main__"])
        for name in dict.fromkeys(own):
            value = ns.get(name)
            if isinstance(value, type) and issubclass(value, self.TestCase):
                if self.main_ran:  # unittest.main() ran (and passed) every case of the test code already
                    ran += 1
                    continue
                result, suite = self.TestResult(), self.loader.loadTestsFromTestCase(value)
                found += suite.countTestCases()
                suite.run(result)
                if not self.successful(result):
                    raise AssertionError(name + " failed")
                ran += result.testsRun - len(result.skipped)
            elif isinstance(value, type) and name.startswith("Test"):
                if not getattr(value, "__test__", True) or value.__init__ is not object.__init__:
                    continue  # pytest collects neither (a helper class named Test*)
                class_marks = [*getattr(value, "pytestmark", []), *module_marks]
                self.optional(getattr(value, "setup_class", None), value)
                for attr in [a for a in dir(value) if a.startswith("test") and callable(getattr(value, a))]:
                    found += 1
                    for kw in self.cases(getattr(value, attr), class_marks):
                        case = value()
                        method = getattr(case, attr)
                        if not self.takes(method, kw):
                            raise AssertionError(f"{name}.{attr} cannot be called")
                        self.optional(getattr(case, "setup_method", None), method)
                        self.call(method, kw)
                        self.optional(getattr(case, "teardown_method", None), method)
                        ran += 1
                self.optional(getattr(value, "teardown_class", None), value)
            elif name.startswith("test") and callable(value) and name not in called:
                # one the test code calls itself ran there (or is its helper: test_case(a, b, expected)), not again
                found += 1
                for kw in self.cases(value, module_marks):
                    if not self.takes(value, kw):
                        raise AssertionError(name + " cannot be called")
                    self.optional(hook("setup_function"), value)
                    self.call(value, kw)
                    self.optional(hook("teardown_function"), value)
                    ran += 1
        if found and not ran:  # every test skipped: nothing checked the program (pytest.mark rewritten, say)
            raise AssertionError("no test ran")
        self.optional(hook("teardown_module"), sys.modules["__main__"])
main()
"""
_CALL = """
import json, sys
_args = json.loads(sys.stdin.read())
# a LeetCode-style class Solution first, as APPS' and LiveCodeBench's graders call it (a method named search or merge
# is not the stdlib's of the graders' imports)
_cls = globals().get("Solution")
_fn = getattr(_cls(), {fn!r}) if isinstance(_cls, type) and hasattr(_cls, {fn!r}) else globals()[{fn!r}]
_value = _fn(*_args)
# a line of its own, after whatever the function printed without a newline; not through a print the program rebound
sys.__stdout__.write("\\n" + json.dumps(_value) + "\\n")
"""


def extract_program(completion: str) -> str | None:
    """The last fenced code block's text (a python-tagged or untagged one) in the completion's answer part
    (`answer_scope`: after ``</think>`` where it thought first, so a draft inside the thinking is not the program;
    none while a ``<think>`` is open), or None."""
    scope = answer_scope(completion)
    if scope is None:
        return None
    blocks = [body for lang, body in _FENCE.findall(scope) if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else None


def parse_tests(answer, entry_point: str | None = None,
                func_name: str | None = None) -> list[tuple[str, object, object]]:
    """The tests of an answer as (kind, input, expected): kind "io" (stdin text, stdout text), "call" (argument
    list, expected value; the function name rides in `input` as (name, args)) or "assert" (code, None).
    Raises ValueError naming what was wrong with a spec it cannot read, one that holds no test, and test code that
    checks nothing (every program that runs would pass it: a reference solution taken for the tests, say).
    HumanEval's test code defines `check(candidate)` and leaves the call to the harness: it is called with the
    program's `entry_point` (the row's field of that name); without one such code is refused (every program
    passed it: nothing called it). `func_name`: the row's function for LiveCodeBench's functional tests that name
    none themselves (its rows keep it in a row-level `metadata`)."""
    tests = _parse_tests(answer, func_name)
    if not tests:
        raise ValueError(f"code tests: the spec holds no test ({str(answer)[:80]!r}); expected at least one")
    for i, (kind, code, _) in enumerate(tests):
        if kind == "assert":
            _check_test_code(code)
            if _uncalled_check(code):
                if not (isinstance(entry_point, str) and entry_point.isidentifier()):
                    raise ValueError(
                        f"code tests: the test code defines check(candidate) and never calls it, and the row names no "
                        f"entry_point (got {entry_point!r}): HumanEval's harness calls check(<entry_point>); "
                        "expected the row's entry_point field, the name of the function the program defines")
                tests[i] = (kind, f"{code}\n\ncheck({entry_point})\n", None)
    return tests


def _uncalled_check(code: str) -> bool:
    """Whether test code defines a top-level `check` that takes an argument and nothing calls it by name."""
    tree = ast.parse(code)
    defines = any(isinstance(n, ast.FunctionDef) and n.name == "check" and n.args.args for n in tree.body)
    called = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "check"
                 for n in ast.walk(tree))
    return defines and not called


def _check_test_code(code: str) -> None:
    """Test code must be Python that can fail: an assert statement, a raise, or a call of an assert* function
    (unittest's, numpy.testing's)."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise ValueError(f"code tests: the test code is not Python ({e.msg}, line {e.lineno}): {code[:80]!r}") from None

    def asserts(node) -> bool:
        if isinstance(node, (ast.Assert, ast.Raise)):
            return True
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            return name.startswith("assert") or name == "raises"  # pytest.raises fails a test that does not raise
        return False
    if not any(asserts(n) for n in ast.walk(tree)):
        raise ValueError(f"code tests: the test code checks nothing (no assert, raise or assert* call), so every "
                         f"program that runs would pass: {code[:80]!r}; expected tests (is it a reference solution? "
                         "data.answer_key names the tests' field)")
    for test, names in _fixtures(tree):
        raise ValueError(f"code tests: {test} takes {', '.join(names)}, pytest fixtures this harness does not provide "
                         "(it calls test functions with no argument or with pytest.mark.parametrize's); expected "
                         f"tests of those forms: {code[:80]!r}")


def _parametrized(fn: ast.FunctionDef) -> set[str] | None:
    """The argument names `fn`'s pytest.mark.parametrize decorators give, None where one names them other than
    by a literal (unknown here)."""
    names: set[str] = set()
    for d in fn.decorator_list:
        if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "parametrize":
            given = d.args[0] if d.args else next((k.value for k in d.keywords if k.arg == "argnames"), None)
            if isinstance(given, ast.Constant) and isinstance(given.value, str):
                names |= {n.strip() for n in given.value.split(",")}
            elif isinstance(given, (ast.List, ast.Tuple)) and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in given.elts):
                names |= {e.value for e in given.elts}
            else:
                return None
    return names


def _fixtures(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(test, the arguments it takes that nothing gives) for the test functions the harness calls: top-level
    `test*` functions the test code does not call itself, and `test*` methods of `Test*` classes that are not
    unittest's."""
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
    unittest_cases: set[str] = set()  # unittest gives its methods' arguments (mock.patch's) itself
    while True:  # through bases of the test code's own too
        more = {n for n, c in classes.items() if any(
            (b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")) in unittest_cases
            or (b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")).endswith("TestCase")
            for b in c.bases)} - unittest_cases
        if not more:
            break
        unittest_cases |= more
    # a test function the test code calls itself is its helper (test_case(a, b, expected))
    tests = [(n.name, n, 0) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.name.startswith("test") and n.name not in called]
    tests += [(f"{c.name}.{m.name}", m, 1) for c in classes.values()
              if c.name.startswith("Test") and c.name not in unittest_cases
              for m in c.body
              if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test")]
    out = []
    for name, fn, skip in tests:
        if any("patch" in ast.unparse(d) for d in fn.decorator_list):  # mock.patch passes its mocks itself
            continue
        given = _parametrized(fn)
        args = fn.args.posonlyargs + fn.args.args
        required = [a.arg for a in args[skip:len(args) - len(fn.args.defaults)]]
        required += [a.arg for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is None]
        missing = [a for a in required if given is not None and a not in given]
        if missing:
            out.append((name, missing))
    return out


def _parse_tests(answer, func_name: str | None = None) -> list[tuple[str, object, object]]:
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
        return [_listed_test(t, func_name) for t in spec]
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


def _listed_test(t: dict, func_name: str | None = None) -> tuple[str, object, object]:
    """One test of a list of {"input", "output"}: standard input / output, or a call where the test says so:
    LiveCodeBench's `"testtype": "functional"` (its function in `metadata.func_name`; the arguments one JSON value a
    line of the input, the output one JSON value), or a test naming its `fn_name` (PrimeIntellect's
    `"type": "function_call"`, the arguments a list). Graded as standard input / output, a correct function scored
    0 and a program printing the expected text 1 (an audit)."""
    meta = t.get("metadata") if isinstance(t.get("metadata"), dict) else {}
    fn = t.get("fn_name") or meta.get("func_name") or func_name
    if t.get("testtype") != "functional" and not t.get("fn_name"):
        return "io", _text(t["input"]), _text(t["output"])
    if not (isinstance(fn, str) and fn.isidentifier()):
        raise ValueError(f"code tests: a functional test names no function to call (metadata.func_name or fn_name; "
                         f"got {fn!r}): {str(t)[:80]!r}")
    given, expected = t["input"], t["output"]
    if t.get("testtype") != "functional":  # the arguments as a list, the value as it is (APPS's call-based form)
        return "call", (fn, list(given) if isinstance(given, (list, tuple)) else [given]), expected
    try:  # LiveCodeBench's texts: one JSON value a line of the input, one the output
        args = [json.loads(line) for line in str(given).split("\n") if line.strip()]
        return "call", (fn, args), json.loads(expected) if isinstance(expected, str) else expected
    except json.JSONDecodeError as e:
        raise ValueError(f"code tests: a functional test's input or output is not JSON ({e.msg}): "
                         f"{str(t)[:80]!r}") from None


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
        code, stdin, check = program, json.dumps(args), "call\n" + _CALL.format(fn=fn)
    else:  # the run must reach the end of the tests: a program that exits early (sys.exit(0)) passed them all
        finished = secrets.token_hex(8)
        code, stdin, check = program, "", f"tests\n{finished}\n{guard_comparisons(given)}"
    # a directory per test: what one test's run left there (files, a symlink in place of main.py) cannot reach the
    # next; what cannot be removed (written by an escaped process) is left rather than failing the sample
    with tempfile.TemporaryDirectory(prefix="m3jax-code-", ignore_cleanup_errors=True) as work, \
            tempfile.TemporaryFile(dir=work) as inp, tempfile.TemporaryFile(dir=work) as out:
        args = [sys.executable, "-I", "-c", _LIMITED, str(int(limit_s) + 1), str(MEMORY_BYTES), str(FILE_BYTES),
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


def _text(x) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


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


def _row_func_name(meta: dict) -> str | None:
    """The function a row's functional tests call where they name none: its `func_name`, or LiveCodeBench's
    row-level `metadata` (a JSON text or a mapping) holding one."""
    given = meta.get("metadata")
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except json.JSONDecodeError:
            given = None
    name = meta.get("func_name") or (given.get("func_name") if isinstance(given, dict) else None)
    return name if isinstance(name, str) else None


def _score(completion: str, answer, timeout_s: float | None, meta) -> tuple[int, int]:
    # a bad spec raises: a data problem, counted as a failure, not a wrong answer
    tests = parse_tests(answer, (meta or {}).get("entry_point"), _row_func_name(meta or {}))
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
