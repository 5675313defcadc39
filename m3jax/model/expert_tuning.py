"""The routed experts' grouped-matmul kernel for a run, timed at the shapes one device gives it.

`moe_kernel: auto` is a rule on CPU (bucketed, measured). Elsewhere, and wherever `moe_kernel: tune` is set, the
trainer times the kernels the device runs (`sharding.kernel_tuning`) on one device's expert MLP of a micro-batch,
the shapes inside `sharding.expert.routed_experts`:

    T = rows per data rank x positions / context shards        tokens on the device
    W = receive_rows(T, k, n_ep, E_loc, capacity, exchange)    its receive buffer (T k on one device)
    rows [W, d] of which T k are filled, split over E_loc = E / n_ep experts as a balanced router would
    (a multinomial draw), gate_up [E_loc, 2, I / tensor, d], down [E_loc, d, I / tensor] in the parameter dtype

and keeps the fastest, forward and backward as the train step runs them, among those whose temporaries fit: a
kernel may be fast and hold far more memory than the tiled one the planner plans (Mosaic's were 25x tiled's at the
32-node recipe's pool, BENCHMARKS.md session 31), so where the run's plan says how much device memory the tiled
kernel leaves free (`headroom`), a kernel whose temporaries exceed tiled's by more is left out (`over_memory`).
The measurement is written to a record
(`<run.out_dir>/moe_kernel.json`); a restart of the run on the same device kind, jax and shapes reads the choice
from it instead of timing again, so a resumed run keeps its kernel.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.model.moe import grouped_experts
from sharding import kernel_tuning
from sharding.expert import default_exchange, receive_rows
from sharding.grouped_matmul import KERNELS
from sharding.layout import Layout, platform

log = logging.getLogger(__name__)

RECORD_FILE = "moe_kernel.json"
# What `model.moe_kernel` may say: a kernel, "auto", or "tune" (timed anywhere, CPU included).
CHOICES = ("auto", "tune") + tuple(k for k in KERNELS if k != "auto")


@dataclasses.dataclass(frozen=True)
class ExpertWork:
    """One device's grouped expert MLP in one micro-batch: rows of the receive buffer (`rows`, `filled` of them
    routed under a balanced load), local experts, model width, each expert's hidden width on the device, the
    parameter dtype, and whether the backward runs too."""
    rows: int
    filled: int
    experts: int
    hidden: int
    width: int
    dtype: str
    backward: bool = True


def needs_timing(moe_kernel: str, backend: str | None) -> bool:
    """Whether `moe_kernel` is chosen by timing on `backend`: "tune" anywhere, "auto" off a CPU (where no
    measured rule exists)."""
    return moe_kernel == "tune" or (moe_kernel == "auto" and platform(backend) != "cpu")


def expert_work(cfg, layout: Layout, rows_per_rank: int, positions: int, dtype, *,
                capacity_factor: float | None = None, exchange: str | None = None,
                backward: bool = True) -> ExpertWork:
    """The `ExpertWork` of a micro-batch of `rows_per_rank` rows of `positions` tokens on `layout` (see the module
    docstring for the formulas)."""
    tokens = rows_per_rank * positions // layout.size("act_seq")
    k, n_ep = cfg.num_experts_per_tok, layout.size("experts")
    local = cfg.num_local_experts // n_ep
    if layout.mesh is None:
        rows = tokens * k
    else:
        rows = receive_rows(tokens, k, n_ep, local, capacity_factor, exchange or default_exchange(layout.backend))
    return ExpertWork(rows, min(tokens * k, rows), local, cfg.hidden_size,
                      cfg.intermediate_size // layout.size("expert_mlp"), jnp.dtype(dtype).name, backward)


def expert_problem(cfg, work: ExpertWork, device=None, seed: int = 0):
    """(make, args): `make(kernel)(*args)` is the model's routed-expert MLP (`m3jax.model.moe.grouped_experts`) with
    that kernel on the rows and weights `work` describes, random, drawn on `device` (default: the first local one)
    in the work's dtype: at M3's widths a host copy in fp32 would be gigabytes; rows past the `filled` ones are
    padding."""
    device = device or jax.local_devices()[0]
    e = work.experts
    # a multinomial load around the balanced one: an even split would fill every tile and bucket exactly, hiding
    # the partial tiles and the overflow a real router's load brings (as gpu_check's check 5)
    sizes = np.random.default_rng(seed).multinomial(work.filled, np.full(e, 1 / e))
    group_sizes = jax.device_put(np.asarray(sizes, np.int32), device)

    @jax.jit
    def draw(key):
        dtype, d, i = jnp.dtype(work.dtype), work.hidden, work.width
        k_rows, k_in, k_out = jax.random.split(key, 3)
        rows = jax.random.normal(k_rows, (work.rows, d), dtype)
        rows = jnp.where(jnp.arange(work.rows)[:, None] < work.filled, rows, 0).astype(dtype)
        return rows, jax.random.normal(k_in, (e, 2, i, d), dtype) / d ** 0.5, \
            jax.random.normal(k_out, (e, d, i), dtype) / i ** 0.5

    def make(kernel):
        def fn(rows, gate_up, down):
            return grouped_experts(rows, group_sizes, gate_up, down, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
                                   kernel=kernel, backend=device.platform, expected_rows=work.filled / e)
        return fn

    return make, list(draw(jax.device_put(jax.random.key(seed), device)))


def time_expert_kernels(cfg, work: ExpertWork, kernels=None, *, device=None, rounds: int = 5,
                        seed: int = 0) -> kernel_tuning.Timings:
    """`sharding.kernel_tuning.Timings` of `expert_problem`'s MLP for `kernels` (default: every kernel the device
    runs, `sharding.kernel_tuning.candidate_kernels`), forward and backward when `work.backward`."""
    device = device or jax.local_devices()[0]
    kernels = tuple(kernels or kernel_tuning.candidate_kernels(device))
    make, args = expert_problem(cfg, work, device, seed)
    return kernel_tuning.time_candidates(make, args, kernels, diff_argnums=(0, 1, 2) if work.backward else (),
                                         device=device, rounds=rounds, seed=seed)


def over_memory(temp_bytes: dict[str, int | None], headroom: int | None, reference: str = "tiled") -> dict[str, str]:
    """{kernel: why} for the kernels whose temporaries exceed the `reference` kernel's by more than `headroom` bytes
    (the device memory the run's plan leaves free with the reference kernel, which it plans); none when the headroom
    or the reference's temporaries are unknown. A negative headroom (the plan does not fit even so) leaves out
    every kernel but those holding less than the reference by more than the shortfall."""
    base = temp_bytes.get(reference)
    if headroom is None or base is None:
        return {}
    free = _gb(max(headroom, 0))
    return {k: f"its temporaries ({_gb(t)}) exceed {reference}'s ({_gb(base)}) by more than the {free} the run's plan "
               "leaves free" for k, t in temp_bytes.items() if t is not None and t - base > headroom}


def within_memory(ms: dict[str, float], temp_bytes: dict, headroom: int | None) -> tuple[dict, dict[str, str]]:
    """(the timings of the kernels that fit the headroom (`over_memory`), {kernel left out: why}); where none fits
    (the plan is over the device's memory whatever runs), the kernel that adds the least is kept."""
    over = over_memory({k: temp_bytes.get(k) for k in ms}, headroom)
    fits = {k: v for k, v in ms.items() if k not in over}
    if over and not fits:
        least = min(over, key=lambda k: temp_bytes[k])
        fits, over = {least: ms[least]}, {k: v for k, v in over.items() if k != least}
    return fits, over


def tune_moe_kernel(cfg, work: ExpertWork, record_path: str | None = None, *, save: bool = True, rounds: int = 5,
                    device=None, headroom: int | None = None) -> str:
    """The fastest kernel for `work` on this device kind, read from the record at `record_path` (process 0's) when it
    was measured for the same device kind, jax and work, else timed on every process, the median over them
    deciding (`sharding.kernel_tuning.gather_timings`), and recorded there by process 0 when `save`. headroom: the
    device memory (bytes) the run's plan leaves free with the tiled kernel; a kernel whose temporaries exceed
    tiled's by more is not chosen (`over_memory`), and where none fits, the one with the fewest temporaries is."""
    device = device or jax.local_devices()[0]
    kernels = kernel_tuning.candidate_kernels(device)
    key = record_key(work, device)
    recorded, first = None, jax.process_index() == 0
    if first:
        record = kernel_tuning.read_record(record_path)
        if record is not None and record.get("key") == key and record.get("kernel") in kernels:
            recorded = record["kernel"]
        elif record is not None:  # the run resumes with other shapes, on another device or jax: its kernel may change
            log.warning("moe_kernel: the record in %s (%s) was measured for %s; timing again", record_path,
                        record.get("kernel"), record.get("key"))
    recorded = kernel_tuning.agree_on(recorded, kernels)  # process 0's record decides for every process
    if recorded is not None:
        log.info("moe_kernel: %s, as measured for this run before (%s)", recorded, record_path)
        return recorded
    log.info("moe_kernel: timing %s on %s for %s (once: the choice is kept in %s)", ", ".join(kernels),
             device.device_kind, work, record_path if save else "no record")
    timings = time_expert_kernels(cfg, work, kernels, device=device, rounds=rounds)
    ms, errors, temps = timings
    fits, too_big = within_memory(ms, temps, headroom)
    if too_big:
        log.warning("moe_kernel: left out for memory: %s", "; ".join(f"{k} ({why})" for k, why in too_big.items()))
    medians = kernel_tuning.gather_timings(fits, kernels)  # every process takes part, also one where nothing ran
    if not medians:
        every = " on every process" if jax.process_count() > 1 else ""
        why = f"failed here: {errors}" if errors else "none failed here; another process's log says why"
        raise RuntimeError(f"moe_kernel: no grouped-matmul kernel ran{every} on {device.device_kind} for {work} "
                           f"({why})")
    choice = kernel_tuning.fastest(medians)
    over = f"the median of {jax.process_count()} processes' " if jax.process_count() > 1 else ""
    log.info("moe_kernel: %s, the fastest on %s for %s (%smedian ms of %d rounds: %s; this process's ms and XLA's "
             "temporaries: %s%s)", choice, device.device_kind, work, over, rounds,
             ", ".join(f"{k} {v:.3f}" for k, v in medians.items()),
             ", ".join(f"{k} {v:.3f} ms {_gb(temps.get(k))}" for k, v in ms.items()),
             f"; failed: {errors}" if errors else "")
    if first and record_path and save:
        record_choice(record_path, work, device, choice, medians, timings, rounds, headroom, too_big)
    return choice


def record_key(work: ExpertWork, device) -> dict:
    """What a recorded choice was measured for: a run reads it back only where all of this is the same. (Not the
    memory headroom: an evaluation, which plans none, must read the kernel its run trained with.)"""
    return {"work": dataclasses.asdict(work), "device_kind": device.device_kind, "platform": device.platform,
            "jax": jax.__version__, "candidates": list(kernel_tuning.candidate_kernels(device))}


def record_choice(path: str, work: ExpertWork, device, choice: str, medians: dict[str, float],
                  timings: kernel_tuning.Timings, rounds: int, headroom: int | None = None,
                  over: dict[str, str] | None = None) -> None:
    """Record `choice` for `work` on `device`'s kind at `path` (`tune_moe_kernel` reads it back): the median ms
    over the processes that decided, this process's own timings and the kernels left out for memory (a warning
    where it cannot be written)."""
    _write(path, {"key": record_key(work, device), "headroom": headroom, "kernel": choice, "ms": medians,
                  "ms_process_0": timings.ms, "errors": timings.errors, "rounds": rounds,
                  "processes": jax.process_count(), "temp_bytes": timings.temp_bytes, "over_memory": over or {}})


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _write(path: str, record: dict) -> None:
    """The record, or a warning where it cannot be written: the run goes on with its choice, and a restart times
    the kernels again (and may choose another)."""
    try:
        kernel_tuning.write_record(path, record)
    except OSError as e:
        log.warning("moe_kernel: could not record the choice in %s (%s); a restart will time the kernels again",
                    path, e)
