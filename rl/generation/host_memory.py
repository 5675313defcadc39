"""Transparent huge pages for the vLLM engine processes' large host allocations (issue 12 item 3).

Every in-place weight update on CPU re-packs each GEMM weight into a fresh oneDNN buffer and frees the old one
(rl.generation.inplace). glibc serves allocations that large with mmap and returns them with munmap, so each
update faults every page of the packed weights in again, 4 kB at a time: 140 k faults and 0.2-0.5 s of kernel
time for the 1 GB bench model, more than the copy and the pack themselves (BENCHMARKS.md, issue 12,
session 15). glibc's `glibc.malloc.hugetlb=1` tunable (glibc >= 2.35) marks those mappings MADV_HUGEPAGE, so
they fault in 2 MB at a time where the kernel's THP mode is `madvise` or `always`. The tunable is read once,
when the process starts, so it has to be in the environment an engine process is started with (its Ray
actor's runtime_env); vLLM's worker processes inherit it. Elsewhere (an older glibc, musl, THP `never`) it
changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TUNABLES = "GLIBC_TUNABLES"
HUGETLB = "glibc.malloc.hugetlb"


def huge_page_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """{GLIBC_TUNABLES: ...}: the caller's tunables (`environ`) with `glibc.malloc.hugetlb=1` added, unless
    they already set hugetlb (theirs wins)."""
    tunables = [t for t in environ.get(TUNABLES, "").split(":") if t]
    if not any(t.split("=", 1)[0] == HUGETLB for t in tunables):
        tunables.append(f"{HUGETLB}=1")
    return {TUNABLES: ":".join(tunables)}


def thp_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), None where it has none."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[")), None)


def start_tunables(path: str = "/proc/self/environ") -> str | None:
    """GLIBC_TUNABLES as this process was started with (what glibc read; os.environ may have changed since),
    None where the process had none or the platform shows no start environment."""
    try:
        with open(path, "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    prefix = TUNABLES.encode() + b"="
    return next((e[len(prefix):].decode() for e in entries if e.startswith(prefix)), None)
