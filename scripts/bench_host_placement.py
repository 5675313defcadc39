"""Host values on a mesh that spans processes, side by side in one two-process CPU job (jax.distributed on this
machine, 4 simulated devices per process): jax.device_put against `sharding.host_values.place_host_value`, and jax's
broadcast_one_to_all against `sharding.host_values.broadcast_from_first_process`.

A batch leaf (int32 [rows, positions], cut over the rows by the 8 devices) is placed --iters times each way, after one
untimed call each (jax.device_put compiles its cross-host check there); reported: median ms per placement on process
0 and device_put / place_host_value. jax.device_put of a host value over several processes first gathers the whole value
from every process onto every process (`multihost_utils.assert_equal`), so its cost grows with the process count; the
other copies only this process's slices. Also printed: what an Adam moment of a cut [n, n] fp32 weight holds on device
0 when made with jnp.zeros(shape) (the code before cf247e0: whole, on jax's default device) and with jnp.zeros_like
(the parameter's shards).
Process 0's int16 [rows, positions, 8] (a rollout's routes) is shared with the other process --iters times each way,
after one untimed call each; reported: median ms on process 0 and the ratio. jax's sums a copy on each of a process's
devices; the other, on one device per process.
An int16 [rows, positions, 8] cut over both processes' rows (the JAX engine's routes) is read whole on each process
--iters times each way: replicated by a jitted identity and read from one device (the engine before 32f6174), and by
`gather_to_every_process` in --chunk-mb chunks; reported: median ms and what a device holds meanwhile.

    .venv/bin/python scripts/bench_host_placement.py                       # [512, 8192] int32, 20 iterations
    .venv/bin/python scripts/bench_host_placement.py --rows 64 --positions 1024
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed_side_by_side(ways: dict, run, iters: int) -> dict:
    """Seconds of `run(way)` for each way, --iters rounds interleaved, after one untimed call of each (its compile)."""
    for way in ways.values():
        run(way)
    times = {name: [] for name in ways}
    for _ in range(iters):
        for name, way in ways.items():
            t = time.perf_counter()
            run(way)
            times[name].append(time.perf_counter() - t)
    return times


def worker(port: int, process: int, rows: int, positions: int, iters: int, n: int, chunk_mb: int) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sharding.cpu_threads import reserve_collective_threads
    reserve_collective_threads(os.environ)
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process)
    from sharding.host_values import place_host_value

    mesh = jax.make_mesh((8,), ("data",))
    rows_cut = NamedSharding(mesh, P("data"))
    batch = np.random.default_rng(0).integers(0, 200_000, (rows, positions), dtype=np.int32)  # the same on each host
    times = timed_side_by_side({"device_put": jax.device_put, "place_host_value": place_host_value},
                               lambda put: put(batch, rows_cut).block_until_ready(), iters)
    from jax.experimental import multihost_utils

    from sharding.host_values import broadcast_from_first_process
    routes = np.random.default_rng(process).integers(0, 256, (rows, positions, 8), dtype=np.int16)  # 8 layers x k 1
    shares = {"broadcast_one_to_all": multihost_utils.broadcast_one_to_all,
              "broadcast_from_first_process": broadcast_from_first_process}
    shared = timed_side_by_side(shares, lambda share: share(routes), iters)
    from sharding.host_values import gather_to_every_process
    everyones = np.random.default_rng(0).integers(0, 256, (rows, positions, 8), dtype=np.int16)  # the same on each
    held = jax.make_array_from_callback(everyones.shape, rows_cut, lambda index: everyones[index])
    replicate = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))
    reads = {"replicated": lambda: np.asarray(replicate(held).addressable_data(0)),  # the JAX engine before 32f6174
             "gather_to_every_process": lambda: gather_to_every_process(held, chunk_bytes=chunk_mb << 20)}
    assert all(np.array_equal(read(), everyones) for read in reads.values())
    read = timed_side_by_side(reads, lambda way: way(), iters)
    weight = jax.device_put(np.ones((n, n), np.float32), NamedSharding(mesh, P("data")))
    device0 = jax.local_devices()[0]

    def on_device0(x):
        return sum(s.data.nbytes for s in x.addressable_shards if s.device == device0)
    whole, cut = jnp.zeros(weight.shape, jnp.float32), jnp.zeros_like(weight, jnp.float32)
    if process == 0:
        mb = rows * positions * 4 / 2**20
        put_ms, own_ms = (statistics.median(times[k]) * 1e3 for k in ("device_put", "place_host_value"))
        print(f"batch leaf int32 [{rows}, {positions}] ({mb:.1f} MiB), 2 processes x 4 devices, {iters} iterations")
        print(f"  jax.device_put       {put_ms:9.1f} ms (min {min(times['device_put']) * 1e3:.1f})")
        print(f"  place_host_value     {own_ms:9.1f} ms (min {min(times['place_host_value']) * 1e3:.1f})")
        print(f"  device_put / place_host_value: {put_ms / own_ms:.1f}x")
        jax_ms, own_ms = (statistics.median(shared[k]) * 1e3 for k in shares)
        print(f"process 0's int16 [{rows}, {positions}, 8] ({routes.nbytes / 2**20:.1f} MiB) to both processes, "
              f"{iters} iterations")
        print(f"  broadcast_one_to_all          {jax_ms:9.1f} ms (min {min(shared['broadcast_one_to_all']) * 1e3:.1f})")
        print(f"  broadcast_from_first_process  {own_ms:9.1f} ms (min "
              f"{min(shared['broadcast_from_first_process']) * 1e3:.1f})")
        print(f"  broadcast_one_to_all / broadcast_from_first_process: {jax_ms / own_ms:.1f}x")
        rep_ms, own_ms = (statistics.median(read[k]) * 1e3 for k in reads)
        mib = everyones.nbytes / 2**20
        print(f"an int16 [{rows}, {positions}, 8] ({mib:.1f} MiB) cut over both processes' rows, read whole on "
              f"each (the JAX engine's routes), {iters} iterations")
        print(f"  replicated, then read        {rep_ms:9.1f} ms (min {min(read['replicated']) * 1e3:.1f}); "
              f"held on every device: {mib:.1f} MiB")
        fastest = min(read["gather_to_every_process"]) * 1e3
        print(f"  gather_to_every_process      {own_ms:9.1f} ms (min {fastest:.1f}); held on one device per process: "
              f"2 chunks of at most {min(chunk_mb, mib):.1f} MiB")
        print(f"  replicated / gather_to_every_process: {rep_ms / own_ms:.2f}x")
        print(f"Adam moment of a cut fp32 [{n}, {n}] weight, bytes on device 0: jnp.zeros(shape) {on_device0(whole):,} "
              f"(committed {whole.committed}), jnp.zeros_like {on_device0(cut):,} (committed {cut.committed})")
    jax.distributed.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--positions", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--n", type=int, default=4096, help="the cut weight's side, for the moments line")
    ap.add_argument("--chunk-mb", type=int, default=16, help="gather_to_every_process's chunk, for the gather line")
    ap.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)  # port, process
    a = ap.parse_args()
    if a.worker:
        return worker(*a.worker, a.rows, a.positions, a.iters, a.n, a.chunk_mb)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = ["--rows", str(a.rows), "--positions", str(a.positions), "--iters", str(a.iters), "--n", str(a.n),
            "--chunk-mb", str(a.chunk_mb)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *args, "--worker", str(port), str(i)],
                              env=env, stdout=None if i == 0 else subprocess.DEVNULL) for i in range(2)]
    load = os.getloadavg()[0]
    rc = [p.wait() for p in procs]
    print(f"load average (1 min) at the start: {load:.2f}; exit statuses {rc}")
    sys.exit(max(rc))


if __name__ == "__main__":
    main()
