"""A work queue with deadlines: items cut into chunks, handed to replaceable workers, answered per item.

One scheduling idea sits under three places, and this module is its single implementation:

* rl.generation.vllm_pool: rollout rows to vLLM engines (Ray actors);
* rl.rewards.pool: reward samples to worker processes;
* rl.rewards.runners (thread mode): reward samples to worker threads ("lanes").

The idea, as `ChunkQueue` implements it:

* items 0..n-1 wait in a queue of chunks; an idle worker takes the next chunk (its *lease*); a worker
  holds at most one lease;
* a lease has a deadline (`limit_s` after it was taken); every answered item restarts the clock, so
  a chunk answered item by item gives each item its own limit and a chunk answered at once has one;
* results are kept per item, and the first answer wins (a second answer changes nothing; a lost
  worker's late answer still counts if nobody answered first);
* a worker that dies or passes its deadline is *lost*: the unanswered items of its lease go back to
  the front of the queue, in one chunk, for another worker - except that with a `fallback` the item
  it was working on (the first unanswered one) is settled with the fallback instead of re-sent;
* the run is finished when every item has a result; `ordered()` refuses an incomplete run.

What differs between the three is policy, passed in, not mechanism:

* re-send vs fallback. A vLLM engine generates its chunk as one batch, so no row is to blame for a
  death or hang; each row carries its own sampling seed, so re-sending all of them is exact (no
  fallback). A reward worker scores its chunk one sample at a time, so the sample it was on is the
  likely culprit (an expression that hangs one worker hangs the next), and it scores 0 (fallback)
  while the untouched rest is re-sent. Thread lanes likewise, with nothing left to re-send.
* the first limit: a reward worker's first import of the reward gets `LOAD_TIMEOUT_S` (`take`'s
  `limit_s`); after it reports ready (`touch`) each sample gets the per-sample limit.
* a batch deadline (`deadline`): past it the reward runners give every unsettled item a fallback;
  the vLLM pool has none.
* chunk size: the pool cuts rows so each engine gets about `chunks_per_engine` chunks; the reward
  pool uses up to 64 samples; thread lanes take one sample at a time.

What stays with each adapter: which workers exist (the queue knows a worker only by the key it is
given, so vLLM engines may drop out and rejoin mid-rollout), creating, killing or abandoning them,
sending chunks, and waiting (ray.wait, multiprocessing.connection.wait, a queue) for at most
`wait_s()`. This module does no I/O and never waits. Every method holds one lock, so in-process workers (thread lanes) may take
and answer for themselves while a supervisor thread watches the clock; `lose(..., if_late=True)`
makes "still late? then lose it" one step, so a lane that answered just in time keeps its next item.

Not here: the reward ``inline`` mode (no workers: one stopwatch in the caller's thread) and
``VLLMPool.score`` (every engine scores every row, to compare engines: a broadcast, not a queue).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["RESEND", "ChunkQueue", "Incomplete", "Loss"]

RESEND = object()  # lose()'s default fallback: re-send every unanswered item of the lease
_OWN_LIMIT = object()  # take()'s default: the queue's own limit_s


class Incomplete(RuntimeError):
    """Some items have no result."""

    def __init__(self, missing: list[int]):
        super().__init__(f"items {missing} missing")
        self.missing = missing


@dataclasses.dataclass(eq=False, slots=True)
class _Lease:
    items: collections.deque  # taken and not yet answered, in the order the worker runs them
    deadline: float | None


@dataclasses.dataclass(frozen=True)
class Loss:
    """What `lose` did with a lost worker's lease."""

    worker: Hashable
    settled: int | None  # the item given the fallback (None when everything was re-sent)
    requeued: list[int]  # the items that went back to the queue


class ChunkQueue:
    """Items 0..n-1 in chunks of `chunk_size`, leased to workers (any hashable key) with deadlines.

    `limit_s` is the time a lease may go without an answer (None: no limit); `deadline` the clock time
    (of `clock`) at which the whole run is overdue (None: never).
    """

    def __init__(self, n: int, chunk_size: int, limit_s: float | None, *, deadline: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        size = max(1, int(chunk_size))
        self.n, self.limit_s, self.deadline, self.clock = n, limit_s, deadline, clock
        self.pending: collections.deque[list[int]] = collections.deque(
            list(range(i, min(i + size, n))) for i in range(0, n, size))
        self.results: dict[int, Any] = {}
        self._leases: dict[Hashable, _Lease] = {}
        self._closed = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ state
    @property
    def finished(self) -> bool:
        return len(self.results) >= self.n

    def busy(self, worker: Hashable) -> bool:
        return worker in self._leases

    def busy_workers(self) -> list:
        with self._lock:
            return list(self._leases)

    def missing(self) -> list[int]:
        with self._lock:
            return [i for i in range(self.n) if i not in self.results]

    def ordered(self) -> list:
        """The results in item order; `Incomplete` if any item has none."""
        missing = self.missing()
        if missing:
            raise Incomplete(missing)
        return [self.results[i] for i in range(self.n)]

    # --------------------------------------------------------------------------------- dispatch
    def take(self, worker: Hashable, limit_s: float | None | object = _OWN_LIMIT) -> list[int]:
        """The next chunk for an idle `worker` (empty when it is busy, the queue is empty or the run is
        closed). `limit_s` overrides the queue's limit for this first stretch (e.g. a load time)."""
        with self._lock:
            if self._closed or worker in self._leases:
                return []
            while self.pending:
                chunk = [i for i in self.pending.popleft() if i not in self.results]  # settled meanwhile
                if chunk:
                    limit = self.limit_s if limit_s is _OWN_LIMIT else limit_s
                    self._leases[worker] = _Lease(collections.deque(chunk), self._after(limit))
                    return chunk
            return []

    def touch(self, worker: Hashable) -> None:
        """Restart `worker`'s clock with the queue's own limit (e.g. it has finished loading)."""
        with self._lock:
            lease = self._leases.get(worker)
            if lease is not None:
                lease.deadline = self._after(self.limit_s)

    def answer(self, worker: Hashable, item: int, value: Any) -> bool:
        """Record `item`'s result; True if it is the first (a run that is closed records nothing).
        The item leaves `worker`'s lease, whose clock restarts; an empty lease frees the worker."""
        with self._lock:
            lease = self._leases.get(worker)
            if lease is not None and item in lease.items:
                lease.items.remove(item)
                if lease.items:
                    lease.deadline = self._after(self.limit_s)
                else:
                    del self._leases[worker]
            if self._closed or item in self.results:
                return False
            self.results[item] = value
            return True

    # --------------------------------------------------------------------------------- failures
    def late(self, now: float | None = None) -> list:
        """Workers whose lease is past its deadline."""
        now = self.clock() if now is None else now
        with self._lock:
            return [w for w, lease in self._leases.items() if lease.deadline is not None and now > lease.deadline]

    def lose(self, worker: Hashable, fallback: Any = RESEND, *, if_late: bool = False) -> Loss | None:
        """`worker` died or hung: end its lease. Its unanswered items go back to the front of the queue,
        except that with a `fallback` the one it was working on is settled with it (unless answered).
        None if it held no lease, or (`if_late`) if its lease is not past its deadline any more."""
        with self._lock:
            lease = self._leases.get(worker)
            if lease is None or (if_late and (lease.deadline is None or self.clock() <= lease.deadline)):
                return None
            del self._leases[worker]
            items = [i for i in lease.items if i not in self.results]
            settled = None
            if fallback is not RESEND and items and not self._closed:
                settled = items.pop(0)
                self.results[settled] = fallback
            if items:
                self.pending.appendleft(items)
            return Loss(worker, settled, items)

    def wait_s(self, cap: float | None = None, now: float | None = None) -> float | None:
        """Seconds until the next deadline (a lease's or the run's; 0 if one has passed), at most `cap`;
        None when there is neither a deadline nor a cap (wait for an answer however long it takes)."""
        now = self.clock() if now is None else now
        with self._lock:
            ends = [lease.deadline - now for lease in self._leases.values() if lease.deadline is not None]
        if self.deadline is not None:
            ends.append(self.deadline - now)
        if cap is not None:
            ends.append(cap)
        return max(0.0, min(ends)) if ends else None

    def overdue(self, now: float | None = None) -> bool:
        """The run's own deadline has passed."""
        return self.deadline is not None and (self.clock() if now is None else now) >= self.deadline

    def close(self) -> None:
        """Stop the run: no more chunks are handed out and no answer is recorded."""
        with self._lock:
            self._closed = True
            self.pending.clear()

    def _after(self, limit_s: float | None) -> float | None:
        return None if limit_s is None else self.clock() + limit_s
