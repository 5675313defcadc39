"""CPU engine processes start with glibc malloc tunables (rl.generation.host_memory): the environment built, and
that a process started with it reuses freed memory for the next large allocation (nothing faulted in again),
where glibc's defaults fault every page of it in afresh."""

import json
import os
import subprocess
import sys

import pytest

from rl.generation import host_memory

# Two rounds of glibc malloc'ed 256 MB blocks (as the oneDNN re-pack's: the next round allocated after the last one
# was freed), each written once; minor faults of the second round.
_TOUCH = """
import ctypes, json, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = 256 << 20
p = libc.malloc(n)
ctypes.memset(p, 1, n)
libc.free(ctypes.c_void_p(p))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(n)
ctypes.memset(p, 2, n)
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def faults(env_vars: dict) -> int:
    env = {k: v for k, v in os.environ.items() if k != host_memory.TUNABLES} | env_vars
    out = subprocess.run([sys.executable, "-c", _TOUCH], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_tunables_are_added_to_the_callers_and_theirs_win():
    ours = ":".join(f"{k}={v}" for k, v in host_memory.ENGINE_MALLOC.items())
    assert host_memory.engine_malloc_env({}) == {"GLIBC_TUNABLES": ours}
    assert host_memory.engine_malloc_env({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=4096"}) == {
        "GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=4096:" + ours}
    theirs = host_memory.engine_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"})["GLIBC_TUNABLES"]
    assert theirs.split(":")[0] == "glibc.malloc.arena_max=4" and theirs.count("arena_max") == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables and minor-fault counts are Linux's")
def test_a_process_started_with_the_tunables_reuses_freed_memory_for_the_next_large_block():
    plain, tuned = faults({}), faults(host_memory.engine_malloc_env({}))
    # 256 MB: 65 536 faults of 4 kB under the defaults (munmap'd, mapped afresh), 128 even as 2 MB pages
    assert plain > 60_000, plain
    assert tuned < 100, (plain, tuned)


def test_a_trainer_without_the_non_temporal_threshold_is_told_how_to_start():
    advice = host_memory.sender_copy_advice({}, machine="x86_64")
    assert advice is not None and "GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000" in advice
    set_ = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.cpu.x86_non_temporal_threshold=1048576"}
    assert host_memory.sender_copy_advice(set_, machine="x86_64") is None
    assert host_memory.sender_copy_advice({}, machine="aarch64") is None  # the tunable is x86's
