"""Pick a kernel by timing each candidate on the device, at the shapes the run will give it.

Which grouped-matmul kernel (`sharding.grouped_matmul`) is fastest depends on the device and the shapes. On CPU it
was measured once and is a rule (bucketed, `resolve_kernel`). On a GPU nothing here has measured it, and
`jax.lax.ragged_dot`, the static fallback, is a dense matmul there (E x the rows: BENCHMARKS.md, session 25). So the
choice is measured where the run starts, as Triton's and XLA's autotuners measure theirs:

    kernel = argmin_k  median_i  t_i(k)      over the candidates the device runs (`candidate_kernels`),
                                             i = rounds that call every candidate once, in a shuffled order

A candidate that fails to compile or run (a Pallas kernel the GPU rejects, Mosaic off Hopper, out of memory) is
left out and its error kept. Generic: the caller builds the computation (`make(kernel) -> fn(*args)`); the M3
expert MLP is `m3jax.model.expert_tuning`'s. On several processes every one times and the median over them decides
for all (`gather_timings`): every process must build the same program.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

# Kernels every backend runs natively (pallas and mosaic are GPU kernels: off a GPU Pallas interprets them).
PORTABLE = ("ragged_dot", "tiled", "bucketed")


def candidate_kernels(device) -> tuple[str, ...]:
    """The grouped-matmul kernels `device` runs as compiled code: the portable ones, on a GPU also pallas
    (Triton), and on a Hopper GPU (compute capability 9.x) mosaic (jax's Mosaic GPU kernels)."""
    if device.platform != "gpu":
        return PORTABLE
    hopper = str(getattr(device, "compute_capability", "")).startswith("9")
    return PORTABLE + ("pallas",) + (("mosaic",) if hopper else ())


class Timings(NamedTuple):
    """What `time_candidates` measured: each kernel's median ms, the error of each that did not run, and the
    temporaries XLA allocated for each compiled program (bytes; None where the backend does not say): the
    memory side of the choice, which the timing alone does not weigh."""
    ms: dict[str, float]
    errors: dict[str, str]
    temp_bytes: dict[str, int | None]


def time_candidates(make: Callable[[str], Callable], args: Sequence, kernels: Sequence[str], *,
                    diff_argnums: tuple[int, ...] = (), device=None, rounds: int = 5, seed: int = 0,
                    timer: Callable[[], float] = time.perf_counter) -> Timings:
    """`Timings` of `make(kernel)(*args)` on `device` (default: the first local one) for each of `kernels`.

    diff_argnums non-empty: each call is the forward and backward, the gradient of sum(out * cot) with respect to
    those arguments for a fixed random cotangent, as a train step runs it; else the forward alone. Every
    candidate is compiled and run once before the timed rounds."""
    device = device or jax.local_devices()[0]
    args = [jax.device_put(a, device) for a in args]
    programs, errors, temps = {}, {}, {}
    for kernel in kernels:
        try:
            fn = make(kernel)
            if diff_argnums:
                out = jax.eval_shape(fn, *args)
                cot = jax.device_put(jax.random.normal(jax.random.key(seed), out.shape, jnp.float32), device)

                def loss(*a, fn=fn, cot=cot):
                    return jnp.sum(fn(*a).astype(jnp.float32) * cot)
                program = jax.jit(jax.grad(loss, argnums=diff_argnums))
            else:
                program = jax.jit(fn)
            compiled = program.lower(*args).compile()
            memory = compiled.memory_analysis()
            jax.block_until_ready(compiled(*args))
            programs[kernel] = compiled
            temps[kernel] = getattr(memory, "temp_size_in_bytes", None)
        except Exception as e:  # noqa: BLE001 - a kernel this device cannot run is not a candidate
            errors[kernel] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    times: dict[str, list[float]] = {k: [] for k in programs}
    order = np.random.default_rng(seed)
    for _ in range(rounds):
        for kernel in order.permutation(list(programs)):
            t0 = timer()
            jax.block_until_ready(programs[kernel](*args))
            times[kernel].append(timer() - t0)
    return Timings({k: statistics.median(v) * 1e3 for k, v in times.items()}, errors, temps)


def fastest(ms: dict[str, float]) -> str:
    """The kernel with the least time (ties: the first listed)."""
    if not ms:
        raise ValueError("no kernel ran: nothing to choose from")
    return min(ms, key=ms.__getitem__)


def agree_on(choice: str | None, kernels: Sequence[str]) -> str | None:
    """Process 0's `choice` (one of `kernels`, or None: it has none) on every process, by one broadcast when there
    are several. Every process must call it, process 0 also when it has no choice, or the others would wait
    forever."""
    if jax.process_count() == 1:
        return choice
    from jax.experimental import multihost_utils
    index = -1 if choice is None else kernels.index(choice)
    got = int(multihost_utils.broadcast_one_to_all(np.int32(index if jax.process_index() == 0 else 0)))
    return None if got < 0 else kernels[got]


def gather_timings(ms: dict[str, float], kernels: Sequence[str]) -> dict[str, float]:
    """Every process's `ms` (this process's median ms of each of `kernels` that ran) gathered, -> {kernel: the
    median over the processes} for the kernels that ran on every process, in the order of `kernels`; the same on
    every process, so each builds the same program. One busy host cannot pick for all, and a kernel that failed
    on any host (its memory, its GPU) is not chosen. Every process must call it (one all-gather)."""
    row = np.array([ms.get(k, np.inf) for k in kernels], np.float32)
    if jax.process_count() == 1:
        table = row[None]
    else:
        from jax.experimental import multihost_utils
        table = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, len(kernels))
    return {k: float(np.median(table[:, i])) for i, k in enumerate(kernels) if np.isfinite(table[:, i]).all()}


def read_record(path: str | None) -> dict | None:
    """The record `write_record` left at `path`, or None (no path, no file, or one that is not a JSON object: said
    in a warning, and the caller times again)."""
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        log.warning("kernel record %s unreadable (%s): timing again", path, e)
        return None
    return record if isinstance(record, dict) else None


def write_record(path: str, record: dict) -> None:
    """`record` as JSON at `path`, replaced whole (a crash leaves the old record or the new one)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
