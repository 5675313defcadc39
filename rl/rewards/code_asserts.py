"""Assertions a program's values cannot answer for themselves: the comparisons of assert-style code tests.

`assert add(1, 2) == 3` calls the result's own `__eq__` when `add` returns an object of the program's class, so a
program whose functions return an object that equals everything (`class E: __eq__ = lambda s, o: True`) passed every
such test with full reward: the "always equal" hack, which RL policies are known to find. `guard_comparisons`
rewrites the test code so that in every `assert` statement (and unittest's `assertEqual`, `assertTrue`, ...):

- each comparison (`==`, `!=`, `<`, `in`, ...; not `is`) compares *plain copies* of its operands: builtin values are
  rebuilt as exact builtins through the base types' own methods (an `int` subclass's `__eq__`, a `list` subclass's
  `__iter__` are never called), and numpy arrays and scalars, `Fraction`, `Decimal`, `range` and pytest's `approx`
  stay as they are (their comparisons are their library's). Any other object (the program's classes, `mock.ANY`)
  equals only another such object, by Python's own `==`: never a builtin value.
- the condition of an `assert` (and the operand of its `not`) must be a plain value or an object of a type some other
  module defines as that name (`re.Match`): an object of the program's class is not taken as true or false on its
  own word (`__bool__`).

Python's semantics are otherwise kept (`1 == 1.0 == True`, `[1] != (1,)`, a numpy comparison's array). A comparison
whose operands are both the program's objects still runs their `__eq__` (`assert f() == Point(1, 2)` trusts the
program's `Point`), and a program that rewrites the harness's names or Python's builtins while the tests run is not
stopped (rl.rewards.code: this is no sandbox).
"""

from __future__ import annotations

import ast

# Runs in the test process after the program, before the tests: the program cannot have replaced these names yet.
HELPERS = r'''
def _m3jax_helpers():
    import operator, sys
    from decimal import Decimal
    from fractions import Fraction
    ops = {"Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le, "Gt": operator.gt,
           "GtE": operator.ge, "In": lambda a, b: a in b, "NotIn": lambda a, b: a not in b}

    class Foreign:  # an object of no trusted type: equal only to another such object, by Python's ==
        __slots__ = ("value",)
        def __init__(self, value): self.value = value
        def __eq__(self, other): return type(other) is Foreign and self.value == other.value
        def __ne__(self, other): return not self.__eq__(other)
        def __hash__(self): return 0  # equal objects hash alike; lookups then ask __eq__
        def __contains__(self, item): return item in self.value  # the program's container answers for itself
        def _order(name):
            def compare(self, other):
                return getattr(operator, name)(self.value, other.value) if type(other) is Foreign else NotImplemented
            return compare
        __lt__, __le__, __gt__, __ge__ = _order("lt"), _order("le"), _order("gt"), _order("ge")

    def trusted(t):
        if t in (Fraction, Decimal, range):
            return True
        module = getattr(t, "__module__", None)
        if module in ("numpy", "_pytest.approx", "_pytest.python_api"):  # numpy's own types; pytest.approx's
            return getattr(sys.modules.get(module), getattr(t, "__name__", ""), None) is t
        return False

    primitive = {int, float, complex, str, bytes, bool, type(None)}
    views = (type({}.keys()), type({}.items()))  # set-like, and compared as sets (`d.keys() == {1, 2}`)

    def plain(x, depth=0):
        t = type(x)
        if x is None or t is bool or t is Foreign:
            return x
        # an exact list / tuple / set / dict of exact primitives is already plain: checked at C speed (element by
        # element below, a list of a million ints took 2.6 s of a test's 4)
        if t in (list, tuple, set, frozenset) and set(map(type, x)) <= primitive:
            return x
        if t is dict and set(map(type, x.keys())) | set(map(type, x.values())) <= primitive:
            return x
        if depth > 200:
            raise RecursionError("a value nested too deeply to compare")
        for base, copy in ((int, int.__int__), (float, float.__float__), (complex, complex.__complex__),
                           (str, str.__str__), (bytes, bytes.__bytes__)):
            if issubclass(t, base):
                return copy(x)
        if issubclass(t, bytearray):
            return bytes(bytearray.__iter__(x))
        if issubclass(t, list):
            return [plain(v, depth + 1) for v in list.__iter__(x)]
        if issubclass(t, tuple):
            return tuple(plain(v, depth + 1) for v in tuple.__iter__(x))
        if issubclass(t, dict):
            return {plain(k, depth + 1): plain(v, depth + 1) for k, v in dict.items(x)}
        if issubclass(t, (set, frozenset)):
            base = set if issubclass(t, set) else frozenset
            return base(plain(v, depth + 1) for v in base.__iter__(x))
        if t in views:
            return {plain(v, depth + 1) for v in x}
        return x if trusted(t) else Foreign(x)

    def elsewhere(t):  # a type a module other than the program's defines (re.Match): its truth is not the program's
        module = getattr(t, "__module__", None)
        return module not in (None, "__main__", "solution", "builtins") and getattr(
            sys.modules.get(module), getattr(t, "__qualname__", ""), None) is t

    def truth(x):
        p = plain(x)
        if type(p) is Foreign:
            if not elsewhere(type(x)):
                raise AssertionError(f"an object of {type(x).__name__!r} is no test's verdict")
            return bool(x)
        return bool(p)

    def compare(left, op, right):
        if op in ("Is", "IsNot"):
            return (left is right) == (op == "Is")
        return ops[op](plain(left), plain(right))

    def chain(left, *steps):  # a < b < c: each right operand evaluated only when the chain goes on
        result = True
        for op, right in steps:
            right = right()
            result = compare(left, op, right)
            if not truth(result):
                return result
            left = right
        return result
    return compare, chain, truth
_m3jax_compare, _m3jax_chain, _m3jax_truth = _m3jax_helpers()
del _m3jax_helpers
'''

# unittest's assertions that compare, as the operator they apply; assertTrue / assertFalse take a verdict
_UNITTEST_COMPARES = {"assertEqual": "Eq", "assertEquals": "Eq", "assertListEqual": "Eq", "assertTupleEqual": "Eq",
                      "assertDictEqual": "Eq", "assertSetEqual": "Eq", "assertNotEqual": "NotEq", "assertIn": "In",
                      "assertNotIn": "NotIn", "assertLess": "Lt", "assertLessEqual": "LtE", "assertGreater": "Gt",
                      "assertGreaterEqual": "GtE"}


def guard_comparisons(code: str) -> str:
    """`code` (test code that parses) with its assertions' comparisons and verdicts on plain values, preceded by
    the helpers they call (`HELPERS`)."""
    tree = _Guard().visit(ast.parse(code))
    return HELPERS + "\n" + ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def _call(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])


class _Guard(ast.NodeTransformer):
    """Rewrites the comparisons inside assertions only: test code's own bookkeeping (`if not node:`) keeps
    Python's semantics."""

    def visit_Assert(self, node: ast.Assert) -> ast.Assert:
        test = _Comparisons().visit(node.test)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test = ast.UnaryOp(op=ast.Not(), operand=_call("_m3jax_truth", test.operand))
        else:
            test = _call("_m3jax_truth", test)
        return ast.copy_location(ast.Assert(test=test, msg=node.msg), node)

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else None
        if name in _UNITTEST_COMPARES and len(node.args) >= 2:
            verdict = _call("_m3jax_compare", node.args[0], ast.Constant(_UNITTEST_COMPARES[name]), node.args[1])
            f = ast.Attribute(value=f.value, attr="assertTrue", ctx=ast.Load())
            return ast.copy_location(ast.Call(func=f, args=[verdict, *node.args[2:]], keywords=node.keywords), node)
        if name in ("assertTrue", "assertFalse") and node.args:
            first = _call("_m3jax_truth", _Comparisons().visit(node.args[0]))
            return ast.copy_location(ast.Call(func=f, args=[first, *node.args[1:]], keywords=node.keywords), node)
        return node


class _Comparisons(ast.NodeTransformer):
    def visit_Compare(self, node: ast.Compare) -> ast.Call:
        self.generic_visit(node)
        ops = [type(op).__name__ for op in node.ops]
        if len(ops) == 1:
            return ast.copy_location(_call("_m3jax_compare", node.left, ast.Constant(ops[0]),
                                           node.comparators[0]), node)
        no_args = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
        steps = [ast.Tuple(elts=[ast.Constant(op), ast.Lambda(args=no_args, body=right)], ctx=ast.Load())
                 for op, right in zip(ops, node.comparators)]
        return ast.copy_location(_call("_m3jax_chain", node.left, *steps), node)
