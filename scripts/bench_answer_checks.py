"""What checking every row's answer at load costs (rl.answer_checks, the code rewards' `check_answer`): per row, for
assert-style test code and for JSON input / output specs, side by side in one run.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_answer_checks.py [--rows 20000]
"""

import argparse
import json
import time

from rl.answer_checks import check_answers
from rl.data import records_from_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20000)
    n = parser.parse_args().rows
    specs = {
        "assert-style (8 test functions)": "from solution import f\n\n" + "".join(
            f"def test_f{i}():\n    assert f({i}) == {i}\n\n" for i in range(8)),
        "JSON input / output (20 cases)": json.dumps({"inputs": [f"{i}\n" for i in range(20)],
                                                      "outputs": [f"{i}\n" for i in range(20)]}),
    }
    times = {}
    for name, spec in specs.items():
        records = records_from_rows([{"problem": "p", "test": spec}] * n, answer_key="test")
        start = time.perf_counter()
        check_answers(records, ["code_tests"], "bench", "data.answer_key")
        times[name] = (time.perf_counter() - start) / n
        print(f"{name}: {times[name] * 1e3:.3f} ms a row ({times[name] * n:.2f} s for {n} rows)")
    first, second = times.values()
    print(f"ratio: {first / second:.1f}x")


if __name__ == "__main__":
    main()
