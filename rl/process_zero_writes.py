"""Process 0's own outputs in a multi-host job (metrics.jsonl, TensorBoard, W&B, the rollout files, the recorded
config): a write of theirs that fails, or their opening at the start, stops every process at the same step, with
its error.

Only process 0 writes them. A write that raised there used to end process 0 alone (its one `error:` line), while the
others went on into the next step's collectives and aborted on jax's heartbeat timeout (about 100 s) with a traceback
that did not say why. Now the exception is held on process 0 and its text announced in jax's key-value store; every
process hears of it at the step's agreement (`rl.stop_signals.StopSignals.agree`, the all-gather that already decides
each step's stop and save) and stops there, before that step's save: process 0 raises its own error (the `error:`
line it printed before), the others `OutputsFailed`, which names it. On one process a write raises at once, as before.
"""

from __future__ import annotations

import logging

import numpy as np

from sharding.mesh import key_value_client

_CAUSE = "m3jax/outputs/failed/"  # + "0": the held exception's text
log = logging.getLogger("rl.trainer")


class _NoOutputs:
    """What stands in for the run's `rl.observe.RunLogger` when process 0 could not open its outputs, until the
    first step's agreement stops the run."""

    def log(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


NO_OUTPUTS = _NoOutputs()


class OutputsFailed(RuntimeError):
    """Process 0 could not write the run's outputs; this process stops with it (str: what failed, and the resume)."""


class ProcessZeroWrites:
    """The writes process 0 alone makes into `run_dir` (`run`), and the stop of every process once one failed
    (`stop_if` at each step's agreement, `settle` at the run's end)."""

    def __init__(self, process_count: int, run_dir: str):
        self.multi, self.run_dir = process_count > 1, run_dir
        self.error: Exception | None = None  # the first failed write's, held until every process has heard of it

    @property
    def failed(self) -> bool:
        return self.error is not None

    def run(self, write, *args, **kwargs):
        """write(*args, **kwargs) -> its result. In a multi-host job an exception is held and announced (-> None), and
        every later write is skipped: the run stops at the next agreement (`stop_if`)."""
        if self.error is not None:
            return None
        try:
            return write(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - raised on every process at the agreement
            if not self.multi:
                raise
            self.error = e
            log.error("a write into the run directory failed (%s: %s); every process stops at the end of this step",
                      type(e).__name__, e)
            try:  # the others name the cause; the agreement stops them whether it arrives or not
                key_value_client().key_value_set(f"{_CAUSE}0", f"{type(e).__name__}: {e}", allow_overwrite=True)
            except Exception:  # noqa: BLE001 - no joined job's store, or it failed: the others say where to look
                log.debug("the cause of the failed write was not put in the key-value store", exc_info=True)
            return None

    def stop_if(self, failed_anywhere: bool, step: int, where: str = ", before its save") -> None:
        """Raise once an agreement found a failed write (on every process, at the same step): this process's own
        exception, else OutputsFailed."""
        if self.error is not None:
            raise self.error
        if failed_anywhere:
            try:
                cause = next(iter(dict(key_value_client().key_value_dir_get(_CAUSE)).values()))
            except Exception:  # noqa: BLE001 - not announced (see run): process 0's own log has it
                cause = "process 0's run.log says why"
            raise OutputsFailed(f"process 0 could not write the run's outputs into {self.run_dir} ({cause}); every "
                                f"process stopped at step {step}{where}: rerunning the command resumes from the last "
                                "checkpoint")

    def settle(self, step: int) -> None:
        """The run's end, where no agreement follows the last step's metrics row: one all-gather of the flag."""
        if not self.multi:
            return
        from jax.experimental import multihost_utils
        flags = np.asarray(multihost_utils.process_allgather(np.asarray([self.failed], np.int32)))
        self.stop_if(bool(flags.any()), step, " (the run's end)")
