"""Reward registry and time-limited batch scoring.

A reward is ``fn(completion_text: str, answer: str, **kw) -> float``. ``register_reward(name)`` files
it under a name (several names may share a function); ``get_reward(name)`` finds it again.

``score_batch`` evaluates weighted rewards over a batch. Each (sample, reward) evaluation that raises,
returns a non-float / non-finite value, or runs past ``timeout_s`` scores 0 and is counted in
``failures``; the call itself neither raises for them nor waits past the limits.

How a reward runs (its ``mode``, chosen at registration, overridable per call):

``"inline"``
    In the calling thread, no supervision beyond a stopwatch: an evaluation that took longer than
    ``timeout_s`` is still discarded (0, counted), but cannot be interrupted. For the built-in
    rewards whose run time is bounded by construction (linear scans: ``format``, the digit rewards);
    256 digit samples score in well under a millisecond.
``"thread"`` (the default for anything registered without a mode, and for bare callables)
    Samples run one after another in a worker thread ("lane"; ``num_workers`` lanes) while the caller
    watches the clock. A sample past its limit scores 0; its lane is abandoned (Python cannot kill a
    thread; it is a daemon that exits when its call returns) and a fresh lane carries on with the
    next sample, so the batch finishes in about ``timeout_s`` per hung sample. Overhead is one thread
    start per lane plus a queue hand-off per sample (a few microseconds), so this suits cheap and
    I/O-bound rewards (sleeping / waiting on a socket). Its limit: an abandoned CPU-bound reward keeps
    a core (and its memory) until it returns, and one stuck inside C code holds the GIL, which stalls
    the caller too.
``"process"``
    A persistent pool of worker processes (``forkserver`` start method, so it is safe next to JAX's
    threads; the server preloads ``rl.rewards`` and ``math_verify``) receives the samples in chunks
    and reports each result as it is done; a worker whose current sample passes ``timeout_s`` is
    killed and replaced, and the rest of its chunk goes to the next worker. This is the only mode that
    can stop a computation stuck inside C code (sympy / big-integer arithmetic) and free its memory,
    and it runs samples in parallel across cores. The pool starts once (about a second) and stays up;
    a worker's first import of a reward (and the reward's optional ``warmup()``) is not charged to
    any sample (bounded separately by ``LOAD_TIMEOUT_S``). Rewards must be picklable (module-level
    functions); others fall back to thread mode with a warning. ``math_verify`` uses this mode: in a
    worker's main thread math-verify's own ``signal.alarm`` timeouts work too, so most slow
    expressions end cleanly there and the kill is the backstop.

Why not one mechanism for everything: measured on the 2-core machine, 256 digit-task samples score in
~0.7 ms inline, ~1.2 ms in a thread lane and ~4 ms through a warm process pool (plus ~1 s to start
it); a process per sample would cost several ms each. Threads cannot stop runaway sympy, and signal
timers (math-verify's own mechanism) work only in a main thread and in whole seconds, so they are used
where they work (inside pool workers, and ``math_verify`` called inline from the main thread) and
never relied on alone.

A reward function with a parameter named ``timeout_s`` receives the per-sample limit, so it can
bound its own work (``math_verify`` passes it on to math-verify).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import inspect
import logging
import math
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Union

import numpy as np

__all__ = [
    "RewardFn",
    "UnknownRewardError",
    "MODES",
    "register_reward",
    "get_reward",
    "list_rewards",
    "reward_mode",
    "RewardScores",
    "score_components",
    "score_batch",
    "shutdown_process_pool",
]

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]
MODES = ("inline", "thread", "process")
LOAD_TIMEOUT_S = 60.0  # a pool worker's first import of a reward (not charged to any sample)


@dataclasses.dataclass(frozen=True)
class _Entry:
    fn: RewardFn
    mode: str


_REGISTRY: dict[str, _Entry] = {}


class UnknownRewardError(KeyError):
    """``get_reward`` with a name nobody registered; the message lists the registered names."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


def _ident(fn) -> tuple:
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))


def register_reward(name: str, *, mode: str = "thread", replace: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: file ``fn`` under ``name`` and return it unchanged (stack it to give several names).

    ``mode`` is how ``score_batch`` runs it by default (``"inline"``, ``"thread"`` or ``"process"``,
    see the module docstring). Registering a different function under a taken name raises unless
    ``replace=True`` (re-registering the same function, e.g. on module reload, is allowed).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if mode not in MODES:
        raise ValueError(f"reward mode must be one of {MODES}, got {mode!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"register_reward({name!r}) expects a function, got {type(fn).__name__}")
        old = _REGISTRY.get(name)
        if old is not None and not replace and old.fn is not fn and _ident(old.fn) != _ident(fn):
            raise ValueError(
                f"reward {name!r} is already registered to {old.fn.__module__}.{old.fn.__qualname__}; "
                "pass replace=True to override it")
        _REGISTRY[name] = _Entry(fn, mode)
        return fn

    return decorator


def _ensure_builtins() -> None:
    # The built-in rewards register themselves on import of rl.rewards; importing it here makes
    # get_reward work even when only this module was imported.
    import rl.rewards  # noqa: F401


def get_reward(name: str) -> RewardFn:
    """The function registered as ``name``; ``UnknownRewardError`` lists the known names otherwise."""
    _ensure_builtins()
    entry = _REGISTRY.get(name)
    if entry is None:
        raise UnknownRewardError(f"unknown reward {name!r}; registered rewards: {', '.join(sorted(_REGISTRY)) or '(none)'}")
    return entry.fn


def list_rewards() -> list[str]:
    _ensure_builtins()
    return sorted(_REGISTRY)


def reward_mode(fn_or_name: str | RewardFn) -> str:
    """How ``score_batch`` runs this reward by default."""
    if isinstance(fn_or_name, str):
        get_reward(fn_or_name)
        return _REGISTRY[fn_or_name].mode
    for entry in _REGISTRY.values():
        if entry.fn is fn_or_name:
            return entry.mode
    return "thread"


# --------------------------------------------------------------------------------------------------
# Evaluation of one sample (shared by every mode)

def _call(fn: RewardFn, completion: str, answer: str, kw: Mapping[str, Any], *,
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
    try:
        value = float(out)
    except (TypeError, ValueError):
        return False, f"returned {type(out).__name__}, expected a float"
    if not math.isfinite(value):
        return False, f"returned {value}"
    return True, value


class _Outcome:
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

    def settle(self, i: int, ok: bool, res) -> None:
        self.ok(i, res) if ok else self.fail(i, res)

    def fail_rest(self, reason: str) -> None:
        for i in np.flatnonzero(~self.done):
            self.fail(int(i), reason, timeout=True)


# --------------------------------------------------------------------------------------------------
# inline

def _run_inline(fn, items, kws, timeout_s, deadline, out: _Outcome) -> None:
    for i, (completion, answer) in enumerate(items):
        if deadline is not None and time.monotonic() > deadline:
            out.fail_rest("batch time limit reached")
            return
        t0 = time.monotonic()
        ok, res = _call(fn, completion, answer, kws[i])
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
                ok, res = _call(self.fn, completion, answer, self.kws[i], in_caller=False)
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


def _drain(results: queue.SimpleQueue, out: _Outcome) -> None:
    while True:
        try:
            msg = results.get_nowait()
        except queue.Empty:
            return
        if msg is not None:
            out.settle(*msg)


def _run_threads(fn, items, kws, timeout_s, deadline, num_lanes, out: _Outcome) -> None:
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
# process pool

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
            conn.send((i, *_call(fn, completion, answer, kw, in_caller=False)))


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="reward-worker")
        self.proc.start()
        child.close()
        self.chunk: collections.deque[int] = collections.deque()  # samples sent and not yet answered
        self.started = 0.0  # when its current sample (chunk[0]) started, or its chunk was sent
        self.loading = False  # chunk sent, reward not yet loaded (limit: LOAD_TIMEOUT_S)

    def deadline(self, timeout_s: float | None) -> float | None:
        if self.loading:
            return self.started + max(LOAD_TIMEOUT_S, timeout_s or 0.0)
        return None if timeout_s is None else self.started + timeout_s

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

    def run(self, fn_bytes, items, kws, timeout_s, deadline, num_workers, out: _Outcome) -> None:
        with self.lock:
            try:
                self._run(fn_bytes, items, kws, timeout_s, deadline, num_workers, out)
            except BaseException:
                # Interrupted (Ctrl-C) with work in flight: those workers would later answer samples of
                # this batch into the next one, so they go.
                for w in self.workers:
                    if w.chunk:
                        w.kill()
                self.workers = [w for w in self.workers if not w.chunk]
                raise

    def _run(self, fn_bytes, items, kws, timeout_s, deadline, num_workers, out: _Outcome) -> None:
        n = len(items)
        for w in self.workers:
            if not w.proc.is_alive():
                w.kill()  # reap it and close its pipe
        self.workers = [w for w in self.workers if w.proc.is_alive()]
        while len(self.workers) < num_workers:
            self.workers.append(_Worker(self.ctx()))
        workers = self.workers[:num_workers]
        for w in workers:
            w.chunk.clear()
        pending = collections.deque(range(n))
        chunk_size = max(1, min(64, n // (4 * num_workers)))

        def feed(w: _Worker) -> None:
            if w.chunk or not pending:
                return
            idx = [pending.popleft() for _ in range(min(chunk_size, len(pending)))]
            payload = [(i, items[i][0], items[i][1], kws[i]) for i in idx]
            try:
                w.conn.send((fn_bytes, payload))
            except Exception as e:  # e.g. unpicklable kwargs: fail those samples, keep going
                for i in idx:
                    out.fail(i, f"cannot send to the worker: {type(e).__name__}: {e}")
                return
            w.chunk.extend(idx)
            w.started = time.monotonic()
            w.loading = True

        def replace(w: _Worker, reason: str, *, timeout: bool) -> _Worker:
            if w.chunk:
                out.fail(w.chunk.popleft(), reason, timeout=timeout)
                pending.extendleft(reversed(w.chunk))  # the rest of its chunk goes back to the queue
                w.chunk.clear()
            w.kill()
            fresh = _Worker(self.ctx())
            self.workers[self.workers.index(w)] = fresh
            workers[workers.index(w)] = fresh
            return fresh

        for w in workers:
            feed(w)
        while not out.done.all():
            busy = [w for w in workers if w.chunk]
            if not busy:
                if pending:
                    for w in workers:
                        feed(w)
                    continue
                out.fail_rest("lost by the worker pool")
                break
            now = time.monotonic()
            wake = [d for w in busy if (d := w.deadline(timeout_s)) is not None]
            if deadline is not None:
                wake.append(deadline)
            ready = _mp_wait([w.conn for w in busy], timeout=max(0.0, min(wake) - now) if wake else None)
            for w in busy:
                if w.conn not in ready:
                    continue
                try:
                    while w.conn.poll():
                        msg = w.conn.recv()
                        w.started = time.monotonic()
                        if len(msg) == 1:  # ("ready",)
                            w.loading = False
                            continue
                        i, ok, res = msg
                        if w.chunk and w.chunk[0] == i:
                            w.chunk.popleft()
                        out.settle(i, ok, res)
                except (EOFError, OSError):
                    replace(w, "the reward worker process died", timeout=False)
                    continue
                feed(w)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                for w in workers:
                    if w.chunk:
                        replace(w, "batch time limit reached", timeout=True)
                out.fail_rest("batch time limit reached")
                break
            for w in list(workers):
                d = w.deadline(timeout_s)
                if w.chunk and d is not None and now > d and not w.conn.poll():
                    why = (f"loading the reward took over {max(LOAD_TIMEOUT_S, timeout_s or 0.0)} s" if w.loading
                           else f"timed out after {timeout_s} s")
                    fresh = replace(w, why + " (worker killed)", timeout=True)
                    feed(fresh)
            for w in workers:
                feed(w)


_POOL = _ProcessPool()
atexit.register(_POOL.shutdown)


def shutdown_process_pool() -> None:
    """Stop the reward worker processes (they also stop at interpreter exit)."""
    _POOL.shutdown()


# --------------------------------------------------------------------------------------------------
# Public batch API

RewardSpec = Union[str, RewardFn]


@dataclasses.dataclass
class RewardScores:
    """``total``: weighted sum per sample; ``components``: each reward's raw values (0 where failed);
    ``failures`` / ``timeouts``: failed evaluations per reward name; ``errors``: a few example reasons."""

    total: np.ndarray
    components: dict[str, np.ndarray]
    failures: dict[str, int]
    timeouts: dict[str, int]
    errors: dict[str, list[str]]

    @property
    def num_failures(self) -> int:
        return int(sum(self.failures.values()))


def _name_of(spec: RewardSpec) -> str:
    if isinstance(spec, str):
        return spec
    for name, entry in _REGISTRY.items():
        if entry.fn is spec:
            return name
    return getattr(spec, "__name__", repr(spec))


def _wants_timeout(fn) -> bool:
    try:
        return "timeout_s" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def score_components(
    reward_fns_with_weights: Sequence[tuple[RewardSpec, float]] | Mapping[RewardSpec, float],
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    timeout_s: float | None = 5.0,
    batch_timeout_s: float | None = None,
    sample_kwargs: Sequence[Mapping[str, Any]] | None = None,
    mode: str | None = None,
    num_workers: int | None = None,
) -> RewardScores:
    """Like ``score_batch`` but with each reward's values, failures and example errors (for metrics)."""
    pairs = list(reward_fns_with_weights.items()) if isinstance(reward_fns_with_weights, Mapping) else list(reward_fns_with_weights)
    n = len(completions)
    if len(answers) != n:
        raise ValueError(f"{n} completions but {len(answers)} answers")
    if sample_kwargs is not None and len(sample_kwargs) != n:
        raise ValueError(f"{n} completions but {len(sample_kwargs)} sample_kwargs")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} or None, got {mode!r}")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
    resolved = []
    for spec, weight in pairs:  # resolve every name before running anything: a typo fails fast
        fn = get_reward(spec) if isinstance(spec, str) else spec
        if not callable(fn):
            raise TypeError(f"reward {spec!r} is not callable")
        resolved.append((_name_of(spec), fn, float(weight), mode or reward_mode(spec)))

    items = [(str(c), str(a)) for c, a in zip(completions, answers)]
    deadline = None if batch_timeout_s is None else time.monotonic() + batch_timeout_s
    total = np.zeros(n, dtype=np.float64)
    scores = RewardScores(total=total, components={}, failures={}, timeouts={}, errors={})
    for name, fn, weight, how in resolved:
        base_kw = [dict(sample_kwargs[i]) if sample_kwargs is not None else {} for i in range(n)]
        if _wants_timeout(fn) and timeout_s is not None:
            for kw in base_kw:
                kw.setdefault("timeout_s", timeout_s)
        out = _Outcome(n)
        warmup = getattr(fn, "warmup", None)
        if n and how != "process" and callable(warmup):
            warmup()  # one-time imports, so that they do not count against the first sample's limit
        if n:
            if how == "process":
                try:
                    fn_bytes = pickle.dumps(fn)
                except Exception as e:
                    logger.warning("reward %r cannot be pickled for the process pool (%s); running it in threads", name, e)
                    how = "thread"
            if how == "inline":
                _run_inline(fn, items, base_kw, timeout_s, deadline, out)
            elif how == "thread":
                _run_threads(fn, items, base_kw, timeout_s, deadline, num_workers or 1, out)
            else:
                workers = num_workers or max(1, min(os.cpu_count() or 1, 8, n))
                _POOL.run(fn_bytes, items, base_kw, timeout_s, deadline, workers, out)
        n_failed = int(out.failed.sum())
        if n_failed:
            logger.warning("reward %r: %d of %d evaluations failed (%d timed out), scored 0; e.g. %s",
                           name, n_failed, n, out.timeouts, "; ".join(out.errors))
        key = name if name not in scores.components else f"{name}#{len(scores.components)}"
        scores.components[key] = out.values.astype(np.float32)
        scores.failures[key] = n_failed
        scores.timeouts[key] = int(out.timeouts)
        scores.errors[key] = out.errors
        total += weight * out.values
    scores.total = total.astype(np.float32)
    return scores


def score_batch(
    reward_fns_with_weights: Sequence[tuple[RewardSpec, float]] | Mapping[RewardSpec, float],
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    timeout_s: float | None = 5.0,
    batch_timeout_s: float | None = None,
    sample_kwargs: Sequence[Mapping[str, Any]] | None = None,
    mode: str | None = None,
    num_workers: int | None = None,
) -> tuple[np.ndarray, int]:
    """Weighted rewards for a batch: ``(rewards float32 [n], failures)``.

    ``reward_fns_with_weights``: ``[(name_or_fn, weight), ...]`` or ``{name_or_fn: weight}``.
    ``rewards[i] = sum_k weight_k * reward_k(completions[i], answers[i], **sample_kwargs[i])``; an
    evaluation that raises, returns something that is not a finite float, or runs past ``timeout_s``
    (per sample and reward) contributes 0 and adds 1 to ``failures``. ``batch_timeout_s`` bounds the
    whole call (unfinished evaluations then count as failures). ``mode`` overrides every reward's
    registered mode; ``num_workers``: lanes (thread mode, default 1) or processes (process mode,
    default min(cores, 8)). Unknown reward names raise ``UnknownRewardError`` before anything runs.
    """
    s = score_components(reward_fns_with_weights, completions, answers, timeout_s=timeout_s,
                         batch_timeout_s=batch_timeout_s, sample_kwargs=sample_kwargs, mode=mode,
                         num_workers=num_workers)
    return s.total, s.num_failures
