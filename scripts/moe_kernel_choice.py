"""What `model.moe_kernel: auto` (off a CPU) or `tune` picks for a run config on this machine, and why.

Builds the config's layout (simulated CPU devices when this machine has fewer than the mesh needs), the expert
work one device of its widest micro-batch runs (`m3jax.model.expert_tuning.expert_work`: receive-buffer rows,
filled rows, local experts, widths, dtype) and times every kernel the device runs on it, forward and backward,
as the trainer does at its start. Prints each kernel's median, the choice and the seconds the timing took
(compiles included). --record writes the trainer's record into the config's run.out_dir, so the run reads the
choice instead of timing again (same device kind, jax and shapes).

    .venv/bin/python scripts/moe_kernel_choice.py --config configs/tiny.yaml
    .venv/bin/python scripts/moe_kernel_choice.py --config configs/recipes/m3-32node-miniature.yaml --rounds 9
    .venv/bin/python scripts/moe_kernel_choice.py --config configs/recipes/m3-32node.yaml --model release  # a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, as the trainer takes them")
    ap.add_argument("--model", choices=("release",), help="the released model's shapes instead of model.tiny/path")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--record", action="store_true", help="write the choice where the run will read it")
    args = ap.parse_args()

    from rl.config.yaml_io import apply_overrides, load_tree
    tree = load_tree(args.config, [], {})
    apply_overrides(tree, list(args.overrides), {})
    devices = math.prod(tree.get("mesh", {}).get(axis, 1) for axis in ("data", "context", "expert", "tensor"))
    if devices > 1:  # a CPU stands in with simulated devices (read before jax starts; a GPU ignores it)
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={devices}")
    import jax

    from m3jax.plan.job import load_run_config
    cfg, m3 = load_run_config(args.config, args.overrides, args.model)

    from m3jax.model import expert_tuning
    from rl.policy import training_positions
    from sharding import kernel_tuning
    from sharding.layout import Layout
    from sharding.mesh import build_mesh

    layout = Layout() if devices == 1 else build_mesh(cfg.mesh.to_mesh_config(), m3,
                                                      seq_len=training_positions(cfg, m3))
    work = expert_tuning.expert_work(m3, layout, cfg.grpo.micro_batch_size, training_positions(cfg, m3),
                                     cfg.precision.param_dtype, capacity_factor=cfg.model.moe_capacity_factor)
    device = jax.local_devices()[0]
    print(f"jax {jax.__version__}, {device.device_kind} ({device.platform}); config {args.config}")
    print(f"one device's expert work: {dataclasses.asdict(work)}")
    t0 = time.perf_counter()
    timings = expert_tuning.time_expert_kernels(m3, work, device=device, rounds=args.rounds)
    ms, errors, temps = timings
    seconds = time.perf_counter() - t0
    # as `python -m m3jax.train` weighs them: a kernel whose temporaries the run's plan cannot hold is left out
    from m3jax.train import kernel_headroom
    headroom = kernel_headroom(cfg, m3, (device.memory_stats() or {}).get("bytes_limit"))
    fits, over = expert_tuning.within_memory(ms, temps, headroom)
    choice = kernel_tuning.fastest(fits)
    for kernel, t in sorted(ms.items(), key=lambda kv: kv[1]):
        temp = "?" if temps.get(kernel) is None else f"{temps[kernel] / 1e6:.3f} MB"
        print(f"  {kernel:11s} {t:10.3f} ms  {t / ms[choice]:6.2f}x   XLA's temporaries {temp}")
    for kernel, error in errors.items():
        print(f"  {kernel:11s} failed: {error}")
    for kernel, why in over.items():
        print(f"  {kernel:11s} left out for memory: {why}")
    if headroom is None:
        print("memory: not weighed (the device reports no limit, or the planner cannot model the run)")
    else:
        print(f"memory: the plan leaves {headroom / 1e9:.2f} GB free with tiled")
    print(f"choice: {choice}; timing took {seconds:.1f} s ({args.rounds} rounds, compiles included)")
    if args.record:
        path = os.path.join(cfg.run.out_dir, expert_tuning.RECORD_FILE)
        expert_tuning.record_choice(path, work, device, choice, fits, timings, args.rounds, headroom, over)
        print(f"recorded {choice} in {path}")


if __name__ == "__main__":
    main()
