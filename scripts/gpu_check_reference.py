"""Check 12 of scripts/gpu_check.py: the KL reference's weights in pinned host memory (`grpo.reference_memory: host`).

The planner prices bringing them onto the devices at each reference pass as bytes / PCIe (50 GB/s a GPU); this
measures it: a bf16 tree of `gb` gigabytes held by `rl.reference.ReferenceWeights` in the device's pinned host
memory, `for_pass()` timed (best of 3, to the device) and compared with the original bit for bit, and the copy
into host memory timed once. On the CPU (--small) host and device memory are one RAM: the figures there say only
that the path runs.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def host_reference(small: bool, gb: float | None = None) -> dict:
    from rl.reference import HOST_KIND, ReferenceWeights, host_kinds
    gb = gb or (0.01 if small else 4.0)
    device = jax.devices()[0]
    # 8 leaves, as a model's many tensors: each a [rows, 4096] bf16 array
    rows = max(int(gb * 2**30 / 8 / (4096 * 2)), 1)
    params = {f"w{i}": jax.device_put(jnp.full((rows, 4096), i + 0.5, jnp.bfloat16), device) for i in range(8)}
    jax.block_until_ready(params)
    nbytes = sum(x.nbytes for x in params.values())
    out = {"check": "host_reference", "platform": device.platform, "gb": round(nbytes / 2**30, 3),
           "memory_kinds": sorted(host_kinds(params))}
    if HOST_KIND not in out["memory_kinds"]:
        return {**out, "skipped": f"the {device.platform} device offers no {HOST_KIND} memory"}
    t0 = time.perf_counter()
    ref = ReferenceWeights(params, "host")
    jax.block_until_ready(ref.held)
    out["to_host_s"] = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        back = ref.for_pass()
        jax.block_until_ready(back)
        times.append(time.perf_counter() - t0)
    out["to_device_s"] = min(times)
    out["to_device_gb_s"] = nbytes / 1e9 / out["to_device_s"]
    out["held_in"] = sorted({x.sharding.memory_kind for x in jax.tree.leaves(ref.held)})
    out["bit_for_bit"] = all(np.array_equal(np.asarray(back[k]), np.asarray(params[k])) for k in params)
    return out
