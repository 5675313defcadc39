"""``"process"`` mode: a persistent pool of reward worker processes with per-sample kill-on-timeout.

Workers are started with the ``forkserver`` method (safe next to JAX's threads; the server preloads
``rl.rewards`` and ``math_verify``). They receive samples in chunks and report each result as it is
done; a worker whose current sample passes ``timeout_s`` is killed and replaced, and the rest of its
chunk goes to the next worker. A worker's first load of a reward (and its optional ``warmup()``) is
not charged to any sample; it is bounded separately by ``LOAD_TIMEOUT_S``. The pool starts on first
use and stays up until ``shutdown_process_pool()`` or interpreter exit.

The queue, deadlines and re-sends are rl.schedule.ChunkQueue's; this module owns the processes, the
pipes and the waiting.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import pickle
import signal
import threading
from multiprocessing.connection import wait as _mp_wait
from typing import Any

from rl.rewards.outcome import Outcome, call_reward
from rl.schedule import ChunkQueue

__all__ = ["LOAD_TIMEOUT_S", "run_in_pool", "shutdown_process_pool"]

LOAD_TIMEOUT_S = 60.0  # a pool worker's first import of a reward (not charged to any sample)


def _worker_main(conn) -> None:
    """Worker loop: receive (pickled fn, items), send (index, ok, value_or_reason) per item."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    fns: dict[bytes, Any] = {}
    while True:
        try:
            fn_bytes, chunk = conn.recv()
        except (EOFError, OSError):
            return
        fn = fns.get(fn_bytes)
        if fn is None:
            try:
                fn = pickle.loads(fn_bytes)  # imports the reward's module on first use
                warmup = getattr(fn, "warmup", None)
                if callable(warmup):
                    warmup()
                fns[fn_bytes] = fn
            except BaseException as e:
                conn.send(("ready",))
                for i, *_ in chunk:
                    conn.send((i, False, f"cannot load the reward in the worker: {type(e).__name__}: {e}"[:500]))
                continue
        conn.send(("ready",))  # loading is not charged to the first sample's time limit
        for i, completion, answer, kw in chunk:
            conn.send((i, *call_reward(fn, completion, answer, kw, in_caller=False)))


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="reward-worker")
        self.proc.start()
        child.close()
        self.loading = False  # chunk sent, reward not yet loaded (limit: LOAD_TIMEOUT_S)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(timeout=5)
        except Exception:
            pass
        try:
            self.conn.close()
        except Exception:
            pass


class _ProcessPool:
    def __init__(self):
        self.lock = threading.Lock()
        self.workers: list[_Worker] = []
        self._ctx = None

    def ctx(self):
        if self._ctx is None:
            method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
            self._ctx = mp.get_context(method)
            if method == "forkserver":
                # Imported once in the fork server, so every (re)started worker is ready at once.
                self._ctx.set_forkserver_preload(["rl.rewards", "math_verify"])
        return self._ctx

    def shutdown(self) -> None:
        with self.lock:
            for w in self.workers:
                w.kill()
            self.workers.clear()

    def run(self, fn_bytes, items, kws, timeout_s, deadline, num_workers, out: Outcome) -> None:
        n = len(items)
        with self.lock:
            for w in self.workers:
                if not w.proc.is_alive():
                    w.kill()  # reap it and close its pipe
            self.workers = [w for w in self.workers if w.proc.is_alive()]
            while len(self.workers) < num_workers:
                self.workers.append(_Worker(self.ctx()))
            # Values: (ok, value_or_reason, timed_out). A lost worker's current sample scores 0 (it is the
            # likely reason the worker hung or died); the rest of its chunk is re-sent.
            work = ChunkQueue(n, min(64, n // (4 * num_workers)), timeout_s, deadline=deadline)
            try:
                reason = self._run(fn_bytes, items, kws, timeout_s, self.workers[:num_workers], work)
            except BaseException:
                # Interrupted (Ctrl-C) with work in flight: those workers would later answer samples of
                # this batch into the next one, so they go.
                for w in work.busy_workers():
                    w.kill()
                    self.workers.remove(w)
                raise
        out.update(work.results)
        out.fail_rest(reason)

    def _run(self, fn_bytes, items, kws, timeout_s, workers: list[_Worker], work: ChunkQueue) -> str:
        """Drive `work` to the end; returns the reason for samples left without a result."""

        def feed(w: _Worker) -> None:
            idx = work.take(w, max(LOAD_TIMEOUT_S, timeout_s or 0.0))  # loading is not charged to a sample
            if not idx:
                return
            payload = [(i, items[i][0], items[i][1], kws[i]) for i in idx]
            try:
                w.conn.send((fn_bytes, payload))
            except Exception as e:  # e.g. unpicklable kwargs: fail those samples, keep going
                for i in idx:
                    work.answer(w, i, (False, f"cannot send to the worker: {type(e).__name__}: {e}", False))
                return
            w.loading = True

        def replace(w: _Worker, reason: str, *, timeout: bool) -> _Worker:
            work.lose(w, (False, reason, timeout))
            w.kill()
            fresh = _Worker(self.ctx())
            self.workers[self.workers.index(w)] = fresh
            workers[workers.index(w)] = fresh
            return fresh

        for w in workers:
            feed(w)
        while not work.finished:
            busy = [w for w in workers if work.busy(w)]
            if not busy:
                if not work.pending:
                    return "lost by the worker pool"  # cannot happen: every sample is queued, leased or settled
                for w in workers:
                    feed(w)
                continue
            ready = _mp_wait([w.conn for w in busy], timeout=work.wait_s())
            for w in busy:
                if w.conn not in ready:
                    continue
                try:
                    while w.conn.poll():
                        msg = w.conn.recv()
                        work.touch(w)  # any message restarts its clock with the per-sample limit
                        if len(msg) == 1:  # ("ready",)
                            w.loading = False
                            continue
                        i, ok, res = msg
                        work.answer(w, i, (ok, res, False))
                except (EOFError, OSError):
                    replace(w, "the reward worker process died", timeout=False)
                    continue
                feed(w)
            if work.overdue():
                for w in work.busy_workers():
                    replace(w, "batch time limit reached", timeout=True)
                return "batch time limit reached"
            for w in work.late():
                if w.conn.poll():
                    continue  # it answered just now: read that first
                why = (f"loading the reward took over {max(LOAD_TIMEOUT_S, timeout_s or 0.0)} s" if w.loading
                       else f"timed out after {timeout_s} s")
                feed(replace(w, why + " (worker killed)", timeout=True))
            for w in workers:
                feed(w)
        return "lost by the worker pool"


_POOL = _ProcessPool()
atexit.register(_POOL.shutdown)


def shutdown_process_pool() -> None:
    """Stop the reward worker processes (they also stop at interpreter exit)."""
    _POOL.shutdown()


def run_in_pool(fn_bytes, items, kws, timeout_s, deadline, num_workers, out: Outcome) -> None:
    """Score ``items`` with the pickled reward ``fn_bytes`` on ``num_workers`` pool processes into ``out``."""
    _POOL.run(fn_bytes, items, kws, timeout_s, deadline, num_workers, out)
