"""What guarding a code test's assertions costs (rl.rewards.code_asserts): the same assert run as written and
guarded, side by side in one process, on the largest values a test compares (best of 3 each).

    PYTHONPATH=. python scripts/bench_code_asserts.py
"""

import time

from rl.rewards.code_asserts import guard_comparisons

PROGRAM = "def f(n):\n    return list(range(n))\n\ndef g(n):\n    return [list(range(1000)) for _ in range(n)]\n"
TESTS = ("assert f(10**6) == list(range(10**6))",
         "assert g(1000) == [list(range(1000))] * 1000",
         "assert [str(v) for v in f(10**5)] == [str(v) for v in range(10**5)]")


def best_of(code: str, namespace: dict, repeats: int = 3) -> float:
    compiled = compile(code, "<tests>", "exec")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        exec(compiled, namespace)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    namespace: dict = {}
    exec(compile(PROGRAM, "main.py", "exec"), namespace)
    for test in TESTS:
        plain, guarded = best_of(test, namespace), best_of(guard_comparisons(test), namespace)
        print(f"{test}: as written {plain:.3f} s, guarded {guarded:.3f} s ({guarded / plain:.2f}x)")


if __name__ == "__main__":
    main()
