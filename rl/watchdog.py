"""`HangWatchdog` (`run.hang_timeout_minutes`, `run.start_timeout_minutes`): a step (or the start) that has not
finished in time is taken as hung, and the process exits so that the job can be restarted.

A job of many hosts hangs rather than fails in several ways: a collective whose peer is stuck (not dead: jax's
heartbeat ends the job only when a process dies), an engine that never answers, a filesystem that stopped
responding. The job then holds its allocation doing nothing until its time limit. PyTorch's NCCL watchdog aborts a
collective after a timeout (10 minutes by default) for the same reason; a JAX program blocked in one cannot be
interrupted from Python, so here a thread watches the step as a whole. When the limit passes it writes every thread's
stack into run.log (where the step was stuck), prints one line, and ends the process with status 124 (`timeout`'s)
without waiting for anything, since whatever hung would hold a clean exit too. An unfinished checkpoint save it cuts
off is deleted by the next run, which resumes from the last complete one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

HUNG_STATUS = 124

log = logging.getLogger(__name__)


class HangWatchdog:
    """`arm(what)` starts the clock on `what` ("step 12"); the next `arm` or `disarm` stops it. `on_hang(what,
    seconds)` runs on the watchdog's thread once `what` has taken `minutes`: by default `exit_hung`. minutes None or
    0: it watches nothing and starts no thread."""

    def __init__(self, minutes: float | None, *, on_hang=None, resume_hint: str = "",
                 setting: str = "run.hang_timeout_minutes"):
        self.limit = 60.0 * minutes if minutes else None
        self.on_hang = on_hang or (lambda what, seconds: exit_hung(what, seconds, resume_hint, setting))
        self._cv = threading.Condition()
        self._what = self._deadline = None
        self._closed = False
        self._thread = None

    def arm(self, what: str) -> None:
        if self.limit is None:
            return
        with self._cv:
            self._what, self._deadline = what, time.monotonic() + self.limit
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
                self._thread.start()
            self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._what = self._deadline = None
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        with self._cv:
            while True:
                if self._closed:
                    return
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                what, self._what, self._deadline = self._what, None, None
                break
        self.on_hang(what, self.limit)


def thread_stacks() -> str:
    """Every thread's stack, innermost call last, as a traceback prints it."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def exit_hung(what: str, seconds: float, resume_hint: str = "", setting: str = "run.hang_timeout_minutes") -> None:
    """The stacks into run.log (DEBUG), one line on the terminal, then `os._exit(HUNG_STATUS)`."""
    log.debug("the threads' stacks when %s was taken as hung:\n%s", what, thread_stacks())
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - a handler that cannot flush must not keep the process alive
            pass
    print(f"error: {what} has not finished after {seconds / 60:g} min ({setting}): taken as hung, "
          f"the process exits (status {HUNG_STATUS}); the threads' stacks are in its run log{resume_hint}",
          file=sys.stderr, flush=True)
    try:  # the rerun the line promises must find the run directory unlocked, on whatever node it lands
        from rl.run_lock import release_held
        release_held()
    except Exception:  # noqa: BLE001 - nothing may keep a hung process alive
        pass
    os._exit(HUNG_STATUS)
