"""One of two CPU processes (2 simulated devices each) of a jax job: `python host_values_check.py PORT PROCESS OUT`.

Broadcasts a tree whose values differ per process with `sharding.host_values.broadcast_from_first_process` and with
jax's `multihost_utils.broadcast_one_to_all`, gathers global arrays held across both processes with
`gather_to_every_process` (in chunks smaller than the array), and writes OUT.<process>.npz: both broadcasts' leaves,
the tree process 0 sent, each gathered array and the value it was made from."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def tree(process: int) -> dict:
    rng = np.random.default_rng(process)
    floats = rng.standard_normal((3, 5)).astype(np.float32)
    floats[0, :3] = [np.nan, -0.0, np.inf]
    return {"floats": floats, "routes": rng.integers(-1, 300, (2, 4, 3, 2)).astype(np.int16),
            "done": rng.random(6) < 0.5, "count": np.int32(7 + process), "empty": np.zeros((0, 3), np.float32)}


def held_across_processes() -> dict:
    """name: (value, spec over a 2 (rows) x 2 (cols) mesh whose "rows" axis spans the processes)."""
    rng = np.random.default_rng(11)
    ids = rng.integers(-1, 300, (10, 6, 3)).astype(np.int16)
    return {"rows": (ids, P("rows")), "rows_and_cols": (ids, P("rows", "cols")),
            "cols_only": (ids, P(None, "cols")),  # every row on both processes: each index owned once
            "logps": (rng.standard_normal((8, 4)).astype(np.float32), P(("rows", "cols"))),
            "done": (rng.random(4) < 0.5, P("rows"))}


def main(port: str, process: str, out: str) -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(process))
    from jax.experimental import multihost_utils

    from sharding.host_values import broadcast_from_first_process, gather_to_every_process
    mine = tree(int(process))
    ours, theirs = broadcast_from_first_process(mine), multihost_utils.broadcast_one_to_all(mine)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("rows", "cols"))
    gathered = {}
    for name, (value, spec) in held_across_processes().items():
        array = jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])
        assert not array.is_fully_addressable
        # 3 rows a chunk: several chunks, the last one partial
        gathered[f"gathered_{name}"] = gather_to_every_process(array, chunk_bytes=3 * value[0].nbytes)
        gathered[f"value_{name}"] = value
    np.savez(f"{out}.{process}.npz", **{f"ours_{k}": v for k, v in ours.items()},
             **{f"jax_{k}": np.asarray(v) for k, v in theirs.items()}, **{f"sent_{k}": v for k, v in tree(0).items()},
             **gathered)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
