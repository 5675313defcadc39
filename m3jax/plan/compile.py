"""XLA's view: compile the real train step from shape-only inputs on (simulated) devices.

Needs as many jax devices as the mesh: on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N
*before* jax is imported (`compile_reduced` re-executes Python in `_compile_worker` to do so). Nothing is
allocated: the model and optimizer state are `jax.eval_shape`d, the batch is ShapeDtypeStructs.

The real depth is not compiled: a few reduced-depth models at the real widths are (the layer stacks
are scans, so XLA's figure is affine in the number of layers of each kind), and `depth_fit` extrapolates
XLA's per-layer figures to the full depth, next to the analytic plan of the full model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

from m3jax.config import M3Config
from sharding.mesh import MeshConfig
from m3jax.plan.memory import GB, Batch


def compile_step(cfg: M3Config, mesh_cfg: MeshConfig, batch: Batch, master: str = "fp32",
                 moment_dtype: str = "float32", model_options: dict | None = None,
                 collectives: bool = False, devices=None, return_compiled: bool = False) -> dict:
    """Lower and compile `make_train_step` (token cross-entropy loss) on a mesh of the first devices;
    returns XLA's per-device memory_analysis (bytes), the trace+lower and compile times and the size
    of the partitioned (per-device) HLO; with `collectives`, also the compiled program's collectives' result
    bytes summed by "op over axes, in a loop or once" (`sharding.hlo_collectives`). devices: the devices to
    compile for (default jax.devices()), e.g. compile-only ones of `jax.experimental.topologies`. return_compiled:
    also return the compiled program (`out["compiled"]`).

        peak = argument + output - alias + temp   (donated state: outputs alias the arguments)
    """
    import jax

    from m3jax.plan.check import abstract_batch, abstract_train_state
    from sharding.mesh import build_mesh
    from sharding.train_step import make_train_step, state_shardings

    n = mesh_cfg.num_devices
    t0 = time.perf_counter()
    devices = list(jax.devices() if devices is None else devices)[:n]
    layout = build_mesh(mesh_cfg, cfg, seq_len=batch.seq_len, devices=devices)
    graphdef, opt, state = abstract_train_state(cfg, master, moment_dtype, batch.remat, model_options, layout)
    shardings = state_shardings(layout, state)
    step = make_train_step(graphdef, opt, mesh=layout, shardings=shardings)
    with jax.set_mesh(layout.mesh):
        lowered = step.jitted.lower(state, abstract_batch(layout, mesh_cfg, batch))
        t1 = time.perf_counter()
        compiled = lowered.compile()
    t2 = time.perf_counter()
    ma = compiled.memory_analysis()
    out = {k: float(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp",
                                                                  "generated_code")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out.update(lower_s=t1 - t0, compile_s=t2 - t0, devices=n)
    # Instructions of the partitioned module: what XLA optimises, one program for every device.
    text = compiled.as_text()
    out["hlo_instructions"] = len(re.findall(r"^\s+(?:ROOT )?%?[\w.-]+ = ", text, re.M))
    if collectives:
        from sharding.hlo_collectives import bytes_by_kind
        from sharding.hlo_collectives import collectives as read
        out["collectives"] = {f"{op} over {','.join(axes) or '-'} {'in a loop' if in_loop else 'once'}": n
                              for (op, axes, in_loop), n in bytes_by_kind(read(text, layout.mesh)).items()}
    if return_compiled:
        out["compiled"] = compiled
    return out


def xla_flags_with_devices(n: int) -> str:
    """XLA_FLAGS for a child process with n simulated CPU devices, the caller's other flags kept (e.g. the tests'
    faster compile settings, tests/conftest.py)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    return f"{flags} --xla_force_host_platform_device_count={n}".strip()


def has_cuda_plugin() -> bool:
    """Whether this jax has a CUDA PJRT plugin (`jax_plugins.xla_cuda*`), which `compile_only_gpus` needs: without
    one the compile's worker stopped with NotImplementedError "topology not implemented for cuda", a traceback."""
    import pkgutil
    try:
        import jax_plugins
    except ImportError:
        return False
    return any("cuda" in m.name for m in pkgutil.iter_modules(jax_plugins.__path__))


def compile_only_gpus(target_config: str, n: int, per_host: int = 8) -> list:
    """n compile-only CUDA devices (`jax.experimental.topologies`), hosts of `per_host`, of the GPU that the text
    GpuTargetConfigProto at `target_config` describes (e.g. scripts/gpu_specs/h200.txtpb): XLA's GPU compiler
    builds programs for them without a GPU. Needs a jax with the CUDA plugin and its libraries, started with
    JAX_PLATFORMS=cpu and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (the plugin's version checks call the driver).
    The process's default backend stays the CPU: a model makes its platform-dependent choices ("auto" options, the
    sparse path, the expert exchange) for its layout's `backend`, which a mesh of these devices gives ("gpu"); a
    program without such a mesh passes `Layout(platform="gpu")` (or `backend="gpu"`) itself. `moe_kernel: mosaic`
    compiles on them too (`_mosaic_grid_on`)."""
    from jax.experimental import topologies
    hosts, local = (1, n) if n <= per_host else (-(-n // per_host), per_host)
    with open(target_config) as f:
        spec = f.read()
    devices = topologies.get_topology_desc(platform="cuda", topology=f"{hosts}x1x{local}", target_config=spec).devices
    devices = list(devices)[:n]
    _mosaic_grid_on(devices)
    return devices


def _mosaic_grid_on(devices: list) -> None:
    """jax's `transposed_ragged_dot_mgpu` (`moe_kernel: mosaic`'s weight gradient) sizes its grid from
    `jax.devices()[0].core_count`, the process's default device: in a process that compiles for compile-only GPUs,
    a CPU without a core_count. There that kernel module's `jax.devices` answers with the GPUs compiled for; only
    such a process calls this (on a GPU the default device is the GPU)."""
    import jax
    import jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu as kernel_module

    class _JaxOnTheseDevices:
        def __getattr__(self, name):
            return getattr(jax, name)

        @staticmethod
        def devices(*_):
            return devices

    kernel_module.jax = _JaxOnTheseDevices()


def compile_reduced(job, layer_sets, extra_env: dict | None = None, target_config: str | None = None,
                    num_micro: int = 1) -> list:
    """Re-execute Python with N simulated devices (XLA_FLAGS must be set before jax loads) and compile
    `job`'s model at each (dense, moe) reduced depth of `layer_sets`. The child's progress goes to stderr.
    target_config: compile for N compile-only GPUs of that spec instead (`compile_only_gpus`). num_micro: the
    micro-batches the step scans (with more than one, XLA holds the loop's gradient carry and each micro-batch's
    gradient apart, which one micro-batch never shows)."""
    n = job.mesh.num_devices
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(n), JAX_PLATFORMS="cpu", **(extra_env or {}))
    if target_config:
        env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    spec = {"model": dataclasses.asdict(job.model), "mesh": dataclasses.asdict(job.mesh), "seq_len": job.seq_len,
            "micro_batch": job.micro_batch, "master": job.master, "moment_dtype": job.moment_dtype,
            "remat": job.remat, "model_options": job.model_options, "layer_sets": [list(s) for s in layer_sets],
            "num_micro": num_micro,
            "target_config": os.path.abspath(target_config) if target_config else None}
    out = subprocess.run([sys.executable, "-m", "m3jax.plan._compile_worker"], input=json.dumps(spec), env=env,
                         stdout=subprocess.PIPE, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"compile on {n} simulated devices failed (exit {out.returncode}; its stderr is above)")
    return json.loads(out.stdout.strip().splitlines()[-1])


def layer_counts(cfg: M3Config) -> tuple[int, int]:
    """(layers of the first kind, the rest): the worker's reduced models repeat the first and the last kind."""
    first = (cfg.layer_types[0], cfg.mlp_layer_types[0])
    n_first = sum(1 for k in zip(cfg.layer_types, cfg.mlp_layer_types) if k == first)
    return n_first, cfg.num_hidden_layers - n_first


def depth_fit(results: list, key: str, full: tuple[int, int]) -> dict | None:
    """Least-squares `value = base + dense * per_dense + moe * per_moe` over the compiled depths of at
    least 2 layers per kind, and its value at the full depth; None unless they pin down all three terms
    (e.g. 2:2, 3:2, 2:4); "off_trend": the largest distance of a compiled depth from the fit (0 with three
    depths: a fourth shows whether one of them peaks off the trend). A one-layer scan is left out: XLA removes
    a loop of one trip, so its forward and backward stop sharing buffers (1+1 compiles to a larger peak than
    2+2 at M3 widths)."""
    results = [r for r in results if r["dense"] >= 2 and r["moe"] >= 2]
    a = np.array([[1.0, r["dense"], r["moe"]] for r in results])
    if len(results) < 3 or np.linalg.matrix_rank(a) < 3:
        return None
    values = np.array([r[key] for r in results])
    coef = np.linalg.lstsq(a, values, rcond=None)[0]
    return {"base": coef[0], "per_dense": coef[1], "per_moe": coef[2],
            "full": coef[0] + coef[1] * full[0] + coef[2] * full[1],
            "off_trend": float(np.max(np.abs(a @ coef - values)))}


def analytic_fit(results: list, full: tuple[int, int]) -> dict | None:
    """The analytic side scaled to the full depth one peak at a time: each peak of `memory_phases` (backward,
    update) is affine in the layers of each kind, and their maximum is not. At reduced depth the update peak can
    bind where the backward binds at full depth (the 128-expert H200 recipe: update at 2+2, 3+2 and 2+4, backward
    at 3+5), and a fit of the maximum then scales the update peak, whose per-layer cost holds no micro-batch
    gradient (11.38 GB per MoE layer beside the backward's 13.49 there). Returns `depth_fit`'s keys for the
    peak that binds at full depth, named under "phase" (None for results without their phases)."""
    if "analytic_phases" not in results[0]:
        fit = depth_fit(results, "analytic", full)
        return fit and {**fit, "phase": None}
    fits = {name: depth_fit([{**r, "analytic": r["analytic_phases"][name]} for r in results], "analytic", full)
            for name in results[0]["analytic_phases"]}
    if any(f is None for f in fits.values()):
        return None
    phase = max(fits, key=lambda name: fits[name]["full"])
    return {**fits[phase], "phase": phase}


def binding_phase(result: dict) -> str:
    """The analytic peak that binds at this compiled depth ("" for a result without its phases)."""
    phases = result.get("analytic_phases") or {"": 0.0}
    return max(phases, key=phases.get)


def print_compile(job, results: list, gpu_plan_full: float, compiler: str = "XLA:CPU",
                  planned_total: float | None = None) -> None:
    """XLA's per-device figures next to the analytic plan of the same model as `compiler` runs it, at each
    reduced depth, then both scaled per layer to the full depth; `gpu_plan_full` is the plan of the full
    model's step on the GPU (ragged exchange, bf16 activations), for reference, and `planned_total` the run's
    whole plan (the verdict's), where it holds more (a KL reference on the device, which the compiled step
    does not)."""
    print(f"  {'dense+moe':>9s} {'XLA peak':>9s} {'args':>7s} {'temp':>7s} {'analytic':>9s} {'binds':>8s} "
          f"{'state':>7s} {'an/XLA':>6s} {'lower':>6s} {'compile':>7s}   (GB; XLA args = state + batch; s)")
    for r in results:
        print(f"  {r['dense']:>5d}+{r['moe']:<3d} {r['peak'] / GB:9.4g} {r['argument'] / GB:7.4g} "
              f"{r['temp'] / GB:7.4g} {r['analytic'] / GB:9.4g} {binding_phase(r):>8s} "
              f"{r['analytic_state'] / GB:7.4g} {r['analytic'] / r['peak']:6.2f} {r['lower_s']:6.0f} "
              f"{r['compile_s']:7.0f}")
    full = layer_counts(job.model)
    # The full depth itself, where it was compiled: no fit between it and the plan (a fit over reduced depths
    # carries whatever one of them does off the trend: 2+2 of the 128-expert H200 recipe peaks at another point of
    # the MoE backward than 2+3 and deeper, 1.55 GB lower, and its fit read 91.99 GB where 3+5 compiles to 91.27).
    for r in results:
        if (r["dense"], r["moe"]) == full:
            print(f"  full depth ({full[0]}+{full[1]} layers) compiled: {compiler} {r['peak'] / GB:.4g} GB vs "
                  f"analytic {r['analytic'] / GB:.4g} GB (analytic/XLA {r['analytic'] / r['peak']:.2f})")
    xla, ana = depth_fit(results, "peak", full), analytic_fit(results, full)
    if xla is None:
        print("  (compile three depths of >= 2 layers per kind, such as 2:2,3:2,2:4, to scale XLA's figure to the "
              "full depth)")
        return
    peak = f" ({ana['phase']} peak, the one binding at full depth)" if ana["phase"] else ""
    print(f"  per layer: first kind XLA {xla['per_dense'] / GB:.4g} GB vs analytic {ana['per_dense'] / GB:.4g} GB; "
          f"second kind XLA {xla['per_moe'] / GB:.4g} GB vs analytic {ana['per_moe'] / GB:.4g} GB{peak}")
    print(f"  full depth ({full[0]}+{full[1]} layers), scaled per layer: {compiler} {xla['full'] / GB:.4g} GB vs "
          f"analytic {ana['full'] / GB:.4g} GB (analytic/XLA {ana['full'] / xla['full']:.2f})")
    if sum(1 for r in results if r["dense"] >= 2 and r["moe"] >= 2) > 3:
        print(f"  (the compiled depths lie up to {xla['off_trend'] / GB:.3g} GB off XLA's fit)")
    sizes = "bf16 activations" if compiler != "XLA:CPU" else "fp32-sized activations"
    more = (f"; the run's, with what the step does not hold (a KL reference on the device): {planned_total / GB:.4g} "
            "GB" if planned_total is not None and planned_total > gpu_plan_full * (1 + 1e-9) else "")
    print(f"  (analytic as {compiler} runs it: {results[0]['exchange']} expert exchange, {sizes}; "
          f"the GPU plan of the full model's step: {gpu_plan_full / GB:.4g} GB{more})")
