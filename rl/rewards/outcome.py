"""Evaluation of one (sample, reward) pair and the per-batch result record, shared by every run mode.

``call_reward`` never raises for the reward's own failures (exceptions, non-float or non-finite
results): it returns ``(True, value)`` or ``(False, reason)``. ``Outcome`` collects one reward's
per-sample values over a batch; the first verdict for a sample wins, later ones are ignored.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


def call_reward(fn: Callable[..., float], completion: str, answer: str, kw: Mapping[str, Any], *,
          in_caller: bool = True) -> tuple[bool, float | str]:
    """(True, value) or (False, reason). Never raises, except KeyboardInterrupt / SystemExit when
    running in the caller's own thread (``in_caller``), where they are the user's, not the reward's."""
    try:
        out = fn(completion, answer, **kw)
    except (KeyboardInterrupt, SystemExit) as e:
        if in_caller:
            raise
        return False, f"{type(e).__name__}: {e}"[:500]
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        return False, f"{type(e).__name__}: {e}"[:500]
    return check_value(out)


# The largest reward value taken. Rewards are summed, weighted (|weight| <= rl.config's 1e6), into float32: 1e39
# became inf there and every advantage of its group NaN; a Python int past float's range raised out of the step.
MAX_ABS_REWARD = 1e30


def check_value(out) -> tuple[bool, float | str]:
    """(True, float) for a finite number of magnitude <= MAX_ABS_REWARD (bool and numpy scalars are numbers), else
    (False, reason): float() alone took the string "0.75" and a one-element array."""
    if not isinstance(out, (numbers.Real, np.bool_)):
        return False, f"returned {type(out).__name__}, expected a float"
    try:
        value = float(out)
    except (OverflowError, TypeError, ValueError) as e:  # an int past float's range (str() of it can raise too)
        return False, f"returned {type(out).__name__}, not a float ({e})"
    if not math.isfinite(value):
        return False, f"returned {value}"
    if abs(value) > MAX_ABS_REWARD:
        return False, f"returned {value:g}, beyond +-{MAX_ABS_REWARD:g} (rewards are summed in float32)"
    return True, value


class Outcome:
    """Per-sample results of one reward over one batch."""

    def __init__(self, n: int):
        self.values = np.zeros(n, dtype=np.float64)
        self.done = np.zeros(n, dtype=bool)
        self.failed = np.zeros(n, dtype=bool)
        self.timeouts = 0
        self.errors: list[str] = []

    def ok(self, i: int, value: float) -> None:
        if not self.done[i]:
            self.values[i], self.done[i] = value, True

    def fail(self, i: int, reason: str, *, timeout: bool = False) -> None:
        if not self.done[i]:
            self.done[i] = self.failed[i] = True
            self.timeouts += timeout
            if len(self.errors) < 3:
                self.errors.append(f"sample {i}: {reason}")

    def settle(self, i: int, ok: bool, res, timeout: bool = False) -> None:
        self.ok(i, res) if ok else self.fail(i, res, timeout=timeout)

    def update(self, results: Mapping[int, tuple]) -> None:
        """Settle every sample of a worker run's results (rl.schedule.ChunkQueue.results), whose values
        are (ok, value_or_reason, timed_out)."""
        for i in sorted(results):
            self.settle(i, *results[i])

    def fail_rest(self, reason: str) -> None:
        for i in np.flatnonzero(~self.done):
            self.fail(int(i), reason, timeout=True)
