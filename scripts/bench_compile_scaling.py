"""Compile time of the real M3 train step (release widths, reduced depth) vs the number of simulated devices.

Each device count runs in its own Python process (`m3jax.plan.compile.compile_reduced`): the CPU
device count is fixed when jax is imported. The mesh keeps the 32-node recipe's layout, context 8 and
data N / 8 with the experts over data x context, so every device holds 1024 tokens of one sequence;
at 256 devices EP stays at 128 (the release has 128 experts) and the extra factor 2 goes to the
expert axis (more batch). Everything else (micro-batch 1, seq 8192, fp32 master, bf16 moments,
remat) is the recipe's. Nothing is allocated: the inputs are ShapeDtypeStructs.

Columns: lower = eval_shape + trace + lower (s); total = lower + XLA compile (s); wall = the whole
child process including the jax import; HLO = instructions in the partitioned per-device module;
peak = XLA:CPU's per-device memory_analysis (GB). The 1-minute load average is printed because
the machine is shared.

    .venv/bin/python scripts/bench_compile_scaling.py                     # 8 16 32 64 128 256, depth 2:2
    .venv/bin/python scripts/bench_compile_scaling.py --devices 8 256 --layers 2:4
    .venv/bin/python scripts/bench_compile_scaling.py --devices 128 --max-ep 16     # EP 16 instead of 128
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from m3jax.plan.job import load_job  # noqa: E402
from m3jax.plan.compile import compile_reduced  # noqa: E402
from m3jax.plan.memory import GB  # noqa: E402

RECIPE = "configs/recipes/m3-32node.yaml"


def recipe_mesh(mesh, n: int, max_ep: int = 128):
    """Context 8 and the experts over data x context (at most max_ep ways); the remaining factor on expert."""
    ep = min(n, max_ep)
    return dataclasses.replace(mesh, data=ep // 8, context=8, expert=n // ep, tensor=1,
                               expert_axes=("data", "context"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--layers", default="2:2", help="dense:moe layers compiled (real widths)")
    ap.add_argument("--max-ep", type=int, default=128,
                    help="cap on the expert-parallel size (data x context); 16 shows what EP alone costs")
    ap.add_argument("--repeat", type=int, default=1, help="processes per device count; the fastest is shown")
    a = ap.parse_args()
    depth = tuple(map(int, a.layers.split(":")))
    job = load_job(RECIPE, [], "release")
    print(f"real M3 widths, {depth[0]} dense + {depth[1]} MoE layers, seq {job.seq_len}, micro-batch "
          f"{job.micro_batch}, master={job.master}, moments={job.moment_dtype}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'devices':>7s} {'data,ctx,exp,tp':>15s} {'lower s':>8s} {'total s':>8s} {'wall s':>7s} "
          f"{'HLO':>7s} {'peak GB':>8s}")
    for n in a.devices:
        j = dataclasses.replace(job, mesh=recipe_mesh(job.mesh, n, a.max_ep))
        runs = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            r = compile_reduced(j, [depth])[0]
            runs.append((r["compile_s"], time.perf_counter() - t0, r))
        _, wall, r = min(runs, key=lambda x: x[0])
        print(f"{n:7d} {','.join(map(str, j.mesh.shape)):>15s} {r['lower_s']:8.1f} {r['compile_s']:8.1f} "
              f"{wall:7.1f} {r['hlo_instructions']:7d} {r['peak'] / GB:8.2f}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
