"""Engine processes start with glibc's huge-page tunable (rl.generation.host_memory): the environment it builds,
and that a process started with it faults a fresh large allocation in far fewer times (2 MB pages)."""

import json
import os
import subprocess
import sys

import pytest

from rl.generation import host_memory

# A fresh 256 MB allocation from glibc's malloc (mmap'd, as the oneDNN re-pack's buffers are; numpy's own
# allocator would ask for huge pages itself), written once; minor faults.
_TOUCH = """
import ctypes, json, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
n = 256 << 20
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(n)
ctypes.memset(p, 1, n)
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""

def faults(env_vars: dict) -> int:
    env = {k: v for k, v in os.environ.items() if k != host_memory.TUNABLES} | env_vars
    out = subprocess.run([sys.executable, "-c", _TOUCH], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_tunable_is_added_to_the_callers_and_theirs_wins():
    assert host_memory.huge_page_env({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert host_memory.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    theirs = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"}
    assert host_memory.huge_page_env(theirs) == theirs


def test_start_tunables_reads_the_environment_the_process_started_with(tmp_path):
    environ = tmp_path / "environ"
    environ.write_bytes(b"PATH=/bin\0GLIBC_TUNABLES=glibc.malloc.hugetlb=1\0HOME=/root\0")
    assert host_memory.start_tunables(str(environ)) == "glibc.malloc.hugetlb=1"
    environ.write_bytes(b"PATH=/bin\0")
    assert host_memory.start_tunables(str(environ)) is None
    assert host_memory.start_tunables(str(tmp_path / "absent")) is None


@pytest.mark.skipif(host_memory.thp_mode() not in ("madvise", "always"),
                    reason=f"the kernel's transparent huge pages are {host_memory.thp_mode()!r}, not madvise/always")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables and minor-fault counts are Linux's")
def test_a_process_started_with_the_tunable_faults_a_large_allocation_in_huge_pages():
    plain, huge = faults({}), faults(host_memory.huge_page_env({}))
    # 256 MB: 65 536 faults of 4 kB without; with 2 MB pages ~128 (plus the interpreter's own, a few thousand)
    assert plain > 60_000, plain
    assert huge < plain / 4, (plain, huge)
