"""glibc malloc settings for the CPU vLLM engine processes, so an in-place weight update reuses its memory
(issue 12 item 3).

Every in-place update on CPU re-packs each GEMM weight into a fresh oneDNN buffer (rl.generation.inplace).
Under glibc's defaults an allocation that large is an mmap, given back with munmap when freed, so each update
faults the whole packed copy in again, 4 kB at a time: 140 k faults and 0.2-0.5 s of kernel time for the 1 GB
bench model, more than the copy and the pack themselves, and noisy (BENCHMARKS.md, issue 12, session 15).
The engines therefore start with (GLIBC_TUNABLES, read once when a process starts, so it goes into the
environment the pool starts an engine actor with; vLLM's worker processes inherit it):

    glibc.malloc.hugetlb=1             what does come from the kernel is marked MADV_HUGEPAGE: 2 MB pages
    glibc.malloc.mmap_max=0            large blocks come from the heap instead of their own mappings ...
    glibc.malloc.arena_max=1           ... one heap for every thread (other arenas would map large blocks
                                       anyway: a thread arena's heap is at most 64 MB) ...
    glibc.malloc.trim_threshold=2**36  ... which is never trimmed, so memory freed stays for the next update
    glibc.cpu.x86_non_temporal_threshold=2**20
                                       memcpy of 1 MB or more stores around the cache (see below)

and the applier frees the old packed copies before it makes the new ones, which then land in the same memory:
from the third update on, an update faults almost nothing in (3-4 faults; apply 0.13-0.14 s, from 0.2-1.2 s),
apart from an occasional update whose blocks did not fit and grew the heap. The cost: an engine's heap keeps
its peak size, and its threads share one malloc arena. GPU engines keep glibc's defaults (their update is a
device copy with no re-pack; one shared arena was not measured there). A tunable the caller already set wins.
Elsewhere (an older glibc, musl) the variable changes nothing.

The non-temporal threshold: glibc's memcpy switches to non-temporal stores only above 3/4 of the shared cache
per thread, and this VM reports a 480 MB L3, so every copy of a weight update (1-64 MB each) wrote through the
cache, reading each destination line before overwriting it: 7.2-7.3 GB/s in chunks of 1-64 MB against 12.7-13.8
GB/s with the threshold at 1 MB (np.copyto of 1 GB in chunks, 2026-12-04). The loaders' copies go through
memcpy under `rl.generation.host_copies.memcpy_copies`, so this is what makes the engine's apply copy run at
memcpy speed. The cost: a large copy whose destination is read again at once misses the cache (the engine's
generation speed with the setting was not measured apart).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TUNABLES = "GLIBC_TUNABLES"
NON_TEMPORAL = "glibc.cpu.x86_non_temporal_threshold"
ENGINE_MALLOC = {
    "glibc.malloc.hugetlb": "1",
    "glibc.malloc.mmap_max": "0",
    "glibc.malloc.arena_max": "1",
    "glibc.malloc.trim_threshold": str(1 << 36),
    NON_TEMPORAL: str(1 << 20),  # ignored off x86
}


def sender_copy_advice(environ: Mapping[str, str] = os.environ, machine: str | None = None) -> str | None:
    """What to tell a trainer process that was started without the non-temporal threshold (its sender copies
    each update into the `shm` files, or the object store, through the cache), or None when it has it or is
    not on x86. The trainer cannot set it for itself: glibc reads it once, when the process starts, and it
    changes every large memcpy of the process (JAX's included: no change seen on the forward-backward bench,
    BENCHMARKS.md, session 24)."""
    import platform

    if (machine or platform.machine()) not in ("x86_64", "AMD64") or NON_TEMPORAL in environ.get(TUNABLES, ""):
        return None
    return (f"this trainer process copies weight updates through the cache; started with "
            f"{TUNABLES}={NON_TEMPORAL}=0x100000 its pushes to CPU engines on this machine are faster (1 GB, one "
            "engine, shm: 0.30-0.33 s instead of 0.36-0.39 s per update; docs/vllm.md)")


def engine_malloc_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """{GLIBC_TUNABLES: ...}: the caller's tunables (`environ`) plus ENGINE_MALLOC's, the caller's winning
    where both set one."""
    tunables = [t for t in environ.get(TUNABLES, "").split(":") if t]
    have = {t.split("=", 1)[0] for t in tunables}
    tunables += [f"{k}={v}" for k, v in ENGINE_MALLOC.items() if k not in have]
    return {TUNABLES: ":".join(tunables)}
