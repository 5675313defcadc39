"""python -m m3jax.train --config configs/<name>.yaml [key.sub=value ...]
                        [--print-config | --export DIR [--step N|best]]

GRPO on MiniMax-M3. The config (a YAML chain of base + deltas, then dotted overrides) is validated in
full before any work starts. Rerunning the same command resumes from the run's latest checkpoint.
A run locks its directory (`<run.out_dir>/.lock`, rl.run_lock): a second run on it exits with status 3.
The terminal shows the progress bar, the project's INFO lines and warnings; everything else goes to
`<run.out_dir>/run.log` (rl.logs; `logging.level=debug` shows it all). A start refused for bad input before its
first step (one `error:` line) leaves the run directory as it found it (rl.refused_start).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys

from m3jax.cli_args import description, path_argument
from rl.checkpoint_keep import step_argument
from rl.config import ConfigError, add_arguments, checkpoint_dir, from_args, to_yaml
from sharding.cpu_threads import reserve_collective_threads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m m3jax.train", description=description(__doc__))
    add_arguments(parser)
    parser.add_argument("--export", type=path_argument, metavar="DIR", help="export the latest checkpoint's policy "
                        "to a HF directory and exit (on-demand export)")
    parser.add_argument("--step", type=step_argument, metavar="N", help="with --export: the checkpoint step to "
                        "export (default: the newest; best: the best held-out evaluation's, which "
                        "checkpoint.keep_best kept)")
    args = parser.parse_intermixed_args(argv)
    if args.print_config and args.export is not None:  # it printed the config and exported nothing, status 0
        parser.error("--print-config and --export are alternatives: --print-config prints the config and exits")
    if args.step is not None and args.export is None:
        parser.error("--step goes with --export DIR (the step to export)")
    reserve_collective_threads(os.environ)  # simulated CPU devices: before jax starts its CPU backend
    try:
        cfg = from_args(args, training=args.export is None)  # --export reads the run's checkpoints
    except ConfigError as e:
        print(f"config error:\n{e}", file=sys.stderr)
        if args.export is None and not args.print_config:
            _tell_the_job(args, e)
        return 2
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        return 0
    if args.export and not os.path.isdir(checkpoint_dir(cfg)):  # a mistyped run directory is not created
        print(f"error: no checkpoint to export in {checkpoint_dir(cfg)} (run.out_dir = {cfg.run.out_dir})",
              file=sys.stderr)
        return 1
    # One run per directory: lock it before anything in it changes (and before the heavy imports, so
    # that a second run is turned away at once). Process 0 holds it for the whole job.
    launch, ahead = _process_problem(cfg.mesh), None
    if launch or (ahead := _ahead_problem(cfg)):
        print(f"config error:\n{launch or ahead}", file=sys.stderr)
        if ahead:  # this host's copy refused: the others hear why (a launch problem cannot join the job)
            _tell_the_job(args, ConfigError(ahead))
        return 2
    from rl import logs, run_lock
    from rl.refused_start import RunDirBefore
    index = run_lock.process_index(cfg.mesh.process_id)
    before = RunDirBefore(cfg.run.out_dir, logs.log_file_name(index))
    writable, refusal = True, None
    try:
        lock = run_lock.lock_run_dir(cfg.run.out_dir, cfg.mesh.process_id, warn=False)
    except run_lock.RunLockHeld as e:
        lock, refusal = None, (f"error: {e}", 3)
    except OSError as e:  # a read-only or full filesystem: nothing of the run can be written there
        lock = None
        if not (args.export and e.errno in (errno.EROFS, errno.EACCES)):
            refusal = (f"error: the run directory {cfg.run.out_dir} cannot be written ({e})", 1)
        else:  # an export only reads the run (a finished run on a read-only mount, say): no lock, log or cache
            # there, and no run can be writing a directory that cannot be written
            writable = False
    refusal = _job_refusal(cfg, index, refusal)
    if refusal:
        print(refusal[0], file=sys.stderr)
        before.remove_created()  # the parents os.makedirs made before it failed (a name too long) are not left
        return refusal[1]
    refused = None
    try:
        logs.setup(cfg.run.out_dir if writable else None, cfg.logging.level, process_index=index)
        if lock is not None and lock.took_over:
            logging.getLogger("m3jax.train").warning("%s", lock.took_over)
        return _train(cfg, args, writable)
    except Refused as e:
        refused = e
        print(e.line, file=sys.stderr)
        return e.code
    except KeyboardInterrupt:  # Ctrl-C before the run's loop, or twice in it (once saves the step: rl.stop_signals)
        print(f"interrupted: stopped without saving; rerunning the command resumes from the last checkpoint in "
              f"{checkpoint_dir(cfg)}", file=sys.stderr)
        return 130
    finally:
        logs.teardown()
        if refused is not None and writable:
            before.undo(owner=lock is not None)
        if lock is not None:
            lock.release()
        if refused is not None and lock is not None:
            before.remove_created()


def _job_refusal(cfg, index: int, refusal: tuple[str, int] | None) -> tuple[str, int] | None:
    """Process 0's answer at the run's lock, (line, exit status) or None, on every process of a multi-host job
    (this process's own otherwise, without importing jax). Only process 0 takes the lock: refused and exiting alone,
    it left the others waiting in jax.distributed.initialize for a coordinator that never came (5 minutes, then an
    opaque error). So every process joins the job here, before any of them writes in the run directory, and reads
    process 0's answer from jax's key-value store (no device, no collective: the backend is not started)."""
    from sharding.launch import distributed_args
    args = distributed_args(cfg.mesh)
    if args is None or args.get("num_processes") == 1:
        return refusal
    import json

    from sharding.mesh import from_process_zero, init_distributed
    init_distributed(cfg.mesh.to_mesh_config())
    said = json.loads(from_process_zero(RUN_LOCK_KEY, json.dumps(refusal) if index == 0 else None))
    return None if said is None else (said[0], said[1])


RUN_LOCK_KEY = "m3jax.train:run_lock"  # process 0's answer at the run's lock, in jax's key-value store


def _tell_the_job(args, error: ConfigError) -> None:
    """A process of a multi-host job whose config is refused (its host's stale copy, a typo in its launch line) used
    to exit alone, leaving the others waiting 5 minutes in jax.distributed.initialize, then ended by jax ("another
    task died"). It joins the job its files and environment still name and says why it stops where the others read
    next: process 0 as its answer at the run's lock (`_job_refusal`), another in place of its start facts
    (rl.job_agreement), so every process stops at once naming it. Not where the job's own settings (`JOB_KEYS`) are
    what was refused or the launch is incomplete: joining would fail. It waits 60 s for the others to join (they
    start with it), not jax's 5 minutes: its own error is printed already."""
    from rl.config import JOB_KEYS, job_settings
    from sharding.launch import distributed_args, launch_problem
    if any(problem.startswith(JOB_KEYS) for problem in error.problems):
        return
    mesh = job_settings(args.config, args.overrides)
    if launch_problem(mesh):  # first: it names a launch variable that is not a number, where reading it raised
        return
    launch = distributed_args(mesh)
    if launch is None or launch.get("num_processes") == 1:
        return
    import json

    from rl.job_agreement import START, report_failure
    from sharding.mesh import from_process_zero, init_distributed, joined_process
    where = f" at {launch['coordinator_address']}" if launch.get("coordinator_address") else ""
    print(f"telling the job's other processes{where} why this one stops (waiting up to 60 s for them to join)",
          file=sys.stderr)
    init_distributed(mesh, timeout_s=60)
    said = "; ".join(error.problems)
    index, count = joined_process()
    if index == 0:
        from_process_zero(RUN_LOCK_KEY, json.dumps([f"config error: process 0's config was refused: {said}", 2]))
    else:
        report_failure(START, ConfigError(said), process_index=index, process_count=count)
        # Process 0 answers at the run's lock whether it goes on (a config every host shares refused everywhere: it
        # stops too). Going on, the others start their backends before they compare start facts, and a CPU or GPU
        # backend's start waits for every process's topology (2 to 5 minutes, then "Unable to initialize
        # backend"): take part in it.
        if json.loads(from_process_zero(RUN_LOCK_KEY, None, timeout_s=60)) is None:
            import jax
            jax.devices()


def _process_problem(mesh, environ=None) -> str | None:
    """A multi-host job's settings given in part (`sharding.launch.launch_problem`), or a mesh.process_id without a
    multi-host job (it names the log file and decides who takes the run's lock); the config's own checks hold it under
    mesh.num_processes."""
    from sharding.launch import distributed_args, launch_problem  # jax-free: this runs before the heavy imports
    if (problem := launch_problem(mesh, environ)) is not None:
        return problem
    if not mesh.process_id or distributed_args(mesh, environ) is not None:
        return None
    return (f"mesh.process_id = {mesh.process_id} in a single-process run (no mesh.num_processes / "
            "coordinator_address, nor a multi-host launch in the environment); allowed: null or 0, or with the job's "
            "other settings")


def _ahead_problem(cfg, environ=None) -> str | None:
    """Draw-ahead with the JAX engine in a multi-host job: its generation is one program over every process's
    devices, which a background thread would launch beside the step's programs, so the processes would issue their
    collectives in different orders (gloo stopped both processes of a two-host run at its first overlap: "Is there
    a distributed collective mismatch in your code?"). With the vLLM pool the draw runs on process 0 alone and is
    shared from the main thread (rl.shared_draw)."""
    from sharding.launch import distributed_args
    args = distributed_args(cfg.mesh, environ)
    if (not cfg.grpo.max_trajectory_age_steps or cfg.generation.backend != "jax" or args is None
            or args.get("num_processes") == 1):
        return None
    return (f"grpo.max_trajectory_age_steps = {cfg.grpo.max_trajectory_age_steps} with generation.backend = \"jax\" "
            "in a multi-host job: the JAX engine's generation spans every process's devices, and on a background "
            "thread its collectives would be issued in different orders beside the train step's; allowed: 0, or "
            "generation.backend = \"vllm\" (whose draw ahead runs on process 0 alone)")


class Refused(Exception):
    """Bad input found while the run was being built, before its first step: `line` is what to print. The run
    directory is then left as this start found it (rl.refused_start)."""

    def __init__(self, line: str, code: int = 1):
        super().__init__(line)
        self.line, self.code = line, code


def _train(cfg, args, writable: bool = True) -> int:
    from rl.input_errors import input_errors
    from sharding.compile_cache import use_compilation_cache
    from sharding.mesh import init_distributed, set_memory_fraction

    # Both before anything starts JAX's backend or compiles.
    try:
        cache_note = use_compilation_cache(cfg.run.compilation_cache if writable else None, cfg.run.out_dir)
    except OSError as e:
        raise Refused(f"config error: run.compilation_cache = {cfg.run.compilation_cache}: {e.filename or ''} cannot "
                      f"be created ({e.strerror or e}); expected a directory this process can write, or null", 2)
    for note in (set_memory_fraction(cfg.mesh.device_memory_fraction), cache_note):
        if note:
            logging.getLogger("m3jax.train").warning("%s", note)
    # A process of a multi-host job joins it before anything asks JAX for its backend (the expert-kernel timing's
    # platform check below does; jax refuses to join after that, and every host of a job died at start). It has
    # already (`_job_refusal`, to hear process 0 at the lock): a no-op then.
    init_distributed(cfg.mesh.to_mesh_config())
    # Heavy imports only once the config is known to be good and the directory is ours.
    if args.export:
        from rl.policy import export_latest  # the model and its checkpoint only: no data, no engines

        try:
            step, path = export_latest(cfg, args.export, args.step)
        except (*input_errors(), OSError) as e:  # OSError: a full or read-only destination
            raise Refused(f"error: {e}") from None
        print(f"exported step {step} to {path}")
        return 0
    from rl.checkpoint import CheckpointMismatch, CheckpointSaveFailed, write_failed
    from rl.process_zero_writes import OutputsFailed
    from rl.skipped_updates import UpdatesSkipped
    from rl.trainer import GRPOTrainer

    try:
        trainer = GRPOTrainer(cfg, kernel_headroom=_kernel_headroom(cfg))
    except NotImplementedError as e:
        raise Refused(f"config error: {e}", 2) from None
    except input_errors() as e:  # the model, checkpoint, prompt file or mesh: refused before the first step
        raise Refused(f"error: {e}") from None
    _warn_if_the_plan_does_not_fit(cfg, trainer.policy.model_cfg)
    try:
        last = trainer.run()
    except CheckpointMismatch as e:  # the resume's, before the first step
        raise Refused(f"error: {e}") from None
    # a failed save, a diverged run, process 0's outputs unwritable (on the other processes): the log and checkpoints
    # stay
    except (CheckpointSaveFailed, UpdatesSkipped, OutputsFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in STORAGE_ERRORS:
            raise
        # the run directory's disk filled (metrics.jsonl, the rollout files): the same line as a failed save's
        logging.getLogger("m3jax.train").debug("a write into the run directory failed", exc_info=True)
        try:
            steps = trainer.checkpointer.steps()
            resume = f"step {steps[-1] if steps else 0}"
        except OSError:  # a lost mount
            resume = "its last checkpoint"
        print("error: " + write_failed(f"writing into the run directory {cfg.run.out_dir}", e, cfg.run.out_dir, resume),
              file=sys.stderr)
        return 1
    if trainer.resumed_from >= cfg.run.total_steps:
        print(f"nothing to train: {trainer.checkpointer.directory} holds step {trainer.resumed_from} and "
              f"run.total_steps = {cfg.run.total_steps} (raise it to train further); run directory {cfg.run.out_dir}")
        return 0
    if trainer.stopped_by:
        print(f"stopped by {trainer.stopped_by} after step {trainer.last_step} of {cfg.run.total_steps}, saved: "
              f"rerunning the command resumes from there; run directory {cfg.run.out_dir} (log: run.log)")
        return 0 if trainer.stopped_by == "run.max_wall_minutes" else 128 + _signal_number(trainer.stopped_by)
    held = ""
    if "val/pass@1" in last:  # the evaluation after the last step, and the best of the run
        held = f", held-out pass@1 {last['val/pass@1']:.3f}"
        if trainer.best:
            held += f" (best {trainer.best['metric']} {trainer.best['value']:.3f} at step {trainer.best['step']})"
        if trainer.kept:  # checkpoint.keep_best
            held += f"; the best evaluations' checkpoints kept: steps {', '.join(str(e['step']) for e in trainer.kept)}"
    steps, reward = cfg.run.total_steps, last.get('reward/mean', float('nan'))
    print(f"done: {steps} step{'s' if steps != 1 else ''}, last reward {reward:.3f}{held}; "
          f"run directory {cfg.run.out_dir} (log: run.log)")
    return 0


# A run directory that stopped taking bytes: full, over quota, remounted read-only, or its mount lost
STORAGE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def _signal_number(name: str) -> int:
    """The exit status of a run stopped by a signal is the shell's 128 + its number (so a scheduler sees the job
    did not finish); a stop another process of the job received counts as SIGTERM."""
    import signal
    return int(getattr(signal, name, signal.SIGTERM))


def _kernel_headroom(cfg) -> int | None:
    """What the plan leaves free of this device's memory with the tiled expert kernel (`kernel_headroom`), where the
    device reports its limit (a GPU) and the run's expert kernel is timed."""
    import jax

    from m3jax.model.expert_tuning import needs_timing
    if not needs_timing(cfg.model.moe_kernel, jax.default_backend()):
        return None
    return kernel_headroom(cfg, cfg.model.m3_config(), _device_limit())


def _device_limit() -> int | None:
    """What JAX may use of this process's first device (`memory_stats()["bytes_limit"]`); None where the device
    reports none (XLA:CPU)."""
    import jax
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def kernel_headroom(cfg, m3_cfg, limit_bytes: int | None) -> int | None:
    """The device memory (bytes) this run's plan leaves free under `limit_bytes` (what JAX may use of a device) with
    the tiled expert kernel, the one the planner plans: how far a timed kernel's temporaries may exceed tiled's
    (`m3jax.model.expert_tuning.over_memory`). None without a limit (XLA:CPU reports none), or where the planner
    cannot model the run (the timing then weighs speed alone)."""
    if not limit_bytes:
        return None
    from m3jax.plan.job import planned_peak
    try:
        return int(limit_bytes - planned_peak(cfg, m3_cfg, "tiled"))
    except Exception as e:  # noqa: BLE001 - the plan is advice; a config it cannot model must still train
        logging.getLogger("m3jax.train").warning("moe_kernel: no memory plan for this run (%s): the kernel timing "
                                                 "weighs speed alone", e)
        return None


def _warn_if_the_plan_does_not_fit(cfg, model_cfg) -> None:
    """On a device that reports its memory limit (a GPU), the planner's verdict before the first compile."""
    limit = _device_limit()
    if limit is None:
        return
    from m3jax.plan.job import fit_warning
    try:
        warning = fit_warning(cfg, model_cfg, limit)
    except Exception as e:  # noqa: BLE001 - the plan is advice; a config it cannot model must still train
        logging.getLogger("m3jax.train").debug("no memory plan for this run: %s", e)
        return
    if warning:
        logging.getLogger("m3jax.train").warning("%s", warning)


def _quiet_after_the_run() -> None:
    """Drop what libraries' threads log after `main` has returned, as the process exits: main's own line was the
    last word. After a failed save, orbax's writer threads and their asyncio tasks report the same failure again as
    they end; with run.log closed, they reached the terminal through the stderr handler orbax's own logging.info
    calls install on a root logger without handlers (~100 lines after the error line on a 1.5 MB tmpfs)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(logging.NullHandler())


if __name__ == "__main__":
    status = main()
    _quiet_after_the_run()
    sys.exit(status)
