"""Check 11 of scripts/gpu_check.py: the 32-node recipe's weight layouts as XLA's GPU compiler builds them for 2
nodes x 8 GPUs, on one GPU (16 compile-only devices of `jax.experimental.topologies.get_topology_desc(platform=
"cuda", topology="2x1x8")`, the attached GPU giving the target; nothing runs, every program is only compiled).
Session 25 tried JAX's mock GPU topology (`JAX_MOCK_GPU_TOPOLOGY=2x1x8`) instead: under jax 0.11.2 it left one
device.

The model: the release's widths (d 6144, 64 heads, 200,064 vocabulary), 2 dense + 2 MoE layers with the release's
128 experts (8 per device), the recipe's model options (flash, gather, tiled experts, save_dots_experts, chunked
logprobs are not in this token cross-entropy step), one 8,192-token row per data rank, on data 2 x context 8 with
the experts over both. Two layouts:
  plain      fsdp_axes [data] (the recipe until session 20)
  step copy  fsdp_axes [context, data], fsdp_step_axes [data] (the recipe now)
For each: XLA's per-device memory (`m3jax.plan.compile.compile_step`: peak, temp) beside the planner's for the same
model and mesh (`memory_plan`, bf16 activations), and the compiled step's collectives by axes and loop
(`sharding.hlo_collectives`). The questions only a GPU compile answers: whether the GPU pipeline keeps the
micro-batch loop's weight gathers on context with the copy, whether it turns the gradient all-reduces that XLA:CPU
emits into reduce-scatters, whether it hoists weight gathers out of the loops (XLA:CPU does), and how far the
planner's memory is from XLA's on a GPU.

    python scripts/gpu_check_mesh.py            # on the GPU machine (a few minutes of compiling)
    python scripts/gpu_check_mesh.py --small    # 16 simulated CPU devices, a tiny model: this script's own test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOPOLOGY = "2x1x8"  # slices x hosts per slice x devices per host: 2 nodes of 8
LAYOUTS = {"plain": {"fsdp_axes": ("data",), "fsdp_step_axes": ()},
           "step copy": {"fsdp_axes": ("context", "data"), "fsdp_step_axes": ("data",)}}


def mesh_compile(small: bool, timeout: int = 900, target_config: str | None = None) -> dict:
    """Run the check in a child process (--small: its 16 CPU devices must be set before JAX starts); its result.
    target_config: a GPU target spec (text GpuTargetConfigProto, e.g. scripts/gpu_specs/h200.txtpb) to compile for
    without a GPU (a jax with the CUDA plugin and libraries; the plugin's driver checks skipped)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    args = ["--small"] * small
    if small:
        from m3jax.plan.compile import xla_flags_with_devices
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags_with_devices(16))
    elif target_config:
        env.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
        args += ["--target-config", os.path.abspath(target_config)]
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"] + args, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"check": "mesh_compile", "error": f"no result within {timeout} s"}
    if r.returncode:
        return {"check": "mesh_compile", "error": f"exit {r.returncode}: {r.stderr[-3000:]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _child(small: bool, target_config: str | None = None) -> dict:
    import dataclasses

    import jax

    from m3jax.plan.compile import compile_step
    from m3jax.plan.memory import GB, Batch, memory_plan
    from sharding.mesh import MeshConfig
    from gpu_check import m3_shaped

    devices = jax.devices()
    if not small and target_config:  # no GPU: compile-only ones of the spec
        from m3jax.plan.compile import compile_only_gpus
        devices = compile_only_gpus(target_config, 16)  # 2 hosts of 8, as TOPOLOGY
    elif not small and len(devices) < 16:  # compile-only GPUs, the attached one describing the target
        from jax.experimental import topologies
        devices = topologies.get_topology_desc(platform="cuda", topology=TOPOLOGY).devices
    if len(devices) < 16:
        return {"check": "mesh_compile", "error": f"{len(devices)} devices ({jax.default_backend()}), 16 needed"}
    # two layers of each kind: a layer scan of one trip is no loop (XLA removes it and hoists its gathers out of
    # the micro-batches' loop), which would hide what this check looks for
    per_kind = 2
    cfg = m3_shaped(small, layers=2 * per_kind, experts=16 if small else 128)
    cfg = dataclasses.replace(cfg, layer_types=("full_attention",) * per_kind + ("minimax_m3_sparse",) * per_kind,
                              mlp_layer_types=("dense",) * per_kind + ("sparse",) * per_kind)
    seq = 256 if small else 8192
    options = {"attention_impl": "flash", "sparse_attention": "gather", "moe_kernel": "tiled",
               "remat_policy": "save_dots_experts"}
    batch = Batch(1, seq, 4, True, platform=devices[0].platform, **options)  # the plan of the devices compiled for
    backend = f"cuda, compile-only for {os.path.basename(target_config)}" if target_config else jax.default_backend()
    out = {"check": "mesh_compile", "devices": len(devices), "backend": backend,
           "topology": None if small else TOPOLOGY, "layers": f"{per_kind} dense + {per_kind} MoE",
           "experts": cfg.num_local_experts,
           "seq": seq, "micro_batches": 4}
    for name, fsdp in LAYOUTS.items():
        mesh = MeshConfig(2, 8, 1, 1, expert_axes=("data", "context"), **fsdp)
        try:
            r = compile_step(cfg, mesh, batch, "compact", "bfloat16", options, collectives=True, devices=devices)
        except Exception as e:  # noqa: BLE001 - one layout's failure must not hide the other's figures
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
            continue
        plan = memory_plan(cfg, mesh, batch, "compact", "bfloat16")
        out[name] = {"xla_peak_gb": r["peak"] / GB, "xla_temp_gb": r["temp"] / GB,
                     "xla_argument_gb": r["argument"] / GB, "plan_gb": plan["total"] / GB,
                     "plan_over_xla": plan["total"] / r["peak"], "compile_s": round(r["compile_s"], 1),
                     "collectives_mb": {k: round(v / 1e6, 3) for k, v in sorted(r["collectives"].items())}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="16 simulated CPU devices, a tiny model")
    ap.add_argument("--target-config", help="compile for this GPU target spec, without a GPU "
                    "(e.g. scripts/gpu_specs/h200.txtpb; needs a jax with the CUDA plugin and libraries)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, HERE)
        print(json.dumps(_child(args.small, args.target_config)), flush=True)
        return
    print(json.dumps(mesh_compile(args.small, target_config=args.target_config)), flush=True)


if __name__ == "__main__":
    main()
