"""MoE expert computation on a mostly-empty receive pool: kernels ragged_dot vs tiled vs bucketed, one run.

An expert-parallel device's dropless receive buffer (`sharding.expert.receive_rows`) holds N rows of
which only R are filled (the rest is padding, zeros); the rows are grouped by the device's E_loc local
experts. `m3jax.model.moe.grouped_experts` (gate/up grouped matmul, SwiGLU-OAI, down grouped matmul)
runs on that buffer with each kernel of `sharding.grouped_matmul`:

    ragged_dot  jax.lax.ragged_dot_general; XLA:CPU multiplies E_loc x N rows (dense masked lowering)
    tiled       a loop over (row tile, expert) segments that stops after the filled rows:
                ~ R + tile x (E_loc - 1) rows
    bucketed    each expert's first R / E_loc rows in one batched matmul, the rest through the tiled walk
                (the kernel is told the balanced rows per expert, as `sharding.expert.routed_experts` does)

Timed, per pool size N = pool x R: the forward, and forward+backward (jit(value_and_grad) of
sum(out * cotangent) w.r.t. rows, gate_up and down). Each program is compiled first (not timed); then
--iters rounds run every (kernel, program) once, round-robin, so load from other processes on a shared
machine hits both kernels alike; median ms and ratio ragged_dot / tiled of the medians (> 1: tiled is
faster). Values and all three gradients of each kernel are checked against ragged_dot (max relative error).
--skew: expert loads drawn from a Dirichlet with this concentration (0 = uniform multinomial; 1 = the
skew of a random tiny model's router, max / mean ~2.5).
The 1-minute load average is printed: the machine may be shared.

    .venv/bin/python scripts/bench_grouped_matmul.py                      # pools 1x and 16x the real rows
    .venv/bin/python scripts/bench_grouped_matmul.py --pools 16 32 --real-rows 2048 --experts 8
    .venv/bin/python scripts/bench_grouped_matmul.py --pools 1 --experts 8 --hidden 64 --inter 32 --skew 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from m3jax.model.moe import grouped_experts  # noqa: E402

KERNELS = ("ragged_dot", "tiled", "bucketed")


def make_case(real_rows: int, pool: int, experts: int, d: int, inter: int, skew: float = 0.0, seed: int = 0):
    """A receive buffer of pool * R rows, the first R filled and grouped by expert (multinomial sizes
    around a balanced load, or Dirichlet(skew) loads), M3's SwiGLU-OAI expert weights, and a cotangent."""
    rng = np.random.default_rng(seed)
    n = pool * real_rows
    load = rng.dirichlet(np.full(experts, skew)) if skew > 0 else np.ones(experts) / experts
    sizes = rng.multinomial(real_rows, load).astype(np.int32)
    rows = np.zeros((n, d), np.float32)
    rows[:real_rows] = rng.normal(size=(real_rows, d))
    gate_up = rng.normal(size=(experts, 2, inter, d)) / np.sqrt(d)
    down = rng.normal(size=(experts, d, inter)) / np.sqrt(inter)
    cot = rng.normal(size=(n, d))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return f32(rows), jnp.asarray(sizes), f32(gate_up), f32(down), f32(cot)


def programs(kernel: str, sizes, cot, expected_rows: float):
    expert = lambda r, gu, dn: grouped_experts(r, sizes, gu, dn, alpha=1.702, limit=7.0, kernel=kernel,  # noqa: E731
                                               expected_rows=expected_rows)
    fwd = jax.jit(expert)
    grad = jax.jit(jax.value_and_grad(lambda r, gu, dn: jnp.sum(expert(r, gu, dn) * cot), argnums=(0, 1, 2)))
    return {"forward": fwd, "forward+backward": grad}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def bench(real_rows: int, pool: int, experts: int, d: int, inter: int, iters: int, warmup: int,
          skew: float = 0.0) -> dict:
    rows, sizes, gate_up, down, cot = make_case(real_rows, pool, experts, d, inter, skew)
    args = (rows, gate_up, down)
    progs = {k: programs(k, sizes, cot, real_rows / experts) for k in KERNELS}
    compile_s, results = {}, {}
    for k, ps in progs.items():
        for name, p in ps.items():
            t0 = time.perf_counter()
            results[k, name] = jax.block_until_ready(p(*args))
            compile_s[k, name] = time.perf_counter() - t0
    want_val, (_, want_g) = results["ragged_dot", "forward"], results["ragged_dot", "forward+backward"]
    errors = {}
    for k in KERNELS[1:]:
        got_g = results[k, "forward+backward"][1]
        errors[k] = {"value": rel(results[k, "forward"], want_val),
                     **{f"d_{n}": rel(g, w) for n, g, w in zip(("rows", "gate_up", "down"), got_g, want_g)}}
    times: dict = {key: [] for key in progs_keys(progs)}
    for i in range(warmup + iters):
        for (k, name) in times:
            t0 = time.perf_counter()
            jax.block_until_ready(progs[k][name](*args))
            if i >= warmup:
                times[k, name].append(time.perf_counter() - t0)
    return {"ms": {key: 1e3 * statistics.median(v) for key, v in times.items()}, "errors": errors,
            "compile_s": compile_s, "n": pool * real_rows, "sizes": np.asarray(sizes)}


def progs_keys(progs):
    return [(k, name) for k in progs for name in progs[k]]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real-rows", type=int, default=1024, help="filled rows R (tokens x top_k arriving)")
    ap.add_argument("--pools", type=int, nargs="+", default=[1, 16], help="receive pool sizes, x R")
    ap.add_argument("--experts", type=int, default=4, help="local experts E_loc")
    ap.add_argument("--hidden", type=int, default=256, help="d")
    ap.add_argument("--inter", type=int, default=256, help="expert intermediate size I")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--skew", type=float, default=0.0,
                    help="Dirichlet concentration of the expert loads (0: uniform multinomial)")
    a = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs, 1-min load average "
          f"{os.getloadavg()[0]:.2f}; R={a.real_rows} filled rows, E_loc={a.experts}, d={a.hidden}, I={a.inter}, "
          f"fp32, median of {a.iters}")
    print(f"{'pool (N)':>9s} {'program':>17s} {'ragged_dot ms':>14s} {'tiled ms':>9s} {'bucketed ms':>12s} "
          f"{'rd/tiled':>9s} {'rd/bucketed':>12s}   max rel error vs ragged_dot (tiled; bucketed)")
    for pool in a.pools:
        r = bench(a.real_rows, pool, a.experts, a.hidden, a.inter, a.iters, a.warmup, a.skew)
        if pool == a.pools[0]:
            print(f"rows per expert: {r['sizes'].tolist()}")
        for name in ("forward", "forward+backward"):
            rd, tl, bk = (r["ms"][k, name] for k in KERNELS)
            keys = ("value",) if name == "forward" else ("d_rows", "d_gate_up", "d_down")
            err = "; ".join(" ".join(f"{key} {r['errors'][k][key]:.1e}" for key in keys) for k in KERNELS[1:])
            label = f"{pool}x ({r['n']})"
            print(f"{label:>9s} {name:>17s} {rd:14.1f} {tl:9.1f} {bk:12.1f} {rd / tl:8.1f}x {rd / bk:11.1f}x   {err}")
    print(f"1-min load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
