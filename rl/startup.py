"""What a run says while it starts: one INFO line per phase as it ends, naming what it built and how long it took.

At scale the first step comes after a long start (each host's share of the 852 GB release read, vLLM engines
started and sent the weights, every held-out problem sampled); a job log that stays silent through them cannot tell
a slow phase from a hung one, nor say which phase the time went to. The last line shows what finished, so the next
phase is the one running.
"""

from __future__ import annotations

import logging
import math
import time

import jax

log = logging.getLogger(__name__)


class PhaseClock:
    """`done(message, *args)` logs the message with the seconds since the previous `done` (or since it was made)."""

    def __init__(self, clock=time.perf_counter):
        self.clock, self.t = clock, clock()

    def done(self, message: str, *args) -> float:
        now = self.clock()
        seconds, self.t = now - self.t, now
        log.info(message + " (%.1f s)", *args, seconds)
        return seconds

    def restart(self) -> None:
        """The next phase starts now (what came between is timed elsewhere)."""
        self.t = self.clock()


def prompts_line(cfg, num_records: int) -> str:
    d = cfg.data
    source = d.path if d.kind == "file" else f"the synthetic task {d.task!r}"
    return f"prompts: {num_records} from {source}, {cfg.grpo.prompts_per_step} x {cfg.grpo.group_size} samples a step"


def mesh_devices(mesh) -> list:
    """The devices a policy's step runs on: its mesh's, or jax's first without one (not the host's idle others)."""
    return jax.devices()[:1] if mesh is None else list(mesh.devices.flat)


def policy_line(cfg, params, layout, restored_step: int | None) -> str:
    """The parameters' count and dtype, where they came from, and the mesh they are on."""
    leaves = jax.tree_util.tree_leaves(params)
    count = sum(math.prod(x.shape) for x in leaves)
    dtypes = sorted({str(x.dtype) for x in leaves})
    if restored_step is not None:
        source = f"restored from checkpoint step {restored_step}"
    elif cfg.model.path:
        source = f"loaded from {cfg.model.path}"
    else:
        source = f"initialised at random (model.init_seed {cfg.model.init_seed})"
    mesh = layout.mesh
    devices = mesh_devices(mesh)
    hosts = len({d.process_index for d in devices})
    on = (f"{len(devices)} {devices[0].platform} device{'s' if len(devices) != 1 else ''}"
          + (f" of {hosts} hosts" if hosts > 1 else ""))
    if mesh is not None:
        on = "mesh " + " x ".join(f"{axis} {size}" for axis, size in mesh.shape.items()) + f" ({on})"
    elif (idle := len(jax.devices()) - 1) > 0:  # a one-device config on a host of several: said, not refused
        on = f"1 of {idle + 1} {devices[0].platform} devices (the mesh's axes multiply to 1: the other {idle} are idle)"
    return f"policy: {_count(count)} parameters ({', '.join(dtypes)}), {source}; on {on}"


def generation_line(cfg) -> str:
    g = cfg.generation
    if g.backend == "jax":
        return "generation: the JAX engine, on the policy's devices and weights"
    gpus = f", {g.vllm_tensor_parallel} devices each" if g.vllm_tensor_parallel > 1 else ""
    return f"generation: {g.vllm_servers} vLLM server{'s' if g.vllm_servers != 1 else ''}{gpus}, started"


def first_push_line(transfer: dict, what: str = "the initial weights", version: int = 0) -> str:
    """The start's push of a random model's weights to engines that began with vLLM's dummy ones (or a resume's of
    the restored weights), from `rl.weight_sync.sync_weights`' metrics."""
    probe = transfer.get("transfer/probe_max_abs_logprob_diff")
    checked = "" if probe is None else f"; their logprobs on the probe sequences within {probe:.2g} of the trainer's"
    return (f"{what} pushed to the engines as version {version}, {transfer['transfer/gb_per_s']:.3g} GB/s"
            f"{checked}")


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)
