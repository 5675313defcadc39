"""Running one reward over a batch in the caller's process: ``"inline"`` and ``"thread"`` modes,
plus ``run_reward``, which dispatches to the mode asked for (``"process"``: rl.rewards.pool).

See rl.rewards.registry for what each mode is for and what it costs.

``inline``: in the calling thread; an evaluation that took longer than ``timeout_s`` is discarded
(0, counted) but cannot be interrupted.

``thread``: samples run one after another in worker threads ("lanes") while the caller watches the
clock; a lane whose sample passes its limit is abandoned (it is a daemon thread that exits when its
call returns) and a fresh lane carries on with the next sample.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import queue
import threading
import time

from rl.rewards.outcome import Outcome, call_reward
from rl.rewards.pool import run_in_pool

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
    def __init__(self, fn, items, kws, pending: collections.deque, results: queue.SimpleQueue):
        super().__init__(daemon=True, name="reward-lane")
        self.fn, self.items, self.kws, self.pending, self.results = fn, items, kws, pending, results
        self.lock = threading.Lock()
        self.current: tuple[int, float] | None = None
        self.abandoned = False
        self.finished = False

    def run(self) -> None:
        try:
            while True:
                with self.lock:
                    if self.abandoned:
                        return
                    try:
                        i = self.pending.popleft()
                    except IndexError:
                        return
                    self.current = (i, time.monotonic())
                completion, answer = self.items[i]
                ok, res = call_reward(self.fn, completion, answer, self.kws[i], in_caller=False)
                with self.lock:
                    if self.abandoned:  # the supervisor already scored sample i as timed out
                        return
                    self.current = None
                    self.results.put((i, ok, res))
        except BaseException:  # nothing may escape a lane; unfinished samples are failed by the supervisor
            pass
        finally:
            self.finished = True
            self.results.put(None)  # wake the supervisor


def _drain(results: queue.SimpleQueue, out: Outcome) -> None:
    while True:
        try:
            msg = results.get_nowait()
        except queue.Empty:
            return
        if msg is not None:
            out.settle(*msg)


def run_threads(fn, items, kws, timeout_s, deadline, num_lanes, out: Outcome) -> None:
    global _abandoned_threads
    pending = collections.deque(range(len(items)))
    results: queue.SimpleQueue = queue.SimpleQueue()
    lanes: list[_Lane] = []

    def start_lane():
        lane = _Lane(fn, items, kws, pending, results)
        lanes.append(lane)
        lane.start()

    for _ in range(max(1, min(num_lanes, len(items)))):
        start_lane()
    try:
        while not out.done.all():
            now = time.monotonic()
            wake = [c[1] + timeout_s for lane in lanes if (c := lane.current) is not None] if timeout_s else []
            if deadline is not None:
                wake.append(deadline)
            wait = max(0.0, min(wake) - now) if wake else 1.0
            try:
                msg = results.get(timeout=wait + 1e-4)
                if msg is not None:
                    out.settle(*msg)
            except queue.Empty:
                pass
            _drain(results, out)  # whatever else is ready, before looking at the clock
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                out.fail_rest("batch time limit reached")
                break
            for lane in list(lanes):
                cur = lane.current
                if cur is None or timeout_s is None or now - cur[1] <= timeout_s:
                    continue
                with lane.lock:
                    if lane.current is not cur:
                        continue  # it finished in the meantime; its result is in the queue
                    lane.abandoned = True
                out.fail(cur[0], f"timed out after {timeout_s} s", timeout=True)
                lanes.remove(lane)
                _abandoned_threads += 1
                if pending:
                    start_lane()
            if not pending and all(lane.finished for lane in lanes):
                # every live lane has exited, so all of their results are queued: collect them; anything
                # still unscored was lost (cannot normally happen) and counts as failed
                _drain(results, out)
                out.fail_rest("reward lane exited unexpectedly")
                break
    finally:
        for lane in lanes:
            with lane.lock:
                lane.abandoned = True
        pending.clear()


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
        workers = num_workers or max(1, min(os.cpu_count() or 1, 8, len(items)))
        run_in_pool(fn_bytes, items, kws, timeout_s, deadline, workers, out)
