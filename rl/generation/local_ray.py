"""The local Ray a vLLM pool starts when it is given no cluster address (issue 12: weight push on one host).

The `ray` weight transport stages a whole update in the object store until every engine has verified it. Ray's
default store is 30 % of memory and its pages are faulted in only when an object first lands on them: on this
machine single `ray.put`s of a 64 MB bucket took 0.2-0.6 s against 0.01 s whenever a bucket landed on pages
not yet used, and the first update's 1 GB took 3 s of puts (BENCHMARKS.md, issue 12, session 15). Pages once
used stay with the store (it is one shared-memory file) and later puts on them run at memcpy speed.

So the pool's own Ray gets a store sized to what it holds at once, and `warm_object_store` fills nearly all of
it once from the driver while the engines start, so that every later put lands on pages that already exist:
- what it holds at once is twice the checkpoint plus room for rollouts: an engine's staged objects are freed
  asynchronously, within a second of its commit, so an update that follows at once lands beside the previous
  one (979 MiB of the 1.03 GB bench model still held right after its commit, 0 one second later; session 16);
- plus a third for the allocator's fragmentation: the bench's bucket sizes (192, 57, 36, 61, 7 x 63, 192 MB),
  two updates live, walked over 3.26-3.46 GB of a 3.46 GB store before they settled, and every put onto a page
  not yet used faulted it in at ~0.3 GB/s (16 k faults and ~0.19 s of system time per 63 MB put);
- warmed to WARM_SHARE, not three quarters: with 75 % warmed the same sequence still faulted in 0.4-0.9 s of
  puts in two rounds of eight, with 98 % only in the first. Ray spills primary copies above 80 % of the store
  (`object_spilling_threshold`), which the warm-up would trip (the raylet logged "Triggering object spilling"),
  so this Ray's threshold is 1.0: it spills only when an object does not fit.
Not Ray's `preallocate_plasma_memory`: that fills the store inside the raylet before it opens its socket, and
the raylet gives up after ten 1 s connection attempts; on this VM (fresh guest memory at 0.2-0.4 GB/s) a 2.6 GB
store took about 12 s and Ray did not start (2026-12-03).

A cluster the pool joins (`generation.vllm_ray_address`) keeps its own settings: docs/vllm.md says how to
start one the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

log = logging.getLogger(__name__)

ROLLOUT_ROOM = 512 << 20  # rollouts, scores and probes pass through the store beside the staged update
RAY_DEFAULT_SHARE = 0.3  # Ray's own default store: 30 % of memory, at most 200 GB
RAY_DEFAULT_MAX = 200 * 10**9
RAY_MIN = 100 << 20  # Ray refuses a store under 75 MB
WARM_SHARE = 0.98  # of the store, filled once at start (the rest: rollouts that arrive during the warm-up)
FRAGMENTATION = 4 / 3  # address space the allocator walks over, per byte held (measured above)
SYSTEM_CONFIG = {"object_spilling_threshold": 1.0}  # spill only when an object does not fit (above)
WARM_CHUNK = 64 << 20  # one put of the warm-up (warm_plan); the bench's bucket size


def checkpoint_bytes(model_dir: str) -> int:
    """Bytes of the tensors of `model_dir` (a checkpoint, or its shapes: `m3jax.hf.shapes`): what one update moves
    when the engines serve the checkpoint's dtype. An fp32 update of a bf16 file is twice that: the store then holds
    one update at a time, and the next one's puts wait for (or spill) the last one's objects, which the engines free
    within a second."""
    from m3jax.hf.shapes import tensor_bytes

    return sum(tensor_bytes(model_dir))


def object_store_bytes(update_bytes: int, memory_bytes: int, shm_free_bytes: int) -> int:
    """Store for the `ray` transport: (2 x the update + ROLLOUT_ROOM) x FRAGMENTATION; at most Ray's default
    share of memory (min(30 %, 200 GB)) and 90 % of what /dev/shm has free (Ray would otherwise put the store
    on disk), at least RAY_MIN."""
    want = (2 * update_bytes + ROLLOUT_ROOM) * FRAGMENTATION
    return int(max(RAY_MIN, min(want, RAY_DEFAULT_SHARE * memory_bytes, RAY_DEFAULT_MAX, 0.9 * shm_free_bytes)))


def init_kwargs(model_dir: str, transport: str) -> dict:
    """Extra ray.init arguments for the pool's local Ray: a store sized for the `ray` transport that spills only
    when full; none for `shm` and `collective` (their buckets never enter the store)."""
    if transport != "ray":
        return {}
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        shm_free = shutil.disk_usage("/dev/shm").free
    except OSError:
        return {}  # no /dev/shm (not Linux): Ray's defaults
    return {"object_store_memory": object_store_bytes(checkpoint_bytes(model_dir), memory, shm_free),
            "_system_config": dict(SYSTEM_CONFIG)}


def warm_plan(store_bytes: int) -> tuple[int, int]:
    """(bytes per put, puts) that fill WARM_SHARE of a store of `store_bytes`: WARM_CHUNK puts, smaller ones
    (at least 1 MB, above Ray's 100 KB inline limit) for a store too small for 32 of them, so that the
    rounding leaves little of it cold."""
    chunk = min(WARM_CHUNK, max(store_bytes // 32, 1 << 20))
    return chunk, int(WARM_SHARE * store_bytes) // chunk


def warm_object_store(store_bytes: int) -> float:
    """Fill WARM_SHARE of the connected Ray's store of `store_bytes` with objects (`warm_plan`) and drop them, so
    that the store's pages exist before the first update; returns the seconds it took. The source is one
    zero-filled buffer, so the driver holds only one put's bytes of its own."""
    import numpy as np
    import ray

    t = time.perf_counter()
    chunk_bytes, puts = warm_plan(store_bytes)
    chunk = np.zeros(chunk_bytes, np.uint8)
    refs = [ray.put(chunk) for _ in range(puts)]
    del refs
    return time.perf_counter() - t


def warm_in_background(store_bytes: int) -> threading.Thread:
    """`warm_object_store` in a daemon thread (the pool starts its engines meanwhile and joins it before the
    first update); a failure is logged, not raised: a cold store is slower, not wrong."""
    def run():
        try:
            s = warm_object_store(store_bytes)
            log.info("object store: %.2f GB warmed in %.1f s", WARM_SHARE * store_bytes / 1e9, s)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning("object store warm-up failed (%r): the first updates fault its pages in", e)

    thread = threading.Thread(target=run, daemon=True, name="m3jax-warm-object-store")
    thread.start()
    return thread
