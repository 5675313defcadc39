"""What the processes of a multi-host job agree on about checkpoints (`rl.checkpoint`): the steps a resume tries, a
flag any of them raised, and whether a save failed anywhere.

A save fails on one process only (its disk full, its mount lost): its write ends in an error there, while the
others' writes succeed and wait in orbax's barrier for it, which never comes (20 minutes, orbax's deadline). Each
process went on training, and a two-host job hung at its next save or at its end. So a failed write is announced in
jax's distributed key-value store (`announce_failure`, from orbax's report of it), and orbax's barriers are ours
(`barrier`): those of a save's writes give up once a failure is announced. `save_states` then tells every process,
at the same step, whether the save has ended everywhere and whether it failed somewhere.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np

from sharding.mesh import key_value_client

_FAILED = "m3jax/checkpoint/failed/"  # + the failed process's index: its cause
# The barriers of a save's writes, which a process whose write failed never reaches (orbax's names); its other
# barriers (the save's start and end) every process reaches, failed or not.
_WRITE_BARRIERS = ("async_write_complete", "async_commit_complete")

RUNNING, ENDED, FAILED = 0, 1, 2  # a save's state on one process (`save_states`)


class FailedElsewhere(RuntimeError):
    """This process's part of a save was abandoned: another process's write failed (str: which, and why)."""


def announce_failure(cause: str) -> None:
    """Tell the job that this process's write of the running save failed (a no-op in a single-process run)."""
    client = key_value_client()
    if client is not None and jax.process_count() > 1:
        client.key_value_set(f"{_FAILED}{jax.process_index()}", cause, allow_overwrite=True)


def failures() -> dict[int, str]:
    """{process: cause} of the failed writes announced so far."""
    client = key_value_client()
    if client is None:
        return {}
    return {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get(_FAILED)}


class Barrier:
    """orbax's barrier_sync_fn (`AsyncOptions`), on the key-value store: every process writes its arrival, and a
    barrier of a save's writes raises FailedElsewhere once a failure is announced rather than wait for it. orbax
    reuses a key for each save (its start and end); each use is a generation of its own, counted per process (all
    processes pass the same barriers in the same order; the count is shared by every Barrier, as the keys are)."""

    _uses: dict[str, int] = {}
    _lock = threading.Lock()

    def __init__(self, poll_s: float = 0.05):
        self.poll_s = poll_s

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        client, n = key_value_client(), jax.process_count()
        with Barrier._lock:
            use = Barrier._uses[key] = Barrier._uses.get(key, -1) + 1
        where = f"m3jax/checkpoint/barrier/{key}/{use}/"
        client.key_value_set(f"{where}{jax.process_index()}", "")
        abandons = any(name in key for name in _WRITE_BARRIERS)
        deadline = time.monotonic() + timeout_ms / 1000
        while len(client.key_value_dir_get(where)) < n:
            failed = failures() if abandons else {}
            if failed:
                raise FailedElsewhere(describe(failed))
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint barrier {key}: {len(client.key_value_dir_get(where))} of {n} "
                                   f"processes arrived in {timeout_ms / 1000:.0f} s")
            time.sleep(self.poll_s)


def describe(failed: dict[int, str]) -> str:
    return f"process(es) {', '.join(map(str, sorted(failed)))} failed to write it ({'; '.join(set(failed.values()))})"


def save_states(state: int) -> list[int]:
    """Every process's state of the running save (RUNNING, ENDED or FAILED), in process order: one all-gather, which
    every process calls at the same point; [state] in a single-process run."""
    if jax.process_count() == 1:
        return [state]
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(np.int32(state))).tolist()


def job_max(flag: bool) -> bool:
    """Whether `flag` holds on any process of the job (one all-gather; this process's own in a single-process job):
    a decision every process must take alike, from what each read on its own."""
    if jax.process_count() == 1:
        return bool(flag)
    from m3jax.hf.tensors import processes_where
    return bool(processes_where(flag))


def job_steps(steps: list[int]) -> list[int]:
    """Process 0's list of checkpoint steps, on every process (a shared file system may show a step to one host
    before another; the job tries the same steps in the same order)."""
    if jax.process_count() == 1:
        return steps
    from sharding.host_values import broadcast_from_first_process
    n = int(broadcast_from_first_process(np.int32(len(steps))))
    if not n:
        return []
    mine = np.zeros(n, np.int32)  # the shape process 0 sends: a collective needs it on every process
    mine[:min(n, len(steps))] = steps[:n]
    return [int(s) for s in np.asarray(broadcast_from_first_process(mine))]
