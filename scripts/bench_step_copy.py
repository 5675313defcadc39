"""Where a sharded train step's collectives run, with and without the step's copy of the weights
(`mesh.fsdp_step_axes`), side by side in one process.

A tiny M3 (full + sparse layers, dense + MoE MLPs, --hidden wide) trains one SGD step of --micro micro-batches on
data 2 x context 4 simulated CPU devices, FSDP over (context, data), experts over both:
  plain      fsdp_axes [context, data]: every micro-batch gathers each weight over data x context
  step copy  the same with fsdp_step_axes [data]: one gather over data per step, the micro-batches over context
For each, the compiled step's collectives (`sharding.hlo_collectives`) are summed by (op, mesh axes, inside a
loop or not): bytes are each op's result size once, not times its trip count; inside the micro-batch scan a
loop op runs --micro times per step (and once per layer of a layer scan). Then the wall time of the step (median
of --iters after one warm-up) and the largest difference of the two updates. On one machine's cores the
"network" is memcpy: the wall time says the copy costs nothing here, not what it saves across nodes.

    .venv/bin/python scripts/bench_step_copy.py
    .venv/bin/python scripts/bench_step_copy.py --hidden 512 --micro 8
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from m3jax import tiny
    from sharding import precision
    from sharding.hlo_collectives import bytes_by_kind, collectives
    from sharding.mesh import MeshConfig, build_mesh
    from sharding.train_step import init_state, make_train_step, state_shardings

    cfg = tiny.m3_config(layers=4, hidden_size=args.hidden, num_attention_heads=4, head_dim=args.hidden // 4,
                         intermediate_size=args.hidden // 2, dense_intermediate_size=2 * args.hidden,
                         vocab_size=1024, index_block_size=8, index_topk_blocks=2)
    rows = 4
    ids = tiny.random_ids(cfg, args.micro * rows, args.seq + 1, seed=0).reshape(args.micro, rows, args.seq + 1)
    batch = {"input_ids": jnp.asarray(ids[..., :-1]), "targets": jnp.asarray(ids[..., 1:]),
             "loss_mask": jnp.ones((args.micro, rows, args.seq), jnp.float32)}
    opt = precision.with_master_weights(optax.sgd(1e-3), "none")
    layouts = {"plain": MeshConfig(2, 4, 1, 1, expert_axes=("data", "context"), fsdp_axes=("context", "data")),
               "step copy": MeshConfig(2, 4, 1, 1, expert_axes=("data", "context"), fsdp_axes=("context", "data"),
                                       fsdp_step_axes=("data",))}
    updates, times, sums = {}, {}, {}
    for name, mesh_cfg in layouts.items():
        layout = build_mesh(mesh_cfg, cfg, seq_len=args.seq, batch=rows)
        model = tiny.m3_model(cfg, seed=1, layout=layout)
        graphdef, state = init_state(model, opt)
        shardings = state_shardings(layout, state)
        state = jax.device_put(state, shardings)
        step = make_train_step(graphdef, opt, mesh=layout, shardings=shardings, donate=False)
        placed = {k: jax.device_put(v, NamedSharding(layout.mesh, P(None, ("data", "expert"), "context")))
                  for k, v in batch.items()}
        with jax.set_mesh(layout.mesh):
            hlo = step.jitted.lower(state, placed).compile().as_text()
        sums[name] = collections.Counter({(op, ",".join(axes) or "-", "loop" if in_loop else "once"): n
                                          for (op, axes, in_loop), n in bytes_by_kind(
                                              collectives(hlo, layout.mesh)).items()})
        new, _ = step(state, batch)  # warm-up (compiles)
        jax.block_until_ready(new)
        walls = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            new, _ = step(state, batch)
            jax.block_until_ready(new)
            walls.append(time.perf_counter() - t0)
        times[name] = statistics.median(walls)
        updates[name] = [np.asarray(a) - np.asarray(b) for a, b in zip(jax.tree.leaves(new.params),
                                                                        jax.tree.leaves(state.params))]
    keys = sorted(set(sums["plain"]) | set(sums["step copy"]))
    print(f"hidden {args.hidden}, {args.micro} micro-batches x {rows} rows x {args.seq} positions, data 2 x context 4")
    print(f"{'collective':16s} {'axes':14s} {'where':5s} {'plain KB':>10s} {'copy KB':>10s}")
    for k in keys:
        print(f"{k[0]:16s} {k[1]:14s} {k[2]:5s} {sums['plain'][k] / 1e3:10.1f} {sums['step copy'][k] / 1e3:10.1f}")
    for name in layouts:
        over_data = sum(v for (op, axes, where), v in sums[name].items()
                        if op == "all-gather" and where == "loop" and "data" in axes.split(","))
        print(f"{name:10s}: all-gathers over data inside loops {over_data / 1e3:.1f} KB; "
              f"step {times[name] * 1e3:.1f} ms")
    diff = max(float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)
               for a, b in zip(updates["step copy"], updates["plain"]))
    print(f"step copy / plain wall time: {times['step copy'] / times['plain']:.2f}; largest update difference "
          f"{diff:.1e} (relative to the leaf's largest)")


if __name__ == "__main__":
    main()
