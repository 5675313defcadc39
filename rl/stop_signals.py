"""`StopSignals`: SIGTERM, SIGINT and SIGUSR1 during a training run ask it to finish the step, save it and stop.

A scheduler's preemption (SIGTERM, then SIGKILL after a grace period) or a Ctrl-C used to end the process at once:
every step since the last checkpoint was lost (up to `checkpoint.every_steps - 1` of them) and an interrupt
printed a traceback. As MaxText and Levanter do on preemption, the run now saves the step it is on and stops,
and rerunning the command resumes from it. A second Ctrl-C stops at once (KeyboardInterrupt), for a step that
would take too long to finish.

SIGUSR1 is what SLURM sends ahead of a job's time limit when asked (`#SBATCH --signal=USR1@600`: ten minutes
before it), so that the step in progress can finish and save (the 32-node recipe's train step alone is planned at
31.4 s, besides its generation); at the limit itself SLURM sends SIGTERM and kills the job KillWait (30 s by
default) later. Left at Python's default, SIGUSR1 ended the process at once, losing every step since
the last checkpoint (PyTorch Lightning saves and requeues on it).

On a job of several processes a signal may reach them at different steps (or only one of them): they agree at the
end of every step (`agree`, an all-gather of a few flags), so all save the same step, as a checkpoint's collective
save needs.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import NamedTuple

import numpy as np

log = logging.getLogger("rl.trainer")

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Agreement(NamedTuple):
    stop: bool  # after this step
    save: bool  # this step
    failed: bool  # a write of process 0's outputs (rl.process_zero_writes)
    signalled: bool = False  # a process received a signal (else a stop is another wish's: the wall limit)


class StopSignals:
    """Context manager: while inside it (in the main thread), SIGNALS set `received` instead of ending
    the process; the handlers before it come back on exit. Elsewhere (another thread) it installs nothing."""

    def __init__(self):
        self.received: int | None = None  # the first signal's number
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:  # the second Ctrl-C: the user will not wait for the step
                raise KeyboardInterrupt
            return
        self.received = signum
        log.warning("%s received: the run saves at the end of this step and stops (rerunning the command resumes "
                    "from there)%s", signal.Signals(signum).name,
                    "; Ctrl-C again stops at once, losing the step" if signum == signal.SIGINT else "")

    def agree(self, stop: bool, save: bool, process_count: int = 1, failed: bool = False) -> Agreement:
        """(stop after this step, save this step, a write failed): this process's wishes (`stop` besides a signal,
        e.g. a wall limit; `save` besides a stop, e.g. a deadline) and whether its outputs failed to write
        (`rl.process_zero_writes`), or'ed over the job's processes. Clocks and signals differ between processes, and
        one that saved or stopped alone would leave the others waiting in a collective: every process calls this at
        the same point of every step (one all-gather of four flags). `signalled`: whether the stop is a signal's on
        some process, so that every process names the same cause (a wall limit crossed on one clock only made the
        others report "a stop on another process", exit status 143 beside process 0's 0)."""
        signalled = self.received is not None
        stop = stop or signalled
        if process_count == 1:
            return Agreement(stop, save or stop, failed, signalled)
        from jax.experimental import multihost_utils
        flags = np.asarray(multihost_utils.process_allgather(np.asarray([stop, save, failed, signalled], np.int32)))
        stop, save, failed, signalled = (bool(f) for f in flags.reshape(-1, 4).any(0))
        return Agreement(stop, save or stop, failed, signalled)

    @property
    def name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name
