"""The run's progress on the terminal (`logging.progress_bar`).

Where stderr is a terminal: a tqdm bar, redrawn in place. Where it is a file (a scheduler's job log, `2> out`): dated
lines through logging, so also in run.log. A bar redrawn with carriage returns into a file is a single line holding
every redraw of the run, which `tail`, `less` and `grep` show as one unreadable line (the tiny demo's: 33 kB).

A line is written for the first step this process trains, for every step whose row holds a new held-out evaluation,
for the last step, when the run closes on a step not shown yet (a stop by signal or deadline), and otherwise at most
once per `every_s` seconds: the 32-node recipe's train step alone is planned at 31.4 s (docs/planner.md), besides
its generation, so there every step gets its line.
"""

from __future__ import annotations

import logging
import sys
import time

from m3jax.hf.progress import redraws_in_place

LINE_EVERY_S = 30.0

log = logging.getLogger(__name__)


def open_progress(total_steps: int, first_step: int, *, stream=None, every_s: float = LINE_EVERY_S):
    """A `Bar` where `stream` (default: sys.stderr) is a terminal or a notebook's output, else `Lines`."""
    stream = sys.stderr if stream is None else stream
    if redraws_in_place(stream):
        return Bar(total_steps, first_step, stream)
    return Lines(total_steps, first_step, every_s=every_s)


class Bar:
    """tqdm's bar; the postfix shows the step's reward, tokens/s and the last held-out pass@1."""

    def __init__(self, total_steps: int, first_step: int, stream):
        from tqdm import tqdm
        self._bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True, file=stream)

    def step(self, step: int, reward: float, tokens_per_s: float, val_pass1: float | None,
             evaluated: bool = False) -> None:
        self._bar.update(1)
        val = {} if val_pass1 is None else {"val_pass1": f"{val_pass1:.3f}"}
        self._bar.set_postfix(reward=f"{reward:.3f}", tok_s=f"{tokens_per_s:.0f}", **val)

    def close(self) -> None:
        self._bar.close()


class Lines:
    """One INFO line per shown step, e.g.

        step 40/200 (20%): reward 0.170, 14143 tokens/s, held-out pass@1 0.000; elapsed 00:15, 0.09 s/step, 00:14 left

    The pace is the mean over the steps since the first this process trained (that one also compiles)."""

    def __init__(self, total_steps: int, first_step: int, *, every_s: float = LINE_EVERY_S, clock=time.monotonic):
        self.total, self.every_s, self.clock = total_steps, every_s, clock
        self.t0 = clock()
        self.first_done = None        # (step, time) of the first step this process trained
        self.last_shown_at = None     # time of the last line
        self.pending = None           # the newest step's line arguments, while not shown

    def step(self, step: int, reward: float, tokens_per_s: float, val_pass1: float | None,
             evaluated: bool = False) -> None:
        now = self.clock()
        if self.first_done is None:
            self.first_done = (step, now)
        self.pending = (step, reward, tokens_per_s, val_pass1, now)
        if (evaluated or step >= self.total or self.last_shown_at is None
                or now - self.last_shown_at >= self.every_s):
            self._show()

    def close(self) -> None:
        if self.pending is not None:
            self._show()

    def _show(self) -> None:
        from tqdm import tqdm
        step, reward, tokens_per_s, val_pass1, now = self.pending
        self.pending, self.last_shown_at = None, now
        held = "" if val_pass1 is None else f", held-out pass@1 {val_pass1:.3f}"
        pace = ""
        first_step, first_at = self.first_done
        if step > first_step:
            per_step = (now - first_at) / (step - first_step)
            pace = f", {per_step:.2f} s/step, {tqdm.format_interval(per_step * max(self.total - step, 0))} left"
        line = (f"step {step}/{self.total} ({100 * step // max(self.total, 1)}%): reward {reward:.3f}, "
                f"{tokens_per_s:.0f} tokens/s{held}; elapsed {tqdm.format_interval(now - self.t0)}{pace}")
        if log.isEnabledFor(logging.INFO) and log.hasHandlers():  # m3jax.train's: the terminal and run.log (rl.logs)
            log.info("%s", line)
        else:  # a trainer run from a script of one's own that set up no logging, where INFO is dropped
            print(line, file=sys.stderr, flush=True)
