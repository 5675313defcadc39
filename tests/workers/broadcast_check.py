"""One of two CPU processes (2 simulated devices each) of a jax job: `python broadcast_check.py PORT PROCESS OUT`.

Broadcasts a tree whose values differ per process with `sharding.host_values.broadcast_from_first_process` and with
jax's `multihost_utils.broadcast_one_to_all`, and writes OUT.<process>.npz: both results' leaves, and the tree
process 0 sent."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402


def tree(process: int) -> dict:
    rng = np.random.default_rng(process)
    floats = rng.standard_normal((3, 5)).astype(np.float32)
    floats[0, :3] = [np.nan, -0.0, np.inf]
    return {"floats": floats, "routes": rng.integers(-1, 300, (2, 4, 3, 2)).astype(np.int16),
            "done": rng.random(6) < 0.5, "count": np.int32(7 + process), "empty": np.zeros((0, 3), np.float32)}


def main(port: str, process: str, out: str) -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(process))
    from jax.experimental import multihost_utils

    from sharding.host_values import broadcast_from_first_process
    mine = tree(int(process))
    ours, theirs = broadcast_from_first_process(mine), multihost_utils.broadcast_one_to_all(mine)
    np.savez(f"{out}.{process}.npz", **{f"ours_{k}": v for k, v in ours.items()},
             **{f"jax_{k}": np.asarray(v) for k, v in theirs.items()}, **{f"sent_{k}": v for k, v in tree(0).items()})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
