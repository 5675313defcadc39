"""Attention under a context-parallel mesh: the partitioner's placement vs `sharding.context`'s shard_map, side
by side, with one device as the reference.

--layer full: one full-attention layer's flash attention (`m3jax.model.flash.flash_attention`, tiles of 128,
causal), q [B, S, H, D] and k / v [B, S, KV, D], fp32, on --devices simulated CPU devices:
  one device      jit(flash) on one device (what the mesh should divide)
  partitioner     jit(flash) with q, k, v sharded over the context axis and nothing else said (before: the
                  partitioner cannot split the scan over query tiles, so it gathers every tile everywhere)
  shard_map       `context_parallel_attention(flash)`: each device its own queries over the gathered keys
--layer sparse: one sparse layer's gathered attention (`m3jax.model.sparse.sparse_layer_attention`, the indexer's
top-4 of blocks of 64, 2 index heads of 64, one local block) on the same q, k, v:
  one device      the one-device path (`one_device_path`) on one device
  partitioner     what a mesh ran before: keys gathered by sharding constraints, the per-tile gather scan
                  over every context shard's tiles at once (its backward all-reduced dK / dV at every tile)
  shard_map       `m3jax.model.context_shards.per_context_shard`: the one-device path on each shard
Next to shard_map, the other shard assignment ("other"): for --layer full, where the model mirrors the shards
(each does the same causal work: shard c attends for the first half of its own slots and the second half of shard
n - 1 - c's, `sharding.context.mirror_second_halves`), contiguous shards (`context_balance` false: the last does
2n - 1 times the first's work); for --layer sparse, whose K blocks per query do not grow with the position and which
the model keeps contiguous, the mirrored shards. The difference shows only where the simulated devices run side
by side: with --devices at most the core count (2 here), a call waits for its busiest shard.
--layer model: the model as a whole, scripts/bench_sparse_model.py's 2-layer hidden-512 model with full attention
(flash), fwd+bwd of the next-token loss under the context mesh, as the model runs it (mirrored shards) and with
contiguous shards: ms, the ratio, and the two losses.
fwd = the output; f+b = value_and_grad of the sum over q, k, v. Median wall ms over --iters round-robin
calls after one warm-up call. The simulated devices share this machine's cores, so a perfect split of the
work shows as the one-device time (not 1/N of it), and a partitioner that computes every query tile on every
device as ~N x the one-device time divided by the cores' parallelism.

    .venv/bin/python scripts/bench_context_attention.py                       # S = 2048 4096, 4 devices
    .venv/bin/python scripts/bench_context_attention.py --seq 8192 --devices 8
    .venv/bin/python scripts/bench_context_attention.py --layer sparse
    .venv/bin/python scripts/bench_context_attention.py --devices 2 [--layer sparse]   # shard assignments
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--devices", type=int, default=4, help="simulated CPU devices = the context axis")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layer", choices=("full", "sparse", "model"), default="full")
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    import dataclasses

    import jax
    import jax.numpy as jnp

    from m3jax import tiny
    from m3jax.model import context_shards
    from m3jax.model import attention as att
    from m3jax.model.flash import flash_attention
    from m3jax.model.sparse import head_units, one_device_path, sparse_layer_attention
    from sharding.context import context_parallel_attention
    from sharding.mesh import MeshConfig, build_mesh

    if args.layer == "model":
        return model_rows(args)
    b, h, kvh, d = 1, args.heads, args.kv_heads, args.head_dim
    cfg = tiny.m3_config(num_attention_heads=h, num_key_value_heads=kvh, head_dim=d, index_n_heads=2,
                         index_head_dim=64, index_block_size=64, index_topk_blocks=4, index_local_blocks=1)

    def flash(q, k, v, positions=None, key_valid=None):
        return flash_attention(q, k, v, scale=d ** -0.5, positions=positions, key_valid=key_valid,
                               q_tile=128, k_tile=128)

    def sparse_programs(layout, positions, iq, ik, balance_sparse=False):
        """(one device, partitioner, shard_map) sparse layers of q, k, v (balance_sparse: the shard_map path
        with mirror shards sharing the queries, which the model does not do for sparse layers)."""
        units = len(head_units(h, kvh, cfg.index_n_heads)[0])
        one_path = one_device_path(cfg.index_topk_blocks, cfg.index_block_size, h // units)
        kw = dict(to_chunks=att._to_chunks, from_chunks=att._from_chunks)

        def one(q, k, v):
            return sparse_layer_attention(q, k, v, positions, None, iq, ik, cfg, path=one_path, **kw)

        def partitioner(q, k, v):
            k, v, ik_ = att.gather_keys(k, v, ik, layout)
            return sparse_layer_attention(q, k, v, positions, None, iq, ik_, cfg, path="tiles",
                                          n_ctx=layout.size("act_seq"), constrain=layout.constrain, **kw)

        def shard_map(q, k, v):  # what attention() runs for a sparse layer on "gather" under a context mesh
            attend = functools.partial(att.one_device_sparse_attention, cfg, False, layout.backend)
            return context_shards.per_context_shard(attend, layout, q, k, v, positions, None, iq, ik,
                                                    balance=balance_sparse)

        return one, partitioner, shard_map

    def timed(f, *a) -> float:
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        return (time.perf_counter() - t) * 1e3

    print(f"{args.layer} layer, B={b} H={h} KV={kvh} D={d}, fp32, {args.devices} simulated devices "
          f"({os.cpu_count()} cores)\n")
    names = ("one device", "partitioner", "shard_map", "other")
    print("| S | " + " | ".join(f"{n} {p}" for p in ("fwd", "f+b") for n in names)
          + " | shard_map vs partitioner (fwd / f+b) | shard_map vs other (fwd / f+b) |")
    print("|---" * (2 * len(names) + 3) + "|")
    for s in args.seq:
        balanced = build_mesh(MeshConfig(1, args.devices, 1, 1), seq_len=s, batch=b)
        contiguous = dataclasses.replace(balanced, context_balance=False)
        layout = balanced
        r = jax.random.split(jax.random.key(s), 3)
        q = jax.random.normal(r[0], (b, s, h, d))
        k, v = (jax.random.normal(x, (b, s, kvh, d)) for x in r[1:])
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if args.layer == "full":
            def cp(q, k, v, layout=balanced):
                return context_parallel_attention(flash, layout, q, k, v, positions, None, balance=True)

            one, partitioner, shard_map = flash, flash, cp
            other = functools.partial(cp, layout=contiguous)
        else:
            ri = jax.random.split(jax.random.key(s + 1), 2)
            iq = jax.random.normal(ri[0], (b, s, cfg.index_n_heads, cfg.index_head_dim))
            ik = jax.random.normal(ri[1], (b, s, cfg.index_head_dim))
            one, partitioner, shard_map = sparse_programs(balanced, positions, iq, ik)
            other = sparse_programs(balanced, positions, iq, ik, balance_sparse=True)[2]

        def fb(f):
            return jax.jit(jax.value_and_grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))

        seq_sharded = layout.sharding(("act_batch", "act_seq", None, None))
        placed = [jax.device_put(x, seq_sharded) for x in (q, k, v)]
        runs = {"one device": ((q, k, v), jax.jit(one), fb(one)),
                "partitioner": (placed, jax.jit(partitioner), fb(partitioner)),
                "shard_map": (placed, jax.jit(shard_map), fb(shard_map)),
                "other": (placed, jax.jit(other), fb(other))}
        times = {name: ([], []) for name in runs}
        with jax.set_mesh(layout.mesh):
            for a, fwd, grad in runs.values():
                timed(fwd, *a), timed(grad, *a)
            for _ in range(args.iters):
                for name, (a, fwd, grad) in runs.items():
                    times[name][0].append(timed(fwd, *a))
                    times[name][1].append(timed(grad, *a))
        med = {name: tuple(statistics.median(t) for t in ts) for name, ts in times.items()}
        cells = [f"{med[n][i]:.0f}" for i in (0, 1) for n in runs]
        ratio = " / ".join(f"{med['partitioner'][i] / med['shard_map'][i]:.2f}x" for i in (0, 1))
        balance = " / ".join(f"{med['other'][i] / med['shard_map'][i]:.2f}x" for i in (0, 1))
        print(f"| {s} | " + " | ".join(cells) + f" | {ratio} | {balance} |", flush=True)


def model_rows(args) -> None:
    """--layer model: the all-full bench model's fwd+bwd on the context mesh, mirrored vs contiguous shards."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import bench_sparse_model as bsm
    from m3jax import tiny
    from sharding.mesh import MeshConfig, build_mesh

    cfg = tiny.m3_config(full_attention_layers=2, **bsm.DIMS)
    print(f"all-full bench model ({bsm.DIMS}), fwd+bwd, {args.devices} simulated devices ({os.cpu_count()} cores)\n")
    print("| S | mirrored ms | contiguous ms | mirrored vs contiguous | loss mirrored / contiguous |")
    print("|---|---|---|---|---|")
    for s in args.seq:
        ids = jnp.asarray(tiny.random_ids(cfg, 1, s, seed=1))
        steps = {}
        for name, balance in (("mirrored", True), ("contiguous", False)):
            layout = build_mesh(MeshConfig(1, args.devices, 1, 1, context_balance=balance), seq_len=s, batch=1)
            graphdef, params, rest = nnx.split(tiny.m3_model(cfg, seed=0, layout=layout, remat=False), nnx.Param, ...)

            def loss(params, ids, graphdef=graphdef, rest=rest):
                logp = jax.nn.log_softmax(nnx.merge(graphdef, params, rest)(ids)[:, :-1].astype(jnp.float32), -1)
                return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()

            with jax.set_mesh(layout.mesh):
                step = jax.jit(jax.value_and_grad(loss)).lower(params, ids).compile()
            steps[name] = (step, params, float(jax.block_until_ready(step(params, ids))[0]))
        times = {name: [] for name in steps}
        for _ in range(args.iters):
            for name, (step, params, _) in steps.items():
                t = time.perf_counter()
                jax.block_until_ready(step(params, ids))
                times[name].append((time.perf_counter() - t) * 1e3)
        m, c = (statistics.median(times[n]) for n in ("mirrored", "contiguous"))
        print(f"| {s} | {m:.0f} | {c:.0f} | {c / m:.2f}x | {steps['mirrored'][2]:.6f} / {steps['contiguous'][2]:.6f} |",
              flush=True)


if __name__ == "__main__":
    main()
