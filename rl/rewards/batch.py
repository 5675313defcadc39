"""The ``"batch"`` reward mode: one call scores many samples.

A batch reward is ``fn(completions: list[str], answers: list[str], **kw) -> Sequence[float]`` with one value per
sample, in order. The per-sample keywords reach it as lists, one entry per sample (``truncated``, and ``prompt`` /
``meta`` where its signature names them); the config entry's ``args`` and ``timeout_s`` come once, as values.
What it is for: a reward model or a judge behind a service that batches requests, where one request per sample
(the other modes) would waste the service's batching.

Failures, as in the other modes, score 0 and are counted, and never stop the run:

* the call raises, returns something that is not a sequence of n values, or runs past ``timeout_s`` (which bounds
  the whole call here, not one sample): every sample of that call fails;
* one value that is not a finite number (``None`` included: a reward model may give up on one sample): that
  sample fails.

With ``workers`` = w > 1 the batch is cut into w contiguous chunks of nearly equal size, called at once (one thread
each), for a service with several replicas. A call past its limit is abandoned (a daemon thread, as in thread mode:
Python cannot stop it) and its samples score 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rl.rewards.calls import context_value, named_keywords
from rl.rewards.outcome import Outcome, check_value

def batch_kwargs(fn, n: int, sample_kwargs: Sequence[Mapping[str, Any]] | None,
                 sample_context: Sequence[Mapping[str, Any]] | None, call_kwargs: Mapping[str, Any] | None,
                 timeout_s: float | None) -> tuple[dict[str, list], dict[str, Any]]:
    """(per-sample keywords as lists over the n samples, keywords given once) of a batch call. Per sample: each key
    of ``sample_kwargs`` (every sample must give the same keys) and the keys of ``sample_context`` that ``fn``
    names. Once: ``call_kwargs`` (a config entry's args), and ``timeout_s`` where it is named."""
    per_sample: dict[str, list] = {}
    if sample_kwargs is not None and n:
        keys = set(sample_kwargs[0])
        odd = next((i for i, s in enumerate(sample_kwargs) if set(s) != keys), None)
        if odd is not None:
            raise ValueError(f"a batch reward takes each sample keyword as one list: sample_kwargs[{odd}] has keys "
                             f"{sorted(sample_kwargs[odd])}, sample_kwargs[0] {sorted(keys)}; expected the same keys")
        per_sample.update((k, [s[k] for s in sample_kwargs]) for k in sorted(keys))
    named = named_keywords(fn)
    if sample_context is not None:
        per_sample.update((k, [context_value(fn, k, c.get(k)) for c in sample_context]) for k in ("prompt", "meta")
                          if k in named)
    once = dict(call_kwargs or {})
    clash = sorted(set(once) & set(per_sample))
    if clash:
        raise ValueError(f"keywords {clash} given both per sample and for every call; expected each in one place")
    if "timeout_s" in named and timeout_s is not None:
        once.setdefault("timeout_s", timeout_s)
    return per_sample, once


def chunk_bounds(n: int, calls: int) -> list[tuple[int, int]]:
    """[start, stop) of `calls` contiguous chunks of n samples, sizes differing by at most one, none empty."""
    calls = max(1, min(calls, n))
    edges = np.linspace(0, n, calls + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


class _Call(threading.Thread):
    def __init__(self, fn, args: tuple, kw: dict):
        super().__init__(daemon=True, name="reward-batch-call")
        self.fn, self.args, self.kw = fn, args, kw
        self.result: tuple[bool, Any] | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.result = (True, self.fn(*self.args, **self.kw))
        except BaseException as e:  # nothing may escape; the caller fails the chunk with the reason
            self.result = (False, f"{type(e).__name__}: {e}"[:500])
        finally:
            self.done.set()


def _settle(out: Outcome, start: int, stop: int, result: tuple[bool, Any]) -> None:
    ok, res = result
    n = stop - start
    if ok and (isinstance(res, (str, bytes, Mapping)) or not hasattr(res, "__len__")):
        ok, res = False, f"returned {type(res).__name__}, expected a sequence of {n} floats"
    elif ok and len(res) != n:
        ok, res = False, f"returned {len(res)} values for {n} samples"
    if not ok:
        for i in range(start, stop):
            out.fail(i, res)
        return
    for i, value in zip(range(start, stop), list(res)):
        out.settle(i, *check_value(value))


def run_batch(fn, items, per_sample: Mapping[str, list], once: Mapping[str, Any], timeout_s: float | None,
              deadline: float | None, calls: int, out: Outcome) -> None:
    """Score ``items`` ((completion, answer) pairs) with batch reward ``fn`` into ``out``: ``calls`` chunk calls at
    once, each given its samples' slice of ``per_sample`` and all of ``once``, each bounded by ``timeout_s`` and all
    by ``deadline`` (time.monotonic())."""
    started = time.monotonic()
    workers = []
    for start, stop in chunk_bounds(len(items), calls):
        chunk_kw = {**{k: v[start:stop] for k, v in per_sample.items()}, **once}
        args = ([c for c, _ in items[start:stop]], [a for _, a in items[start:stop]])
        call = _Call(fn, args, chunk_kw)
        call.start()
        workers.append((start, stop, call))
    limits = [t for t in ((started + timeout_s) if timeout_s is not None else None, deadline) if t is not None]
    end = min(limits) if limits else None
    for start, stop, call in workers:
        call.done.wait(None if end is None else max(0.0, end - time.monotonic()))
        if call.result is None:
            why = "batch time limit reached" if deadline is not None and end == deadline else \
                f"the call timed out after {timeout_s} s"
            for i in range(start, stop):
                out.fail(i, why, timeout=True)
        else:
            _settle(out, start, stop, call.result)
