"""Train-step time of a small M3: one device vs 8 simulated CPU devices on several meshes, side by side.

One process, one config, one batch: the jitted `sharding.train_step.make_train_step` (AdamW through
`sharding.optim_step.adamw`, clipping, donation) of a random-init small M3 (hidden 128, 4 layers: 1
full-attention dense layer + 3 sparse-attention (indexer) MoE layers with 8 experts, top-2) on
  - 1 device (no mesh: plain jit, everything on device 0), and
  - 8 devices (`--xla_force_host_platform_device_count=8`) with MeshConfig (data, context, expert, tensor)
    = (8,1,1,1), (2,2,2,1), (1,2,2,2): state placed by `state_shardings`, experts expert-parallel in
    shard_map, batch on (data, expert), sequence on context.
Every contestant starts from the same initial params; the loss of its first step is printed (they must
agree up to float summation order). Compile time is reported separately. After --warmup untimed steps,
--iters rounds run every contestant once each, round-robin (load from other processes hits all alike),
each step timed to `block_until_ready`; reported: median (min) ms per step and sharded / single.

CAVEAT: the 8 "devices" are simulated on this machine's CPU cores (2 here) and share them and XLA's
thread pools; the sharded programs add collectives (all-gathers for FSDP, all-to-alls for experts,
reductions) that run as memory copies. This measures partitioning overhead on one host, and says little
about real multi-device speed-up.

    .venv/bin/python scripts/bench_sharded_step.py
    .venv/bin/python scripts/bench_sharded_step.py --iters 20 --dtype bfloat16   # bf16 + compact + bf16 moments
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from m3jax import M3Config  # noqa: E402
from m3jax.tiny import m3_config, m3_model  # noqa: E402
from sharding import optim_step  # noqa: E402
from sharding.mesh import MeshConfig, build_mesh  # noqa: E402
from sharding.train_step import init_state, make_train_step, state_shardings  # noqa: E402

MESHES = [(8, 1, 1, 1), (2, 2, 2, 1), (1, 2, 2, 2)]


def small_cfg(hidden: int) -> M3Config:
    # 4 layers: full attention + dense MLP, then 3 x sparse attention + MoE (8 experts, top-2)
    return m3_config(vocab_size=1024, hidden_size=hidden, intermediate_size=128, dense_intermediate_size=512)


def make_batch(cfg, micro: int, batch: int, seq: int, seed: int = 0):
    ids = np.random.default_rng(seed).integers(3, cfg.vocab_size, size=(micro, batch, seq + 1)).astype(np.int32)
    return {"input_ids": jnp.asarray(ids[..., :-1]), "targets": jnp.asarray(ids[..., 1:]),
            "loss_mask": jnp.ones((micro, batch, seq), jnp.float32)}


def n_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=1, help="micro-batches per step (each of --batch sequences)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="float32: fp32 params + fp32 Adam; bfloat16: bf16 + compact master + bf16 moments")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    assert len(jax.devices()) == 8, jax.devices()
    cfg = small_cfg(args.hidden)
    dtype = jnp.dtype(args.dtype)
    opt = (optim_step.adamw(1e-3, weight_decay=0.1, master="none") if dtype == jnp.float32 else
           optim_step.adamw(1e-3, weight_decay=0.1, moment_dtype=jnp.bfloat16, master="compact"))
    batch = make_batch(cfg, args.micro, args.batch, args.seq)
    print(f"jax {jax.__version__}, {len(jax.devices())} simulated {jax.default_backend()} devices on {n_cpus()} "
          f"CPU cores, load avg {os.getloadavg()[0]:.2f}")
    print(f"small M3: hidden {cfg.hidden_size}, layers {cfg.mlp_layer_types} / {cfg.layer_types}, "
          f"{cfg.num_local_experts} experts top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}; batch "
          f"[{args.micro} micro x {args.batch} seqs x {args.seq} tokens], {args.dtype} "
          f"({'fp32 Adam, master none' if dtype == jnp.float32 else 'compact master, bf16 moments'})")

    contestants = {}  # name -> [step_fn, state, batch]
    for shape in [None] + MESHES:
        layout = None if shape is None else build_mesh(MeshConfig(*shape), cfg, seq_len=args.seq, batch=args.batch)
        model = m3_model(cfg, seed=0, dtype=dtype, layout=layout)
        graphdef, state = init_state(model, opt)
        if shape is None:
            name = "1 device"
            step, b = make_train_step(graphdef, opt), jax.device_put(batch, jax.devices()[0])
            state = jax.device_put(state, jax.devices()[0])
        else:
            name = f"8 dev {shape}"
            sh = state_shardings(layout, state)
            step, b = make_train_step(graphdef, opt, mesh=layout, shardings=sh), batch
            state = jax.device_put(state, sh)
        t0 = time.perf_counter()
        state, metrics = step(state, b)
        jax.block_until_ready(state)
        compile_s = time.perf_counter() - t0
        print(f"  {name:<22} first step (compile + run) {compile_s:6.1f} s, loss {float(metrics['loss']):.6f}, "
              f"grad norm {float(metrics['grad_norm']):.6f}")
        contestants[name] = [step, state, b]

    for _ in range(args.warmup):
        for c in contestants.values():
            c[1], _ = c[0](c[1], c[2])
            jax.block_until_ready(c[1])
    times = {n: [] for n in contestants}
    for _ in range(args.iters):
        for n, c in contestants.items():
            t0 = time.perf_counter()
            c[1], m = c[0](c[1], c[2])
            jax.block_until_ready((c[1], m))
            times[n].append(time.perf_counter() - t0)

    base = statistics.median(times["1 device"])
    print(f"\n{args.iters} timed steps each after {args.warmup} warm-up steps (round-robin); load avg now "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'contestant':<22} {'median ms':>10} {'min ms':>8} {'sharded/single':>15}")
    for n, ts in times.items():
        med = statistics.median(ts)
        print(f"{n:<22} {1e3 * med:>10.1f} {1e3 * min(ts):>8.1f} {med / base:>15.2f}")
    print(f"\nNOTE: the 8 devices are simulated on {n_cpus()} CPU cores and share them; the sharded steps add "
          "collectives executed as host memory copies. These ratios measure partitioning overhead on one host, "
          "not real multi-device speed-up.")


if __name__ == "__main__":
    main()
