"""Running one reward over a batch in the caller's process: ``"inline"`` and ``"thread"`` modes,
plus ``run_reward``, which dispatches to the mode asked for (``"process"``: rl.rewards.pool).

See rl.rewards.registry for what each mode is for and what it costs.

``inline``: in the calling thread; an evaluation that took longer than ``timeout_s`` is discarded
(0, counted) but cannot be interrupted.

``thread``: samples run one after another in worker threads ("lanes") while the caller watches the
clock; a lane whose sample passes its limit is abandoned (it is a daemon thread that exits when its
call returns) and a fresh lane carries on with the next sample. Lanes take their samples from an
rl.schedule.ChunkQueue (chunks of one), which also keeps the deadlines and the results.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
import time

from rl.rewards.outcome import Outcome, call_reward
from rl.rewards.pool import run_in_pool
from rl.schedule import ChunkQueue

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# inline

def run_inline(fn, items, kws, timeout_s, deadline, out: Outcome) -> None:
    for i, (completion, answer) in enumerate(items):
        if deadline is not None and time.monotonic() > deadline:
            out.fail_rest("batch time limit reached")
            return
        t0 = time.monotonic()
        ok, res = call_reward(fn, completion, answer, kws[i])
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            out.fail(i, f"took {time.monotonic() - t0:.3f} s > {timeout_s} s", timeout=True)
        else:
            out.settle(i, ok, res)


# --------------------------------------------------------------------------------------------------
# thread lanes

_abandoned_threads = 0


class _Lane(threading.Thread):
    """Takes one sample at a time from the run's queue itself (no hand-off through the supervisor)."""

    def __init__(self, fn, items, kws, work: ChunkQueue, wake: queue.SimpleQueue):
        super().__init__(daemon=True, name="reward-lane")
        self.fn, self.items, self.kws, self.work, self.wake = fn, items, kws, work, wake
        self.finished = False

    def run(self) -> None:
        try:
            while chunk := self.work.take(self):
                for i in chunk:
                    completion, answer = self.items[i]
                    ok, res = call_reward(self.fn, completion, answer, self.kws[i], in_caller=False)
                    if not self.work.answer(self, i, (ok, res, False)):
                        return  # abandoned: the supervisor already scored sample i as timed out
                    self.wake.put(None)
        except BaseException:  # nothing may escape a lane; unfinished samples are failed by the supervisor
            pass
        finally:
            self.finished = True
            self.wake.put(None)


def run_threads(fn, items, kws, timeout_s, deadline, num_lanes, out: Outcome) -> None:
    global _abandoned_threads
    # A sample past its limit scores 0 (it would hang the next lane too); its lane is abandoned.
    work = ChunkQueue(len(items), 1, timeout_s, deadline=deadline)
    wake: queue.SimpleQueue = queue.SimpleQueue()  # a lane answered or exited
    lanes: list[_Lane] = []

    def start_lane():
        lane = _Lane(fn, items, kws, work, wake)
        lanes.append(lane)
        lane.start()

    for _ in range(max(1, min(num_lanes, len(items)))):
        start_lane()
    reason = "reward lane exited unexpectedly"
    try:
        while not work.finished:
            try:
                wake.get(timeout=work.wait_s(cap=1.0) + 1e-4)
            except queue.Empty:
                pass
            if work.overdue():
                reason = "batch time limit reached"
                break
            for lane in work.late():
                # if_late: a lane that answered in the meantime keeps its next sample
                if work.lose(lane, (False, f"timed out after {timeout_s} s", True), if_late=True) is None:
                    continue
                lanes.remove(lane)
                _abandoned_threads += 1
                if work.pending:
                    start_lane()
            if all(lane.finished for lane in lanes) and not work.finished:
                break  # every lane has exited with samples unscored (cannot normally happen)
    finally:
        work.close()  # abandoned and remaining lanes stop after their current call
    out.update(work.results)
    out.fail_rest(reason)


# --------------------------------------------------------------------------------------------------
# dispatch

def run_reward(fn, how: str, name: str, items, kws, timeout_s, deadline, num_workers, out: Outcome) -> None:
    """Score ``items`` with ``fn`` in mode ``how`` into ``out``. ``name`` is only for messages.

    A reward that cannot be pickled for the process pool falls back to thread mode with a warning.
    """
    if not items:
        return
    if how == "process":
        try:
            fn_bytes = pickle.dumps(fn)
        except Exception as e:
            logger.warning("reward %r cannot be pickled for the process pool (%s); running it in threads", name, e)
            how = "thread"
    if how == "inline":
        run_inline(fn, items, kws, timeout_s, deadline, out)
    elif how == "thread":
        run_threads(fn, items, kws, timeout_s, deadline, num_workers or 1, out)
    else:
        # no more processes than samples: a worker started for nothing stays up for the rest of the run
        workers = min(num_workers or min(os.cpu_count() or 1, 8), len(items))
        run_in_pool(fn_bytes, items, kws, timeout_s, deadline, workers, out)
