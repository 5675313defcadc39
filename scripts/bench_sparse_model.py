"""A 2-layer all-sparse M3 vs the same model with full attention, side by side: forward, forward+backward
and compiled temp memory at long S.

Model (m3jax.tiny.m3_config): 2 layers, dense MLPs (to isolate attention), hidden 512, 8 query heads of
128, 2 kv heads, vocab 512, fp32; the sparse model's indexer: 2 index heads of 64, blocks of 64, top-4
(the query's own block forced among them, HF's `index_local_blocks` = 1), so each query keeps <= 256 keys.
Contestants (each its own jit, same input ids):
  sparse gather   sparse layers, `model.sparse_attention: gather` (the default: only the kept blocks)
  sparse masked   sparse layers, `masked` on dense attention (the indexer's selection as a mask; before
                  issue 11 item 3 the only path) -- timed up to --dense-max
  full flash      full-attention layers, `attention_impl: flash` (causal online softmax, no [S, S] block; what
                  the default `auto` runs from 512 keys on)
  full dense      full-attention layers, `attention_impl: dense` (masked [S, S] scores; the default before
                  `auto`) -- up to --dense-max
fwd = logits of the batch; f+b = value_and_grad of the mean logit over all parameters (remat on, the
model's default). Median wall ms over --iters round-robin calls (load from other processes hits all alike),
after one warm-up call; temp = `jit(f).lower(..).compile().memory_analysis().temp_size_in_bytes`.

    .venv/bin/python scripts/bench_sparse_model.py                   # S = 4096 16384
    .venv/bin/python scripts/bench_sparse_model.py --seq 1024 --iters 2
    .venv/bin/python scripts/bench_sparse_model.py --selection --seq 4096 16384   # the indexer alone, per tiling
    .venv/bin/python scripts/bench_sparse_model.py --one-device-paths --seq 256 1024 4096
    .venv/bin/python scripts/bench_sparse_model.py --short --seq 128 256 --iters 10

--one-device-paths times the sparse model's gather paths forced on one device side by side: `grouped_block_attention`
(sorted (query, block) pairs through the tiled grouped matmul), `slot_block_attention` (each query's blocks gathered,
batched matmuls; `one_device_path` picks one of these two by the shape) and the per-tile gathers of any mesh, for this
model's shape and for the tiny release_like shape (hidden 64, 4 heads of 16, 2 kv heads, 2 index heads, blocks of 8,
top-2, batch 2).

--short: sequences of at most index_topk_blocks * index_block_size = 256 keys, where the indexer keeps every block a
query can see and the sparse layers run as full layers (`m3jax.model.attention.sees_every_block`), against the same
model made to select: the indexer's own ids replayed (`block_ids`: every visible block), so that the layers take the
gather path. The replayed run skips the indexer's scoring and top-k, which the model ran here before: the ratio is a
lower bound on what running them as full layers saves. Values are checked equal.

--selection times only one sparse layer's block selection (`m3jax.model.sparse.select_blocks`, 2 index heads of
64, the model's block size and top-K) for key chunks of (8, 16, 32) blocks x query tiles of (64, 128, 256).
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
from flax import nnx  # noqa: E402

from m3jax import tiny  # noqa: E402
from m3jax.model.sparse import head_units  # noqa: E402

DIMS = dict(layers=2, dense_layers=2, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
            dense_intermediate_size=1024, vocab_size=512, index_n_heads=2, index_head_dim=64, index_block_size=64,
            index_topk_blocks=4, index_local_blocks=1)


def build(name: str):
    sparse = name.startswith("sparse")
    cfg = tiny.m3_config(full_attention_layers=0 if sparse else 2, **DIMS)
    options = {"sparse gather": dict(sparse_attention="gather"),
               "sparse masked": dict(sparse_attention="masked", attention_impl="dense"),
               "full flash": dict(attention_impl="flash"), "full dense": dict(attention_impl="dense")}[name]
    return tiny.m3_model(cfg, seed=0, **options)


def programs(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def fwd(params, ids):
        return nnx.merge(graphdef, params, rest)(ids)

    def loss(params, ids):
        return fwd(params, ids).astype(jnp.float32).mean()

    return params, jax.jit(fwd), jax.jit(jax.value_and_grad(loss))


def temp_mb(f, *args) -> float:
    return f.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2 ** 20


def timed(f, *args) -> float:
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    return (time.perf_counter() - t) * 1e3


def selection(seqs, iters: int):
    """Median ms of the indexer's block selection per (key chunk blocks, query tile)."""
    from m3jax.model import attention, indexer, sparse

    cfg = tiny.m3_config(full_attention_layers=0, **DIMS)
    print("| S | key chunk (blocks) | query tile | selection ms |\n|---|---|---|---|")
    for s in seqs:
        k1, k2 = jax.random.split(jax.random.key(0))
        iq = jax.random.normal(k1, (1, s, cfg.index_n_heads, cfg.index_head_dim))
        ik = jax.random.normal(k2, (1, s, cfg.index_head_dim))
        pos = jnp.arange(s)[None]
        for chunk in (8, 16, 32):
            for tile in (64, 128, 256):
                indexer.KEY_CHUNK_BLOCKS = chunk  # read at trace time: each jit below traces afresh
                f = jax.jit(lambda iq, ik, tile=tile: sparse.select_blocks(
                    iq, ik, pos, cfg, to_chunks=attention._to_chunks, from_chunks=attention._from_chunks, tile=tile))
                timed(f, iq, ik)
                ms = statistics.median(timed(f, iq, ik) for _ in range(iters))
                print(f"| {s} | {chunk} | {tile} | {ms:.1f} |", flush=True)


TINY_DIMS = dict(layers=2, dense_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 dense_intermediate_size=96, vocab_size=256, index_n_heads=2, index_head_dim=16, index_block_size=8,
                 index_topk_blocks=2, index_local_blocks=1)


def one_device_paths(seqs, iters: int):
    """Median ms of the sparse model with each one-device gather path forced."""
    from m3jax.model import attention

    real = attention.one_device_path
    paths = ("grouped", "slots", "tiles")
    print("| shape (rows a block) | S | " + " | ".join(f"{p} fwd" for p in paths) + " | "
          + " | ".join(f"{p} f+b" for p in paths) + " |")
    print("|---|---|" + "---|" * 2 * len(paths))
    for shape, dims, batch in (("bench", DIMS, 1), ("tiny release_like", TINY_DIMS, 2)):
        cfg = tiny.m3_config(full_attention_layers=0, **dims)
        g = cfg.num_attention_heads // len(head_units(cfg.num_attention_heads, cfg.num_key_value_heads,
                                                      cfg.index_n_heads)[0])
        rows = cfg.index_topk_blocks * cfg.index_block_size * g
        pick = real(cfg.index_topk_blocks, cfg.index_block_size, g)
        for s in seqs:
            ids = jnp.asarray(tiny.random_ids(cfg, batch, s))
            runs = {}
            for path in paths:  # read at trace time; "tiles" is what a mesh runs
                attention.one_device_path = lambda *a, path=path: path
                params, fwd, fb = programs(tiny.m3_model(cfg, seed=0))
                timed(fwd, params, ids), timed(fb, params, ids)  # compile + warm
                runs[path] = (params, fwd, fb)
            attention.one_device_path = real
            times = {p: ([], []) for p in runs}
            for _ in range(iters):
                for p, (params, fwd, fb) in runs.items():
                    times[p][0].append(timed(fwd, params, ids))
                    times[p][1].append(timed(fb, params, ids))
            med = {p: [statistics.median(t) for t in ts] for p, ts in times.items()}
            print(f"| {shape} ({rows}: {pick}) | {s} | "
                  + " | ".join(f"{med[p][0]:.1f}" for p in paths) + " | "
                  + " | ".join(f"{med[p][1]:.1f}" for p in paths) + " |", flush=True)


def short(seqs, iters: int):
    """The sparse model over <= K * bs keys as it runs (full layers) vs made to select (replayed ids: gathers)."""
    cfg = tiny.m3_config(full_attention_layers=0, **DIMS)
    model = build("sparse gather")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    run = lambda p, ids, block_ids=None: nnx.merge(graphdef, p, rest)(ids, block_ids=block_ids)  # noqa: E731
    loss = lambda p, ids, block_ids=None: run(p, ids, block_ids).astype(jnp.float32).mean()  # noqa: E731
    fwd, fb = jax.jit(run), jax.jit(jax.value_and_grad(loss))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, load {os.getloadavg()[0]:.1f}; "
          f"K * bs = {cfg.index_topk_blocks * cfg.index_block_size} keys")
    print("| S | as full layers fwd ms | selecting fwd ms | ratio | as full f+b ms | selecting f+b ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for s in seqs:
        ids = jnp.asarray(tiny.random_ids(cfg, 1, s))
        _, block_ids = jax.jit(lambda p, ids: nnx.merge(graphdef, p, rest)(ids, return_block_ids=True))(params, ids)
        a, b = fwd(params, ids), fwd(params, ids, block_ids)
        err = float(jnp.abs(a - b).max() / jnp.abs(b).max())
        assert err < 1e-5, err
        timed(fb, params, ids), timed(fb, params, ids, block_ids)  # compile + warm
        t = {k: [] for k in ("full fwd", "sel fwd", "full fb", "sel fb")}
        for _ in range(iters):
            t["full fwd"].append(timed(fwd, params, ids))
            t["sel fwd"].append(timed(fwd, params, ids, block_ids))
            t["full fb"].append(timed(fb, params, ids))
            t["sel fb"].append(timed(fb, params, ids, block_ids))
        m = {k: statistics.median(v) for k, v in t.items()}
        print(f"| {s} | {m['full fwd']:.1f} | {m['sel fwd']:.1f} | {m['sel fwd'] / m['full fwd']:.2f}x | "
              f"{m['full fb']:.1f} | {m['sel fb']:.1f} | {m['sel fb'] / m['full fb']:.2f}x |  (max rel diff {err:.1e})",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dense-max", type=int, default=4096, help="longest S at which the dense paths run")
    ap.add_argument("--selection", action="store_true", help="time the indexer's block selection per tiling")
    ap.add_argument("--one-device-paths", action="store_true", help="time the grouped and per-tile gather paths")
    ap.add_argument("--short", action="store_true", help="sequences the indexer keeps whole: full layers vs selecting")
    args = ap.parse_args()
    if args.short:
        return short(args.seq, args.iters)
    if args.selection:
        return selection(args.seq, args.iters)
    if args.one_device_paths:
        return one_device_paths(args.seq, args.iters)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, load {os.getloadavg()[0]:.1f}")
    print("| S | contestant | fwd ms | f+b ms | fwd temp MB | f+b temp MB |")
    print("|---|---|---|---|---|---|")
    for s in args.seq:
        names = ["sparse gather", "full flash"] + (["sparse masked", "full dense"] if s <= args.dense_max else [])
        ids = jnp.asarray(tiny.random_ids(tiny.m3_config(**DIMS), 1, s))
        runs = {}
        for name in names:
            params, fwd, fb = programs(build(name))
            runs[name] = (params, fwd, fb, temp_mb(fwd, params, ids), temp_mb(fb, params, ids))
            timed(fwd, params, ids), timed(fb, params, ids)  # compile + warm
        times = {n: ([], []) for n in names}
        for _ in range(args.iters):
            for n in names:
                params, fwd, fb = runs[n][:3]
                times[n][0].append(timed(fwd, params, ids))
                times[n][1].append(timed(fb, params, ids))
        med = {n: (statistics.median(a), statistics.median(b)) for n, (a, b) in times.items()}
        for n in names:
            print(f"| {s} | {n} | {med[n][0]:.1f} | {med[n][1]:.1f} | {runs[n][3]:.1f} | {runs[n][4]:.1f} |")
        g, f = med["sparse gather"], med["full flash"]
        line = f"S={s}: sparse gather vs full flash: fwd {f[0] / g[0]:.2f}x, f+b {f[1] / g[1]:.2f}x"
        if "full dense" in med:
            d, m = med["full dense"], med["sparse masked"]
            line += (f"; vs full dense: fwd {d[0] / g[0]:.2f}x, f+b {d[1] / g[1]:.2f}x; sparse masked vs full dense "
                     f"fwd {d[0] / m[0]:.2f}x")
        print(line, f"(load {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
