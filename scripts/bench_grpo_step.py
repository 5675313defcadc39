"""Where a GRPO step's time goes: run the CPU demo (configs/tiny.yaml) end to end and summarise metrics.jsonl.

Runs, as a subprocess,

    python -m m3jax.train --config configs/tiny.yaml run.out_dir=<tmp> logging.progress_bar=false [overrides]

timing its whole wall time, then reads <tmp>/metrics.jsonl (the last record of each step wins) and prints:

  * step 1 (includes tracing + XLA compilation of generate, logprobs and the train step) phase by phase;
  * the median seconds per phase over steps 2..end: time/generate, time/reward (decode + reward functions
    + advantages + batch building), time/logprobs, time/train, time/checkpoint, time/other;
  * host overhead. The trainer logs time/other = (step start .. after the checkpoint) minus the four
    timed phases, so it *includes* time/checkpoint; host overhead = other - checkpoint (the weight swap,
    mismatch metrics, metric dict, float() syncs), reported as a fraction of the whole step
    (generate + reward + logprobs + train + other);
  * the run's wall time, the sum of the logged steps, and the rest (process start, imports, model and
    data setup, logging between steps, HF export and plot at the end);
  * the reward curve: mean of the first 10 and last 10 steps' reward/mean, and the first step where
    reward/mean >= max(3 x first-10 mean, 0.5).

    .venv/bin/python scripts/bench_grpo_step.py
    .venv/bin/python scripts/bench_grpo_step.py --keep run.total_steps=50

--startup additionally builds the trainer in this process (no steps) and times its setup: config
parsing, `import rl.trainer`, rl.prompt_loader.build_data, rl.policy.build_policy, GRPOTrainer, and the number
and total seconds of XLA backend compilations during that setup (jax.monitoring's backend-compile event).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("generate", "reward", "logprobs", "train", "checkpoint", "other")


def read_metrics(path: str) -> list[dict]:
    rows = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def full_step(r: dict) -> float:
    """Step start .. after its checkpoint: the four timed phases + other (which includes the checkpoint)."""
    return sum(r[f"time/{p}"] for p in ("generate", "reward", "logprobs", "train", "other"))


def host_overhead(r: dict) -> float:
    return r["time/other"] - r["time/checkpoint"]


def startup_profile(config: str, overrides: list[str], out_dir: str) -> None:
    """Time the trainer's setup in this process: what the run spends before its first step."""
    import argparse as _argparse

    t0 = time.perf_counter()
    sys.path.insert(0, ROOT)
    import jax
    from jax._src import dispatch

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(secs) if event == dispatch.BACKEND_COMPILE_EVENT else None)
    from rl.config import add_arguments, from_args

    p = _argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args(["--config", config, f"run.out_dir={out_dir}", "logging.progress_bar=false",
                                  *overrides]))
    t1 = time.perf_counter()
    import rl.trainer as trainer_mod

    t2 = time.perf_counter()
    from rl.policy import build_policy

    timings = {}

    def timed(name, fn, *a):
        n0, c0 = len(compiles), time.perf_counter()
        out = fn(*a)
        timings[name] = (time.perf_counter() - c0, len(compiles) - n0, sum(compiles[n0:]))
        return out

    n0 = len(compiles)
    t3 = time.perf_counter()
    timed("build_data", trainer_mod.build_data, cfg)
    policy = timed("build_policy", build_policy, cfg)
    timed("GRPOTrainer(policy) (data again, passes, engine, checkpointer)", trainer_mod.GRPOTrainer, cfg, policy)
    t4 = time.perf_counter()
    print(f"\nstartup (in-process, --startup): config + jax import {t1 - t0:.2f} s, import rl.trainer {t2 - t1:.2f} s, "
          f"setup {t4 - t3:.2f} s with {len(compiles) - n0} XLA compiles ({sum(compiles[n0:]):.2f} s)")
    for name, (secs, n, csecs) in timings.items():
        print(f"  {name}: {secs:.2f} s, {n} XLA compiles ({csecs:.2f} s)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="extra dotted config overrides passed to m3jax.train")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--out-dir", default=None, help="run directory (default: a fresh temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directory")
    ap.add_argument("--startup", action="store_true", help="also time the trainer's setup in-process (see above)")
    args = ap.parse_args()

    out_dir = args.out_dir or tempfile.mkdtemp(prefix="m3bench_grpo_")
    cmd = [sys.executable, "-m", "m3jax.train", "--config", args.config, f"run.out_dir={out_dir}",
           "logging.progress_bar=false", *args.overrides]
    print("$ " + " ".join(cmd), flush=True)
    log_path = os.path.join(out_dir, "train.log")
    os.makedirs(out_dir, exist_ok=True)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    if rc != 0:
        with open(log_path) as f:
            sys.stderr.write(f.read()[-4000:])
        sys.exit(f"training exited with status {rc}; log: {log_path}")

    # training steps only (an evaluation of the initial policy is a row of its own, step 0)
    rows = [r for r in read_metrics(os.path.join(out_dir, "metrics.jsonl")) if "reward/mean" in r]
    first, rest = rows[0], rows[1:]
    n = len(rows)
    print(f"{n} steps logged (steps {rows[0]['step']}..{rows[-1]['step']}); wall time of the whole run "
          f"{wall:.1f} s; load average (1 min) at start / end: {load0[0]:.2f} / {load1[0]:.2f} on "
          f"{os.cpu_count()} cpus\n")

    print(f"{'phase':<12} | {'step 1 s':>8} | {'median s (2..end)':>17} | {'mean s':>7} | {'min s':>7} | "
          f"{'share of mean step':>18}")
    print("-" * 87)
    med_step = statistics.median(full_step(r) for r in rest)
    mean_step = statistics.mean(full_step(r) for r in rest)

    def line(name, vals, first_val):
        print(f"{name:<12} | {first_val:8.4f} | {statistics.median(vals):17.4f} | {statistics.mean(vals):7.4f} | "
              f"{min(vals):7.4f} | {statistics.mean(vals) / mean_step:18.1%}")

    for p in PHASES:
        line(p, [r[f"time/{p}"] for r in rest], first[f"time/{p}"])
    hov = [host_overhead(r) for r in rest]
    line("other - ckpt", hov, host_overhead(first))
    line("whole step", [full_step(r) for r in rest], full_step(first))
    frac = [host_overhead(r) / full_step(r) for r in rest]
    sum_steps = sum(full_step(r) for r in rows)
    sum_rest = sum(full_step(r) for r in rest)
    print("\n'other' as logged includes the checkpoint; 'other - ckpt' = host overhead; whole step = generate + reward"
          " + logprobs + train + other;\nshares of the mean step: generate + reward + logprobs + train + other = 100% "
          f"(checkpoint is inside other). Median whole step {med_step:.4f} s.")
    print(f"host overhead / step, steps 2..end: median {statistics.median(frac):.1%}, "
          f"total {sum(hov) / sum_rest:.1%} (sum of overhead / sum of steps)")
    ckpt_steps = [r["step"] for r in rest if r["time/checkpoint"] > 1e-3]
    if ckpt_steps:
        cs = [r["time/checkpoint"] for r in rest if r["step"] in ckpt_steps]
        print(f"checkpoint saves (steps {ckpt_steps}): median {statistics.median(cs):.4f} s, "
              f"total {sum(cs):.3f} s")
    gen_tok = [r["response/length_mean"] for r in rest]
    print(f"generate throughput (steps 2..end, logged throughput/tokens_per_s is per whole step): median "
          f"{statistics.median(r['throughput/tokens_per_s'] for r in rest):.0f} tok/s per step; "
          f"mean response length {statistics.mean(gen_tok):.2f}")
    print(f"time: run wall {wall:.1f} s = logged steps {sum_steps:.1f} s (step 1 {full_step(first):.1f} s, "
          f"steps 2..end {sum_rest:.1f} s) + the rest {wall - sum_steps:.1f} s (process start, imports, setup, "
          "per-step logging, export, plot)")

    rew = [r["reward/mean"] for r in rows]
    first10, last10 = statistics.mean(rew[:10]), statistics.mean(rew[-10:])
    target = max(3 * first10, 0.5)
    hit = next((r["step"] for r in rows if r["reward/mean"] >= target), None)
    print(f"\nreward/mean: first-10 mean {first10:.4f}, last-10 mean {last10:.4f}, max {max(rew):.4f}; "
          f"first step with reward >= max(3 x first-10 mean, 0.5) = {target:.4f}: {hit}")
    if args.startup:
        startup_profile(args.config, args.overrides, os.path.join(out_dir, "startup_profile"))
    print(f"run directory: {out_dir}" + ("" if (args.keep or args.out_dir) else " (removed)"))
    if not (args.keep or args.out_dir):
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
