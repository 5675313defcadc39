"""The test specs of the code rewards (`rl.rewards.code`): a record's answer read as tests in the forms the public
code-RL sets use (standard input / output, call-based, assert-style test code), and the specs refused before any
program runs (no test, test code that checks nothing, tests that need a pytest fixture)."""

from __future__ import annotations

import ast
import json


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
            if _uncalled_check(*_check_test_code(code)):  # one parse and walk: every record is checked at load
                if not (isinstance(entry_point, str) and entry_point.isidentifier()):
                    raise ValueError(
                        f"code tests: the test code defines check(candidate) and never calls it, and the row names no "
                        f"entry_point (got {entry_point!r}): HumanEval's harness calls check(<entry_point>); "
                        "expected the row's entry_point field, the name of the function the program defines")
                tests[i] = (kind, f"{code}\n\ncheck({entry_point})\n", None)
    return tests


def _uncalled_check(tree: ast.Module, called: set[str]) -> bool:
    """Whether test code defines a top-level `check` that takes an argument and nothing calls it by name."""
    defines = any(isinstance(n, ast.FunctionDef) and n.name == "check" and n.args.args for n in tree.body)
    return defines and "check" not in called


def _check_test_code(code: str) -> tuple[ast.Module, set[str]]:
    """Test code must be Python that can fail: an assert statement, a raise, or a call of an assert* function
    (unittest's, numpy.testing's). -> (its syntax tree, the names it calls), from one walk of the tree (a
    walk was most of the time each record's check takes as its file loads)."""
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
    checks, called = False, set()
    for n in ast.walk(tree):
        checks = checks or asserts(n)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            called.add(n.func.id)
    if not checks:
        raise ValueError(f"code tests: the test code checks nothing (no assert, raise or assert* call), so every "
                         f"program that runs would pass: {code[:80]!r}; expected tests (is it a reference solution? "
                         "data.answer_key names the tests' field)")
    for test, names in _fixtures(tree, called):
        raise ValueError(f"code tests: {test} takes {', '.join(names)}, pytest fixtures this harness does not provide "
                         "(it calls test functions with no argument or with pytest.mark.parametrize's); expected "
                         f"tests of those forms: {code[:80]!r}")
    return tree, called


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


def _fixtures(tree: ast.Module, called: set[str]) -> list[tuple[str, list[str]]]:
    """(test, the arguments it takes that nothing gives) for the test functions the harness calls: top-level
    `test*` functions the test code does not call itself (`called`: the names it calls), and `test*` methods of
    `Test*` classes that are not unittest's."""
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


def _text(x) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def row_func_name(meta: dict) -> str | None:
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
