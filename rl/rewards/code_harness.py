"""The child side of the code rewards (`rl.rewards.code`): the source `python -I -c` runs for each test, which sets
its own limits, runs the program, and then the tests (assert-style test code and the tests it defines) or the call of
a call-based test. Kept as text: a fresh interpreter runs it, with nothing of the trainer's imported.
"""

HARNESS = r"""
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
CALL = """
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
