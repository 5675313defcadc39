"""The pool's own local Ray (rl.generation.local_ray): a store sized to the staged update, for the `ray` transport
only, whose pages the warm-up leaves in place; this Ray version starts with those settings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from rl.generation import local_ray

GB = 10**9
ROOT = str(Path(__file__).resolve().parents[1])


def test_store_holds_two_updates_plus_room_within_rays_default_and_dev_shm():
    # two updates and the rollouts, with room for the allocator's fragmentation
    want = int((2 * GB + local_ray.ROLLOUT_ROOM) * local_ray.FRAGMENTATION)
    assert local_ray.object_store_bytes(1 * GB, 100 * GB, 50 * GB) == want
    assert local_ray.object_store_bytes(20 * GB, 100 * GB, 50 * GB) == 30 * GB  # Ray's 30 % of memory
    assert local_ray.object_store_bytes(20 * GB, 100 * GB, 10 * GB) == 9 * GB  # 90 % of free /dev/shm
    assert local_ray.object_store_bytes(900 * GB, 2000 * GB, 1000 * GB) == 200 * GB  # Ray's 200 GB cap
    assert local_ray.object_store_bytes(0, 100 * GB, 10**6) == local_ray.RAY_MIN


def test_init_kwargs_follow_the_checkpoint_and_the_transport(tmp_path):
    save_file({"a": np.zeros((1000, 1000), np.float32)}, str(tmp_path / "model-00001.safetensors"))
    assert local_ray.checkpoint_bytes(str(tmp_path)) == 4_000_000  # the tensors (headers excluded)
    kw = local_ray.init_kwargs(str(tmp_path), "ray")
    # nothing for the raylet to do before it opens its socket (Ray gives up on a raylet after ~10 s), and no
    # spilling of the warm-up's objects
    assert kw["_system_config"] == {"object_spilling_threshold": 1.0}
    # (2 x 4 MB + the room) x the fragmentation allowance, unless this machine's memory or /dev/shm caps it
    assert local_ray.RAY_MIN <= kw["object_store_memory"] <= (2 * local_ray.checkpoint_bytes(str(tmp_path)) +
                                                              local_ray.ROLLOUT_ROOM) * local_ray.FRAGMENTATION
    assert local_ray.init_kwargs(str(tmp_path), "collective") == {}


_START = """
import json, sys
import ray
from rl.generation import local_ray

def shmem_kb():  # shared-memory pages mapped into this process: the store's, as this driver touched them
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("RssShmem:")))

kw = local_ray.init_kwargs(sys.argv[1], "ray")
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, **kw)
before = shmem_kb()
local_ray.warm_object_store(kw["object_store_memory"])  # its objects are gone when it returns
print(json.dumps([kw["object_store_memory"], ray.cluster_resources()["object_store_memory"],
                  (shmem_kb() - before) * 1024]))
ray.shutdown()
"""


def test_this_ray_starts_with_the_sized_store_and_keeps_the_warmed_pages(tmp_path):
    pytest.importorskip("ray", reason="ray is not installed (scripts/setup.sh installs it)")
    save_file({"a": np.zeros((256, 1024), np.float32)}, str(tmp_path / "model.safetensors"))
    out = subprocess.run([sys.executable, "-c", _START, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, "RAY_ADDRESS": ""})  # a Ray of its own
    assert out.returncode == 0, out.stderr[-2000:]
    asked, got, kept = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == asked
    # every warm-up chunk's pages are still mapped after its object was freed: later puts land on them
    chunk, puts = local_ray.warm_plan(asked)
    assert kept >= 0.95 * chunk * puts >= 0.9 * asked, (kept, chunk, puts, asked)


def test_warm_up_covers_the_store_in_at_most_64_mb_puts():
    for store in (local_ray.RAY_MIN, 685 << 20, 3455 << 20, 200 * GB):
        chunk, puts = local_ray.warm_plan(store)
        assert (1 << 20) <= chunk <= local_ray.WARM_CHUNK
        assert local_ray.WARM_SHARE * store - chunk < chunk * puts <= local_ray.WARM_SHARE * store
