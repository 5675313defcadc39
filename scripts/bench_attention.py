"""One attention layer, dense (the model's masked [S, S] scores path) vs flash (m3jax.model.flash), side by side.

Shapes: B=1, H=8 query heads, KV=1, head_dim 128, fp32: the per-device slice of an M3 layer at tensor=8
(64 query heads / 8; the release's 4 kv heads do not split 8 ways, so each device holds one). Two masks:
  full    causal
  sparse  causal AND a block mask like the indexer's: blocks of 64 keys, each query keeps its own block
          plus 4 earlier ones (random, fixed per 64-query tile), so ~5 x 64 keys per query
Per S and mask: forward and forward+backward (grads of q, k, v) median wall ms, and the compiled temp
memory (`jax.jit(f).lower(..).compile().memory_analysis().temp_size_in_bytes`) of both. Timings are
round-robin over the contestants (load from other processes hits them alike); above --time-max the dense
path compiles only (memory: its fp32 [H, S, S] scores alone are 8.6 GB at 16k) and flash is timed once.
The 1-minute load average is printed: on a shared machine the absolute times move, the ratios less.

    .venv/bin/python scripts/bench_attention.py                       # S = 1024 4096 16384 (16384: no dense time)
    .venv/bin/python scripts/bench_attention.py --seq 1024 --iters 3
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

from m3jax.model.attention import causal_keep, gqa_attention  # noqa: E402
from m3jax.model.flash import flash_attention  # noqa: E402
from m3jax.model.indexer import block_mask_to_tokens  # noqa: E402

H, KV, D, BS, TOPK = 8, 1, 128, 64, 4


def block_mask(s: int, seed: int = 0) -> np.ndarray:
    """[1, 1, S, nb]: each query's own block and TOPK earlier blocks (random, shared by its 64-query tile)."""
    nb = -(-s // BS)
    r = np.random.default_rng(seed)
    m = np.zeros((1, 1, s, nb), bool)
    for t in range(nb):
        rows = slice(t * BS, (t + 1) * BS)
        m[0, 0, rows, t] = True
        if t:
            m[0, 0, rows, r.choice(t, size=min(TOPK, t), replace=False)] = True
    return m


def contestants(sparse: bool):
    """f(q, k, v, positions, block_mask) of each path (masks are arguments, not constants to fold)."""

    def dense(q, k, v, pos, bm):
        keep = causal_keep(pos, None, k.shape[1])
        if sparse:
            keep = keep & block_mask_to_tokens(bm, BS, k.shape[1], H)
        return gqa_attention(q, k, v, keep, D ** -0.5)

    def flash(q, k, v, pos, bm):
        tile = BS if sparse else 128
        return flash_attention(q, k, v, scale=D ** -0.5, positions=pos, block_mask=bm if sparse else None,
                               block_size=BS, q_tile=tile, k_tile=tile)

    return {"dense": dense, "flash": flash}


def fwd_bwd(f):
    def loss(q, k, v, pos, bm):
        return jnp.sum(f(q, k, v, pos, bm) * 1e-3)
    return jax.grad(loss, argnums=(0, 1, 2))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--time-max", type=int, default=4096, help="longest S at which dense is timed")
    ap.add_argument("--flash-time-max", type=int, default=16384,
                    help="longest S at which flash is timed (above --time-max: one timed call, no warm-up)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    print(f"jax {jax.__version__} ({jax.default_backend()}), cpus {len(os.sched_getaffinity(0))}; "
          f"B=1 H={H} KV={KV} D={D} fp32; sparse: blocks of {BS}, own + {TOPK} earlier per query")
    load0 = os.getloadavg()
    hdr = (f"{'S':>6} {'mask':<6} | {'dense fwd':>9} {'flash fwd':>9} {'x':>5} | {'dense f+b':>9} {'flash f+b':>9} "
           f"{'x':>5} | {'dense temp':>11} {'flash temp':>11} {'f+b dense':>11} {'f+b flash':>11}")
    print(hdr + "\n" + "-" * len(hdr))
    r = np.random.default_rng(0)
    for s in args.seq:
        q = jnp.asarray(r.normal(size=(1, s, H, D)), jnp.float32)
        k = jnp.asarray(r.normal(size=(1, s, KV, D)), jnp.float32)
        v = jnp.asarray(r.normal(size=(1, s, KV, D)), jnp.float32)
        pos = jnp.arange(s, dtype=jnp.int32)[None]
        bm = jnp.asarray(block_mask(s))
        xs = (q, k, v, pos, bm)
        for sparse in (False, True):
            fns = contestants(sparse)
            compiled, mem = {}, {}
            for name, f in fns.items():
                for kind, g in (("fwd", f), ("f+b", fwd_bwd(f))):
                    c = jax.jit(g).lower(*xs).compile()
                    compiled[name, kind] = c
                    mem[name, kind] = c.memory_analysis().temp_size_in_bytes
            times = {key: [] for key in compiled}
            if s <= args.time_max:
                outs = {key: jax.block_until_ready(c(*xs)) for key, c in compiled.items()}  # warm-up
                for name in ("fwd", "f+b"):
                    a, b = outs["dense", name], outs["flash", name]
                    err = max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
                              for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(a)))
                    assert err < 1e-4, (s, sparse, name, err)
            timed = [key for key in compiled if s <= (args.time_max if key[0] == "dense" else args.flash_time_max)]
            for _ in range(args.iters if s <= args.time_max else min(args.iters, 1)):
                for key in timed:
                    t0 = time.perf_counter()
                    jax.block_until_ready(compiled[key](*xs))
                    times[key].append(time.perf_counter() - t0)
            med = {key: statistics.median(t) * 1e3 if t else float("nan") for key, t in times.items()}

            def ms(x):
                return f"{x:9.1f}" if x == x else f"{'-':>9}"

            def ratio(a, b):
                return f"{a / b:5.1f}" if a == a else f"{'-':>5}"

            print(f"{s:>6} {'sparse' if sparse else 'full':<6} | {ms(med['dense', 'fwd'])} {ms(med['flash', 'fwd'])} "
                  f"{ratio(med['dense', 'fwd'], med['flash', 'fwd'])} | {ms(med['dense', 'f+b'])} "
                  f"{ms(med['flash', 'f+b'])} {ratio(med['dense', 'f+b'], med['flash', 'f+b'])} | "
                  + " ".join(f"{mem[key] / 2**20:9.1f}MB" for key in
                             (("dense", "fwd"), ("flash", "fwd"), ("dense", "f+b"), ("flash", "f+b"))),
                  flush=True)
    load1 = os.getloadavg()
    print("\nmedian ms per call (x = dense / flash, > 1: flash faster; '-': not timed, compile only); temp = "
          "XLA's compiled temporary buffers (MB, 2^20 bytes) of fwd and of fwd+bwd.\n"
          f"load average (1 min) at start / end: {load0[0]:.2f} / {load1[0]:.2f}")


if __name__ == "__main__":
    main()
