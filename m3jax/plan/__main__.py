"""python -m m3jax.plan --config <run config> [a.b=value ...] [--model release] [--device-memory-gb 80]
                          [--sweep N_DEVICES [--top 20] [--png out.png]]
                          [--compile [--compile-layers 2:2,3:2,2:4] [--target-config spec.txtpb]
                                     [--compile-micro-batches N]] [--check-shardings]

Prints the per-device plan (memory by term, FLOPs, communication, step time) and a verdict
("FITS with X GB margin" / "DOES NOT FIT: <term> is Y GB"). --model release plans the released
MiniMax-M3 shapes (m3jax.plan.models) when the config's model.path is unset (`???`).
--sweep N enumerates (data, context, expert, tensor) with product N and micro-batch 1, 2, 4, 8.
--compile re-executes itself with N simulated CPU devices and compiles the real train step at reduced depth;
with --target-config, for N compile-only GPUs of that spec (XLA's GPU compiler, no GPU needed: a jax with the
CUDA plugin and libraries, `m3jax.plan.compile.compile_only_gpus`).
--check-shardings checks the full-depth model's shardings on an AbstractMesh of any size (no devices).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys

from m3jax.cli_args import description
from m3jax.config import ConfigError as M3ConfigError
from m3jax.plan.check import print_check
from m3jax.plan.compile import compile_reduced, has_cuda_plugin, print_compile
from m3jax.plot import png_path_problem
from m3jax.plan.flops import Hardware, context_imbalance
from m3jax.plan.job import DEFAULT_DEVICE_GB, Job, indexer_alignment_flops, invalid_reason, load_job, plan
from m3jax.plan.memory import GB, memory_plan
from rl.config import ConfigError
from sharding.mesh import JAX_DEFAULT_MEMORY_FRACTION

def verdict(mem: dict, device_gb: float) -> str:
    total = mem["total"] / GB
    if total <= device_gb:
        return f"FITS with {device_gb - total:.2f} GB margin ({total:.2f} of {device_gb:g} GB)"
    term = max((k for k in mem if k != "total"), key=mem.get)
    return (f"DOES NOT FIT: needs {total:.2f} GB of {device_gb:g} GB ({total - device_gb:.2f} GB over); "
            f"largest term {term} is {mem[term] / GB:.2f} GB")


def print_plan(job: Job, p: dict, device_gb: float, hw: Hardware = Hardware()) -> None:
    m = job.mesh
    print(f"mesh data={m.data} context={m.context} expert={m.expert} tensor={m.tensor} (EP {m.expert_parallel} over "
          f"{','.join(m.expert_axes)}), micro-batch {job.micro_batch} x {job.batch.num_micro} micro-batches, "
          f"seq {job.seq_len}" + (f" ({job.slots} slots)" if job.slots is not None else "")
          + f", master={job.master}, moments={job.moment_dtype}, remat={job.remat}"
          + (f" ({job.batch.remat_policy})" if job.remat else ""))
    b = job.batch
    print(f"attention {b.attention}, sparse layers {b.sparse_attention}, attention_query_chunk="
          f"{b.attention_query_chunk}, logprob_chunk_tokens={b.logprob_chunk_tokens}, expert exchange {b.exchange} "
          f"(capacity factor {b.moe_capacity_factor or 'none: dropless'}), expert matmuls "
          f"{_expert_matmuls(b)}")
    binding = p["binding"]
    print(f"{'per-device memory (' + binding + ' peak)':34s} {'GB':>9s}")
    for k, v in p["memory"].items():
        print(f"  {k:32s} {v / GB:9.3f}")
    others = [f"{k.replace('_', ' ')} peak: {v['total'] / GB:.3f} GB" for k, v in p["phases"].items() if k != binding]
    print(f"  ({', '.join(others)})")
    if job.reference == "host":
        ref = p["phases"]["reference_pass"]["reference_params"]
        print(f"  KL reference in pinned host memory (grpo.reference_memory: host): {ref / GB:.3f} GB per GPU, "
              f"{ref * hw.gpus_per_node / GB:.1f} GB per node")
    f = p["flops"]
    print(f"FLOPs per step: model {f['model_total']:.3e} (matmul {f['matmul']:.3e}, attention {f['attention']:.3e}, "
          f"indexer {f['indexer_scores'] + f['indexer_proj']:.3e}); executed {f['executed_total']:.3e} "
          f"= {f['executed_total'] / f['model_total']:.2f}x (matmul {f['matmul_executed']:.3e}, attention "
          f"{f['attention_executed']:.3e}, indexer {f['indexer_executed']:.3e}, indexer projections "
          f"{f['indexer_proj_executed']:.3e})")
    print("communication per device per step:")
    for k, (b, axes) in p["comm"].items():
        print(f"  {k:30s} {b / GB:10.2f} GB over {','.join(axes)}  ({p['time'][k + '_s']:.2f} s)")
    t = p["time"]
    print(f"step time estimate: {t['total_s']:.1f} s (compute {t['compute_s']:.1f} s, communication {t['comm_s']:.1f} s, "
          f"comm share {t['comm_share']:.0%})")
    if context_imbalance(m) > 1 and f["full_flash_executed"]:
        print(f"  contiguous context shards (mesh.context_balance: false): the busiest does "
              f"{context_imbalance(m):.2f}x the average of the full layers' flash, "
              f"{(context_imbalance(m) - 1) * f['full_flash_executed'] / m.num_devices:.3e} FLOPs more per device")
    lp = p["logprob_pass"]["time"]
    gathers = sum(v for k, v in lp.items() if k.startswith("fsdp_"))
    if not job.logprob_passes:
        print("  no logprob pass before the update (grpo.old_logprobs: update, no KL reference)")
    else:
        h2d = (f", the reference onto the devices {lp['reference_to_device_s']:.2f} s"
               if "reference_to_device_s" in lp else "")
        print(f"  + logprob pass{'es' if job.logprob_passes > 1 else ''} before the update ({job.logprob_passes} x a "
              f"forward over the step's sequences): {lp['total_s']:.1f} s (compute {lp['compute_s']:.1f} s, "
              f"communication {lp['comm_s']:.1f} s, of it FSDP gathers {gathers:.1f} s{h2d}) -> "
              f"{t['total_s'] + lp['total_s']:.1f} s per step")
    if job.indexer_alignment:
        extra = indexer_alignment_flops(job)
        seconds = extra / m.num_devices / (hw.peak_flops * hw.mfu)
        print(f"  not planned: model.indexer_loss_coef's alignment pass, {extra:.3e} fp32 FLOPs per step "
              f"({extra / f['executed_total']:.0%} of the executed; ~{seconds:.1f} s at the bf16 rate, several times "
              "that in fp32), and a query tile's fp32 scores over every key per sparse layer")
    print(verdict(p["memory"], device_gb))


def one_block_hint(job: Job, p: dict, hw: Hardware) -> str | None:
    """A line for runs whose loss splits a row's logits into blocks (`model.logprob_chunk_tokens` < the row's
    positions) when one block per row plans no more memory and less time: on a context-parallel mesh every block
    costs each device its head's whole fp32 gradient, reduce-scattered over context (`rl.logprobs`)."""
    chunk = job.logprob_chunk_tokens
    if not chunk or chunk >= job.seq_len:
        return None
    one = plan(dataclasses.replace(job, logprob_chunk_tokens=0), hw)
    gb, s = (p["memory"]["total"] - one["memory"]["total"]) / GB, p["time"]["total_s"] - one["time"]["total_s"]
    if gb < 0 or s <= 0:
        return None
    return (f"hint: model.logprob_chunk_tokens={job.seq_len} (one logits block per row: {job.seq_len // job.mesh.context}"
            f" positions per device) plans {one['memory']['total'] / GB:.2f} GB and {one['time']['total_s']:.1f} s "
            f"per train step ({gb:.2f} GB and {s:.1f} s less than blocks of {chunk})")


def sweep(job: Job, n: int, hw: Hardware, device_gb: float, png: str | None, micro=(1, 2, 4, 8), top: int = 20
          ) -> tuple[list, list]:
    divs = [d for d in range(1, n + 1) if n % d == 0]
    rows, excluded = [], []
    for dp, cp, ep in itertools.product(divs, divs, divs):
        if n % (dp * cp * ep):
            continue
        tp = n // (dp * cp * ep)
        for mb in micro:
            mesh = dataclasses.replace(job.mesh, data=dp, context=cp, expert=ep, tensor=tp)
            j = job.on_mesh(mesh, mb)
            why = invalid_reason(j)
            if why:
                excluded.append((mesh.shape, mb, why))
                continue
            p = plan(j, hw)
            rows.append((mesh.shape, mb, p["memory"]["total"] / GB, p["time"]["total_s"], p["time"]["comm_share"],
                         p["memory"]["total"] / GB <= device_gb))
    # Meshes that fit by step time; then the rest by memory, closest to fitting first.
    rows.sort(key=lambda r: (not r[5], r[3] if r[5] else r[2]))
    print(f"sweep over {n} devices: {len(rows)} valid, {len(excluded)} excluded")
    print(f"{'data,ctx,exp,tp':>16s} {'mb':>3s} {'mem GB':>8s} {'step s':>9s} {'comm':>5s} fits")
    for shape, mb, mem, t, share, fits in rows[:top]:
        print(f"{','.join(map(str, shape)):>16s} {mb:3d} {mem:8.2f} {t:9.1f} {share:5.0%} {'yes' if fits else 'no'}")
    reasons: dict = {}
    for shape, mb, why in excluded:
        reasons.setdefault(why.split(":")[0].split(" is not")[0][:70], []).append(shape)
    for why, shapes in reasons.items():
        print(f"  excluded {len(shapes):4d}: {why} ...")
    if png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 5))
        for fits, col in ((True, "tab:green"), (False, "tab:red")):
            pts = [(r[3], r[2]) for r in rows if r[5] == fits]
            if pts:
                ax.scatter(*zip(*pts), c=col, s=12, label="fits" if fits else "does not fit")
        ax.axhline(device_gb, color="k", ls="--", lw=1)
        ax.set_xscale("log"); ax.set_yscale("log")
        ax.set_xlabel("estimated step time (s)"); ax.set_ylabel("memory per device (GB)")
        ax.set_title(f"mesh sweep, {n} devices")
        if rows:
            ax.legend()
        fig.savefig(png, dpi=100); plt.close(fig)
        print(f"plot: {png}")
    return rows, excluded


def _expert_matmuls(batch) -> str:
    from m3jax.model.expert_tuning import needs_timing
    kernel = batch.expert_kernel
    text = f"{kernel} (moe_kernel)" if kernel in ("tiled", "bucketed", "pallas", "mosaic") else \
        f"ragged_dot lowered {batch.ragged_dot}"
    if needs_timing(batch.moe_kernel, batch.platform):
        bound = ("planned as tiled, which bounds its time, and its extra temporaries limited to this plan's margin "
                 "under the device's memory" if batch.platform == "gpu" else "planned as the CPU's rule")
        text += (f" (moe_kernel {batch.moe_kernel}: the trainer times the kernels when it starts and keeps the "
                 f"fastest that fits; {bound}; model.moe_kernel=K plans K)")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m m3jax.plan", description=description(__doc__))
    ap.add_argument("--config", required=True, help="the run config to plan (as m3jax.train takes it)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides of the config (mesh.data=4 ...)")
    ap.add_argument("--model", choices=("config", "release"), default=None,
                    help="release: the released MiniMax-M3 shapes; config: the config's model (default: config, "
                         "or release where model.path is unset)")
    ap.add_argument("--device-memory-gb", type=float, default=None,
                    help=f"each GPU's memory (GB); default: the config's mesh.device_memory_gb, else {DEFAULT_DEVICE_GB:g}")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="each device's dense bf16 peak (TFLOP/s; default: 989, an H100 / H200)")
    ap.add_argument("--mfu", type=float, default=0.4, help="the share of that peak the step's matmuls reach, in "
                                                            "(0, 1]: the step-time estimate's compute (default: 0.4)")
    ap.add_argument("--nvlink-gbps", type=float, default=450.0,
                    help="each device's link inside a node (GB/s; default: 450)")
    ap.add_argument("--ib-gbps", type=float, default=50.0, help="each device's link between nodes (GB/s; default: 50)")
    ap.add_argument("--pcie-gbps", type=float, default=50.0,
                    help="each GPU's link to pinned host memory (GB/s; default: 50)")
    ap.add_argument("--sweep", type=int, default=None, metavar="N_DEVICES",
                    help="plan every (data, context, expert, tensor) mesh of N_DEVICES devices with micro-batch 1, "
                         "2, 4 and 8: those that fit by estimated step time, then the rest by memory")
    ap.add_argument("--png", default=None, help="with --sweep: write its chart there (default: the table alone)")
    ap.add_argument("--compile", action="store_true", help="compile the real train step at reduced depth on "
                                                            "simulated devices and compare with the plan")
    ap.add_argument("--target-config", help="with --compile: compile for compile-only GPUs of this target spec "
                    "(e.g. scripts/gpu_specs/h200.txtpb), no GPU needed; needs a jax with the CUDA plugin")
    ap.add_argument("--compile-layers", default="2:2,3:2,2:4",
                    help="reduced depths to compile, first-kind:last-kind layers; three of >= 2 per kind pin down "
                         "the per-layer scaling")
    ap.add_argument("--compile-micro-batches", type=int, default=None, metavar="N",
                    help="with --compile: micro-batches the compiled step scans (default: the config's, so that "
                         "XLA's figure holds the accumulation loop's buffers)")
    ap.add_argument("--check-shardings", action="store_true",
                    help="check the full-depth model's shardings on an AbstractMesh (no devices); lower the step")
    ap.add_argument("--top", type=int, default=20, help="rows of the sweep table")
    ap.add_argument("--ragged-dot", choices=("dense", "grouped"), default="dense",
                    help="how XLA lowers the grouped expert matmuls on the GPU: dense = zero-padded batched matmul "
                         "over the whole receive buffer (XLA's default), grouped = a grouped-GEMM kernel; "
                         "model.moe_kernel=tiled plans the tiled kernel instead")
    a = ap.parse_intermixed_args(argv)  # overrides may follow a flag, as with python -m m3jax.train
    if a.target_config and not a.compile:
        ap.error("--target-config names the GPU to compile for: it needs --compile")
    if a.target_config and not os.path.isfile(a.target_config):
        ap.error(f"--target-config {a.target_config!r}: no such file (expected a text GpuTargetConfigProto, such as "
                 "scripts/gpu_specs/h200.txtpb)")
    if a.target_config and not has_cuda_plugin():
        ap.error("--target-config compiles with XLA's GPU compiler, which needs a jax with the CUDA plugin and its "
                 "libraries (pip install \"jax[cuda12]\" in another environment; no GPU needed), not this one; "
                 "docs/planner.md, --target-config")
    for flag, value in (("--device-memory-gb", a.device_memory_gb), ("--peak-tflops", a.peak_tflops),
                        ("--mfu", a.mfu), ("--nvlink-gbps", a.nvlink_gbps), ("--ib-gbps", a.ib_gbps),
                        ("--pcie-gbps", a.pcie_gbps)):
        if value is not None and not (math.isfinite(value) and value > 0):
            ap.error(f"{flag} {value:g}: expected a number > 0")
    if a.compile_micro_batches is not None and (a.compile_micro_batches < 1 or not a.compile):
        ap.error(f"--compile-micro-batches {a.compile_micro_batches}: expected a count >= 1, with --compile")
    if not a.mfu <= 1:  # a share of the peak: 5 made the step-time estimate 12.5x too short
        ap.error(f"--mfu {a.mfu:g}: expected a share of the peak in (0, 1]")
    if a.top < 1:
        ap.error(f"--top {a.top}: expected a row count >= 1")
    # every argument is checked before the plan prints anything (the sweep printed its table, then failed)
    if a.sweep is not None and (a.compile or a.check_shardings):  # the sweep returned before either ran
        ap.error("--sweep plans every mesh of N devices; --compile and --check-shardings check the config's own mesh: "
                 "run them separately")
    if a.sweep is not None and a.sweep < 1:
        ap.error(f"--sweep {a.sweep}: expected a positive device count")
    if a.sweep is not None and a.png and (problem := png_path_problem(a.png)):
        ap.error(f"--png {a.png}: {problem}")
    try:
        sets = [tuple(int(x) for x in s.split(":", 1)) for s in a.compile_layers.split(",")]
        if any(len(pair) != 2 or min(pair) < 0 or sum(pair) < 1 for pair in sets):  # 0:0 failed in the compile
            raise ValueError
    except ValueError:
        ap.error(f"--compile-layers {a.compile_layers!r}: expected dense:moe pairs of at least one layer, such as "
                 "2:2,3:2,2:4")
    try:
        job = dataclasses.replace(load_job(a.config, a.overrides, a.model), ragged_dot=a.ragged_dot)
    except (ConfigError, M3ConfigError) as e:  # what `python -m m3jax.train` prints for the same config
        print(f"config error:\n{e}", file=sys.stderr)
        return 2
    hw = Hardware(a.peak_tflops * 1e12, a.mfu, a.nvlink_gbps * 1e9, a.ib_gbps * 1e9, pcie_bw=a.pcie_gbps * 1e9)
    # What JAX may hold of each device: the plan must fit in that, not in the whole device.
    gpu_gb = a.device_memory_gb or job.device_memory_gb
    device_gb = gpu_gb * job.memory_fraction
    print(f"JAX's share of each device: {job.memory_fraction:g} x {gpu_gb:g} GB = {device_gb:.2f} GB "
          f"(mesh.device_memory_fraction{'' if job.memory_fraction != JAX_DEFAULT_MEMORY_FRACTION else ', JAX default'})")
    if a.sweep is not None:
        sweep(job, a.sweep, hw, device_gb, a.png, top=a.top)
        return 0
    why = invalid_reason(job)
    if why:
        print(f"INVALID MESH: {why}")
        return 1
    planned = plan(job, hw)
    print_plan(job, planned, device_gb, hw)
    hint = one_block_hint(job, planned, hw)
    if hint:
        print(hint)
    status = print_check(job) if a.check_shardings else 0  # then --compile too, where asked (it was skipped)
    if a.compile:
        if a.target_config:
            print(f"compiling for {job.mesh.num_devices} compile-only GPUs of {a.target_config}, real widths, reduced "
                  f"depth (XLA's GPU compiler; no CUDA/NCCL workspaces):")
        else:
            print(f"compiling on {job.mesh.num_devices} simulated CPU devices, real widths, reduced depth "
                  f"(XLA:CPU estimate, not the GPU OOM line):")
        num_micro = a.compile_micro_batches or max(job.num_micro, 1)
        print(f"the step scans {num_micro} micro-batch{'es' if num_micro > 1 else ''} of {job.micro_batch} "
              f"sequence{'s' if job.micro_batch > 1 else ''} per data-parallel rank")
        print_compile(job, compile_reduced(job, sets, target_config=a.target_config, num_micro=num_micro),
                      memory_plan(job.model, job.mesh, job.batch, job.master, job.moment_dtype)["total"],
                      compiler="XLA:GPU" if a.target_config else "XLA:CPU", planned_total=planned["memory"]["total"])
    return status


if __name__ == "__main__":
    sys.exit(main())
