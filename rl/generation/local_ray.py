"""The local Ray a vLLM pool starts when it is given no cluster address (issue 12: weight push on one host).

The `ray` weight transport stages a whole update in the object store until every engine has verified it. By
default Ray's store is 30 % of memory, faulted in lazily, and memory it frees goes back to the kernel, so a
later `ray.put` of a 64 MB bucket sometimes waits for fresh shared-memory pages: single puts of 0.2-0.6 s
against 0.01 s, the wire of one update in three 3-5x slower, and the first update's 1 GB taking 3 s of puts
(BENCHMARKS.md, issue 12, session 15). The pool's own Ray therefore gets a store sized to the update it
stages (twice the checkpoint, plus room for rollouts), pre-populated when Ray starts (Ray's
`preallocate_plasma_memory`), so every put lands on pages that already exist. A cluster the pool joins
(`generation.vllm_ray_address`) keeps its own settings: docs/vllm.md says how to start one the same way.
"""

from __future__ import annotations

import glob
import os
import shutil

ROLLOUT_ROOM = 512 << 20  # rollouts, scores and probes pass through the store beside the staged update
RAY_DEFAULT_SHARE = 0.3  # Ray's own default store: 30 % of memory, at most 200 GB
RAY_DEFAULT_MAX = 200 * 10**9
RAY_MIN = 100 << 20  # Ray refuses a store under 75 MB


def checkpoint_bytes(model_dir: str) -> int:
    """Bytes of the safetensors files of `model_dir`: what one update moves when the engines serve the file's
    dtype (an fp32 update of a bf16 file is twice that, which object_store_bytes' 2x still holds)."""
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(model_dir, "*.safetensors")))


def object_store_bytes(update_bytes: int, memory_bytes: int, shm_free_bytes: int) -> int:
    """Store for the `ray` transport: 2 x the update + ROLLOUT_ROOM, at most Ray's default share of memory
    (min(30 %, 200 GB)) and 90 % of what /dev/shm has free (Ray would otherwise put the store on disk), at
    least RAY_MIN."""
    want = 2 * update_bytes + ROLLOUT_ROOM
    return int(max(RAY_MIN, min(want, RAY_DEFAULT_SHARE * memory_bytes, RAY_DEFAULT_MAX, 0.9 * shm_free_bytes)))


def init_kwargs(model_dir: str, transport: str) -> dict:
    """Extra ray.init arguments for the pool's local Ray: a sized, pre-populated store for the `ray`
    transport; none for `collective` (its buckets never enter the store)."""
    if transport != "ray":
        return {}
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        shm_free = shutil.disk_usage("/dev/shm").free
    except OSError:
        return {}  # no /dev/shm (not Linux): Ray's defaults
    return {"object_store_memory": object_store_bytes(checkpoint_bytes(model_dir), memory, shm_free),
            "_system_config": {"preallocate_plasma_memory": True}}
