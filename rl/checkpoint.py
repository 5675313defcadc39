"""Orbax checkpoints of a GRPO run: every N steps and by a wall-clock deadline, async, keep-N, resumable.

What a step's checkpoint holds (grpo-reference §4): the exact fp32 master of the params, the inner
optimizer state (moments, counters), the non-trainable state, step and skip counters, and in a JSON
item the data-loader position, the PRNG seed, the weight version and the config the run was trained under
(`rl.resume_checks`); after a KL reference reset, the reference's
params too (`reference`, and its step in the JSON). Saving the master rather than
(params, remainder) makes a checkpoint independent of the precision mode and of the mesh: restoring
builds the current run's layout from it (fp32 params <-> bf16 + fp32 master <-> bf16 + remainder),
onto the current run's shardings (orbax restores against an abstract target; `rl.checkpoint_state`).

A crash or a failed write during a save leaves `<step>.orbax-checkpoint-tmp*`, which a restore ignores and the next
run on the directory deletes (in the background, before its first save). orbax itself removes one only when the same
step is saved again, which a step saved for a signal or a deadline, or under another `checkpoint.every_steps`, never
is: a save that failed on a full disk kept its partial bytes there, and its rerun could fail for want of them. An old
step that keep-N removes is first moved whole into `deleted/` and removed from there (once the save that moved it has
ended, at the run's end, or at the next start after a crash), so a crash mid-removal leaves no half-deleted step
listed as a checkpoint. A
damaged finished checkpoint is skipped with a warning and the previous one used, also where only its bytes changed
(bit rot, a bad copy: each array's checksum is kept in the meta and checked at the restore, `rl.checkpoint_sums`).
A save that fails (a full disk, a lost mount) raises `CheckpointSaveFailed` at the next step or save (a synchronous
one at once, the last one at the run's end), naming the step, the cause and the free space: the run stops there,
rather than training on past a checkpoint it cannot write. In a multi-host job every process raises it at the same
step, also where the write failed on another process only (`rl.checkpoint_job`).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

import jax
import orbax.checkpoint as ocp
from flax import nnx

from rl import checkpoint_job, checkpoint_sums
from rl.checkpoint_logs import _cause, _Demote, _orbax_errors_to_run_log, _quiet_abandoned_reads, read_failure
from rl.checkpoint_job import job_max as _job_max, job_steps as _job_steps
from rl.checkpoint_keep import KeepSteps, preservation
from rl.checkpoint_state import (abstract_tree, portable_state, rebuild_state, restore_target, state_mismatch,
                                 state_restore_args)
from sharding.train_step import TrainState

log = logging.getLogger(__name__)

# orbax moves a step it removes (keep-N) into this subdirectory first, in one rename (`todelete_subdir`), and the
# checkpointer removes it from there; not a step name, so orbax never lists it
DELETED = "deleted"


class CheckpointMismatch(ValueError):
    """A checkpoint that reads, but holds another model's or optimizer's state than this run's config builds."""


class CheckpointsUnreadable(CheckpointMismatch):
    """A run directory that holds checkpoints none of which reads: a resume does not start over beside them (its
    saves would overwrite steps that a repaired filesystem could still have given back)."""


def write_failed(what: str, error: Exception, directory: str, resume: str) -> str:
    """The line a run stops with when it cannot write (a checkpoint, or anything else in its directory): what failed,
    the cause `error` names, the free space in `directory`, and where a rerun resumes (`resume`, e.g. "step 20")."""
    cause = str(error) if isinstance(error, checkpoint_job.FailedElsewhere) else _cause(error)
    try:
        free = f"{shutil.disk_usage(directory).free / 1e9:.2f} GB free there"
    except OSError:
        free = "its free space unknown"
    return (f"{what} failed: {cause} ({free}); the run stops here, and rerunning the command resumes from {resume} "
            "once that is fixed")


class CheckpointSaveFailed(RuntimeError):
    """A checkpoint could not be written: the run stops (the message names the step, the cause, the free space and
    the step a rerun resumes from)."""


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, read_only: bool = False,
                 keep_best: int = 0):
        """read_only: a reader (python -m m3jax.eval) that creates, saves and deletes nothing. keep: the newest
        checkpoints kept; keep_best > 0: also those of `keep_best_steps` (rl.checkpoint_keep)."""
        self.directory = os.path.abspath(directory)
        self.best = KeepSteps() if keep_best and not read_only else None
        self.read_only = read_only
        self.async_save = async_save
        self._saving = None  # the step of the last save started
        self._unchecked = False  # that save may have ended in a failure not yet raised
        self._error = None  # its failure on this process, which orbax raises once (`wait` may have taken it)
        self._sums = (None, None)  # (step, its checksums) of the last state restored, for `restore_reference`
        # orbax warns that a read-only directory is read only: what was asked for, so not on the terminal
        notice = _Demote("Given directory is read only")
        logging.getLogger("absl").addFilter(notice)
        # a multi-host save's barriers give up on a write another process announced failed (rl.checkpoint_job).
        # A synchronous save is orbax's async one waited for (`save`): orbax's synchronous Checkpointer waits for
        # the other processes' writes in a device collective, which never ends where one of them failed.
        barrier = checkpoint_job.Barrier() if jax.process_count() > 1 and not read_only else None
        try:
            self.manager = ocp.CheckpointManager(
                self.directory, item_names=("state", "meta", "reference"),
                options=ocp.CheckpointManagerOptions(preservation_policy=None if read_only else
                                                     preservation(keep, self.best),
                                                     save_interval_steps=0 if read_only else 1,
                                                     enable_async_checkpointing=not read_only,
                                                     create=not read_only, read_only=read_only,
                                                     cleanup_tmp_directories=not read_only,
                                                     todelete_subdir=None if read_only else DELETED,
                                                     async_options=ocp.AsyncOptions(barrier_sync_fn=barrier)))
        finally:
            logging.getLogger("absl").removeFilter(notice)
        self._remover = None  # the thread removing what orbax moved to DELETED
        self._remove_deleted()  # a run killed while it removed them

    def _remove_deleted(self, wait: bool = False) -> None:
        """Remove the steps orbax has moved to DELETED, on a thread of its own (wait: here, after the one running, and
        DELETED itself, which a save may be renaming into: only at the close). orbax deleted an old step in place,
        file by file: a run killed meanwhile left a step without its metadata that was still listed as a checkpoint,
        and for good after the run's last save (a helper's kill fuzz). A step moves there whole, in one rename, on the
        primary host (process 0), which alone removes them."""
        if self.read_only or jax.process_index() != 0:
            return
        where = os.path.join(self.directory, DELETED)
        doomed = [os.path.join(where, name) for name in (os.listdir(where) if os.path.isdir(where) else ())]
        before, self._remover = self._remover, None

        def remove():
            if before is not None:  # one thread at a time (a name both list is removed once, the other finds none)
                before.join()
            for path in doomed:
                shutil.rmtree(path, ignore_errors=True)

        if wait:
            remove()
            try:
                os.rmdir(where)
            except OSError:  # never made, or written into since
                pass
        elif doomed:
            self._remover = threading.Thread(target=remove, name="rl.checkpoint:remove-deleted", daemon=True)
            self._remover.start()
        else:
            self._remover = before

    def keep_best_steps(self, steps) -> None:
        """With keep_best: the steps whose checkpoints stay beside the newest (the best evaluations')."""
        if self.best is not None:
            self.best.steps = frozenset(steps)

    def steps(self) -> list[int]:
        """The finished checkpoints' steps, oldest first."""
        return sorted(self.manager.all_steps())

    def none_reads(self) -> "CheckpointsUnreadable":
        """The error of a directory whose checkpoints all failed to read (each named in a warning as it failed)."""
        return CheckpointsUnreadable(
            f"no checkpoint in {self.directory} reads (steps {', '.join(map(str, self.steps()))}; the warnings "
            "above say why): fix or move them, or start over in a new run.out_dir")

    def job_steps(self) -> list[int]:
        """Process 0's finished steps, newest first, on every process of the job (a collective): what
        `restore_latest` tries, so every process decides alike whether the job resumes."""
        return _job_steps(sorted(self.manager.all_steps(), reverse=True))

    def _check_state(self, step: int, target: dict) -> None:
        """Raise CheckpointMismatch when checkpoint `step` holds another state than `target`: a config changed
        between the run that saved it and this one. Such a checkpoint is not damaged, so it must not be set
        aside for an older one or for a fresh start, which would then save new steps beside it."""
        why = state_mismatch(os.path.join(self.directory, str(step), "state"), target)
        if why:
            raise CheckpointMismatch(
                f"checkpoint step {step} in {self.directory} holds another state than this run's config builds: "
                f"{why}; expected the model, precision and optimizer config that wrote it: resume with that config, "
                "or start this one in another run.out_dir (or run.name)")

    def restore_step(self, step: int, like: TrainState, params_only: bool = False) -> tuple[TrainState, dict]:
        """Checkpoint `step` rebuilt into the layout of `like`; no fallback (an unreadable one raises
        CheckpointsUnreadable naming it, one of another state CheckpointMismatch). params_only: as
        `restore_latest`'s."""
        target = restore_target(like)
        self._check_state(step, target)
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(state=state_restore_args(target, params_only),
                                                                     meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - orbax / TensorStore raise many kinds for damaged files
            _quiet_abandoned_reads()
            raise CheckpointsUnreadable(f"checkpoint step {step} in {self.directory} is unreadable "
                                        f"({read_failure(e)})") from None
        why = _meta_problem(step, got["meta"]) or self._sums_problem(step, got)
        if why:
            raise CheckpointsUnreadable(f"checkpoint step {step} in {self.directory} is unreadable ({why})")
        return rebuild_state(like, got["state"]), _without_sums(got["meta"])

    def read_meta(self, step: int) -> dict:
        """Checkpoint `step`'s meta alone (no array is read); CheckpointsUnreadable when it cannot be read."""
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds for damaged files
            meta, why = None, read_failure(e)
        else:
            why = _meta_problem(step, meta)
        if why:
            raise CheckpointsUnreadable(f"checkpoint step {step} in {self.directory} is unreadable ({why})")
        return _without_sums(meta)

    def save(self, step: int, state: TrainState, meta: dict, reference=None) -> float:
        """Start saving (returns at once when async; a synchronous save's failure raises here, on every process of
        the job); the seconds spent blocking are returned. reference: the KL
        reference's params when they are not the starting weights (after a `grpo.reference_reset_every_steps`
        reset), saved beside the state as they are (the policy's dtype)."""
        t0 = time.perf_counter()
        self.check_saves()  # an earlier async save that failed stops the run before another starts
        items = {"state": portable_state(state)}
        if reference is not None:
            items["reference"] = nnx.to_pure_dict(reference)
        meta = {**meta, checkpoint_sums.KEY: checkpoint_sums.checksums(items)}  # checked at every restore
        extra = {} if reference is None else {"reference": ocp.args.StandardSave(items["reference"])}
        if self._saving is None:  # orbax's own reports of a failed save, and its writes that end after it (into a
            # closed event loop): run.log, where the error this raises says it in a line
            logging.getLogger("absl").addFilter(_orbax_errors_to_run_log)
            _quiet_abandoned_reads()
        self._saving, self._unchecked, self._error = step, True, None
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(items["state"]),
                                                            meta=ocp.args.JsonSave(meta), **extra), force=True)
        except Exception as e:  # noqa: BLE001 - orbax / TensorStore raise many kinds for a failed write
            raise self._failed(e) from None
        if not self.async_save:
            self.check_saves(wait=True)
        return time.perf_counter() - t0

    def check_saves(self, wait: bool = False) -> None:
        """Raise CheckpointSaveFailed if an async save that has ended failed; returns at once otherwise (while one
        runs too; wait: until it has ended). orbax keeps a background failure in its finalize thread, raised by the
        wait for it.

        In a multi-host job every process calls this at the same points (each step, each save) and all decide alike
        (`checkpoint_job.save_states`): all raise when the save failed on any process, and the save counts as ended
        once it has on all. A process deciding alone raised where its write failed while the others trained on
        into their next collective."""
        if not self._unchecked:
            return
        state = checkpoint_job.RUNNING
        if self._error is None and (wait or not self.manager.is_saving_in_progress()):
            try:
                self.manager.wait_until_finished()  # (unless `wait`) the save has ended: no wait, its failure raised
                state = checkpoint_job.ENDED
            except Exception as e:  # noqa: BLE001
                self._error = e
        if self._error is not None or state == checkpoint_job.RUNNING and checkpoint_job.failures():
            state = checkpoint_job.FAILED
        error = self._error
        states = checkpoint_job.save_states(state)
        if checkpoint_job.FAILED in states:
            failed = checkpoint_job.failures()
            if error is None or isinstance(error, checkpoint_job.FailedElsewhere) and failed:
                error = checkpoint_job.FailedElsewhere(checkpoint_job.describe(failed) if failed else
                                                       "it failed on another process of the job: its log says why")
            raise self._failed(error) from None
        if min(states) == checkpoint_job.ENDED:
            self._unchecked = False  # once per save: the wait logs a line to run.log each time
            self._remove_deleted()  # the steps its finalize moved out: `keep` checkpoints on disk, not keep + 1

    def _sums_problem(self, step: int, got) -> str | None:
        """What the checksums kept in checkpoint `step`'s meta say of its restored state (rl.checkpoint_sums); they
        are kept for `restore_reference` of the same step."""
        self._sums = (step, got["meta"].get(checkpoint_sums.KEY))
        return checkpoint_sums.problem(self._sums[1], {"state": got["state"]})

    def _failed(self, e: Exception) -> CheckpointSaveFailed:
        log.debug("checkpoint step %s failed to save", self._saving, exc_info=(type(e), e, e.__traceback__))
        finished = [s for s in self.steps() if s != self._saving]
        return CheckpointSaveFailed(write_failed(f"saving checkpoint step {self._saving} to {self.directory}", e,
                                                 self.directory, f"step {finished[-1] if finished else 0}"))

    def restore_reference(self, step: int, like_params):
        """The KL reference saved with checkpoint `step`, as a tree like `like_params` placed as they are."""
        got = self.manager.restore(step, args=ocp.args.Composite(
            reference=ocp.args.StandardRestore(nnx.to_pure_dict(abstract_tree(like_params)))))
        saved_step, sums = self._sums
        why = checkpoint_sums.problem(sums if saved_step == step else None, {"reference": got["reference"]})
        if why:  # the state of this step was restored already: no fallback to an older step here
            raise CheckpointsUnreadable(
                f"checkpoint step {step} in {self.directory} is damaged ({why}): move it aside (to "
                f"{os.path.join(self.directory, f'{step}.unreadable')}) to resume from the checkpoint before it")
        params = jax.tree.map(lambda x: x, like_params)  # a fresh State to fill
        nnx.replace_by_pure_dict(params, got["reference"])
        return params

    def restore_latest(self, like: TrainState, params_only: bool = False) -> tuple[TrainState, dict] | None:
        """The newest readable checkpoint rebuilt into the layout of `like` (the freshly built state). One that
        reads but holds another state (a changed config) raises CheckpointMismatch rather than being skipped.
        params_only: the params and the non-trainable state alone, for a reader (export, evaluation): the optimizer
        state is left as it is in `like` and is not read (the moments: twice the fp32 params, which an export
        then held beside them for nothing).

        In a multi-host job every process restores the same step: process 0's list of steps is tried, and a step
        unreadable on any process (each reads its own shards) is skipped by all. Each process deciding alone, a
        two-host resume whose newest checkpoint one host could not read had the hosts resume from different steps,
        and both hung in their first collective until jax's shutdown barrier killed them."""
        steps = self.job_steps()
        target = restore_target(like)
        unreadable = []
        for step in steps:
            try:
                self._check_state(step, target)
                mismatch = None
            except CheckpointMismatch as e:
                mismatch = e
            if _job_max(mismatch is not None):  # before any process restores: all raise, none restores
                raise mismatch or CheckpointMismatch(
                    f"checkpoint step {step} in {self.directory} holds another state than this run's config builds, "
                    "as read by another process of the job (its log names the difference): resume with the config "
                    "that wrote it, or start this one in another run.out_dir (or run.name)")
            try:
                got = self.manager.restore(step, args=ocp.args.Composite(
                    state=state_restore_args(target, params_only), meta=ocp.args.JsonRestore()))
                # valid JSON that is not what a save writes: as damaged as a file that does not parse
                why = _meta_problem(step, got["meta"])
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous one
                _quiet_abandoned_reads()
                got, why = None, read_failure(e)
                if jax.process_count() > 1:  # orbax's restore ends in a barrier the others wait in: take it too
                    ocp.multihost.sync_global_processes("Checkpointer:restore")
            if not _job_max(why is not None):  # read on every process: their checksums next, a collective whose
                why = self._sums_problem(step, got)  # words every process gets alike (so no second agreement)
                if why is None:
                    self._set_aside(unreadable)
                    return rebuild_state(like, got["state"]), _without_sums(got["meta"])
            log.warning("checkpoint step %d in %s is unreadable (%s); trying the previous one", step,
                        self.directory, why or "on another process of the job: its log says why")
            unreadable.append(step)
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Rename unreadable checkpoints newer than the one restored to `<step>.unreadable` (kept for
        inspection, ignored by orbax): the resumed run saves those steps again, and orbax refuses to
        save a step whose directory exists. (When no step is readable nothing is moved: the cause may
        be this run's layout rather than the files; nor by a read-only reader, which changes nothing.)"""
        if not steps or self.read_only:
            return
        if jax.process_index() == 0:
            for step in steps:
                path = os.path.join(self.directory, str(step))
                aside, n = f"{path}.unreadable", 1
                while os.path.exists(aside):
                    aside, n = f"{path}.unreadable{n}", n + 1
                os.rename(path, aside)
                log.warning("moved unreadable checkpoint step %d to %s", step, aside)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes("rl.checkpoint:set_aside")
        self.manager.reload()

    def wait(self, quiet: bool = False) -> None:
        """Until the last save has ended; one that failed raises CheckpointSaveFailed (quiet: only logs it, for a
        run already stopping with an error of its own; `check_saves` raises it afterwards)."""
        if self._error is None:
            try:
                self.manager.wait_until_finished()
            except Exception as e:  # noqa: BLE001 - orbax raises it once: kept for `check_saves` (a run's end)
                self._error = e
        if self._error is not None:
            failed = self._failed(self._error)
            if not quiet:
                raise failed from None
            log.debug("%s", failed)

    def close(self) -> None:
        try:
            # the removal of unfinished saves (cleanup_tmp_directories) runs in the background and orbax waits for it
            # only in a save: a checkpointer opened next on the directory would otherwise race it for the same files
            getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
            self.manager.wait_until_finished()
            self.manager.close()
            self._remove_deleted(wait=True)  # the last save's: a finished run holds `keep` checkpoints, no more
        finally:
            logging.getLogger("absl").removeFilter(_orbax_errors_to_run_log)


def _meta_problem(step: int, meta) -> str | None:
    """What is wrong with a checkpoint's JSON item, checked against what `rl.trainer`'s save writes (its users read
    `step`, `data` and `weight_version` unguarded); None when it is sound."""
    if not isinstance(meta, dict):
        return f"its meta holds a JSON {type(meta).__name__}; expected an object"
    for key, kind, name in (("step", int, "an integer"), ("data", dict, "an object (the loader's position)"),
                            ("weight_version", int, "an integer")):
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"its meta's {key!r} is {'missing' if key not in meta else repr(value)[:60]}; expected {name}"
    if meta["step"] != step:
        return f"its meta's 'step' is {meta['step']}; expected {step}, the checkpoint's own step"
    return None


def _without_sums(meta) -> dict:
    """A checkpoint's meta as the trainer wrote it: the checksums are the checkpointer's own."""
    return {k: v for k, v in meta.items() if k != checkpoint_sums.KEY}
