"""Enough threads for XLA:CPU's collectives among simulated devices (`--xla_force_host_platform_device_count=N`).

XLA:CPU runs every device's share of a program on one thread pool of max(NPROC or the core count, N) threads (jaxlib
0.10.2, `GetPjRtCpuClient`): with N simulated devices on fewer cores, exactly N. A collective holds all N threads at
once, its shares waiting for each other; with other programs in flight holding a thread, its last share never
starts, and after 40 s XLA ends the process ("Termination timeout ... Expected 8 threads to join the rendezvous, but
only 7 of them arrived on time"). It aborted a test worker in CI (2026-12-05). The same dispatch loop under load
(hf_tensors of a model sharded over 8 devices, on device, 2 cores and a busy loop beside it) aborted after 230 and
370 rounds with the default pool, after 30 with `jax_cpu_enable_async_dispatch` off, and ran 1500 rounds with
NPROC=16 (BENCHMARKS.md, Session 40).

Three times the devices, not the twice that ran the stress loop: stuck, every program in flight is short of a
share, so P programs hold at most (N - 1) P threads; more threads than that leave one free for a missing share. A
training run has up to three dispatching threads (the train step, a draw ahead on the JAX engine, a checkpoint's
background copies), and one thread's dispatches already needed more than N. NPROC also sizes XLA's intra-op pool
(NPROC threads, for one large op split across them): 8, 16 and 24 threads timed the same on the tests that were
measured (BENCHMARKS.md, Session 40).
"""

from __future__ import annotations

import re

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def reserve_collective_threads(environ) -> int | None:
    """Set NPROC = 3 N in `environ` (before jax starts its CPU backend, which reads it once) when XLA_FLAGS asks for
    N > 1 simulated devices and NPROC is unset; return the value set, else None."""
    found = _DEVICE_COUNT.findall(environ.get("XLA_FLAGS", ""))
    devices = int(found[-1]) if found else 1
    if devices <= 1 or "NPROC" in environ:
        return None
    environ["NPROC"] = str(3 * devices)
    return 3 * devices
