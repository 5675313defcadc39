"""One GRPO run: rollout -> reward -> advantages -> logprobs -> update -> weight sync -> checkpoint.

The trainer is the only place that knows the order of the phases; each phase is a call into a module
with plain arrays in between (architecture.md). Everything random in a step derives from
(run.seed, step), and the data position is checkpointed, so a resumed run repeats exactly what an
uninterrupted one would have done.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import time

import jax
import numpy as np

from rl import evaluate as held_out
from rl import phases, rollout_log, shared_draw
from rl.ahead import AheadDraw, draws_ahead
from rl.checkpoint import CheckpointMismatch
from rl.config import RunConfig, checkpoint_dir
from rl.config_record import record_config
from rl.grpo.dapo import ShortSteps
from rl.job_agreement import START, agree_in_job, eval_facts, failed_in_job, start_facts
from rl.stop_signals import StopSignals
from rl.generation import backends
from rl.observe import RunLogger, draw_curves
from rl.perf import StepFlops, device_peak_flops
from rl.policy import (Policy, applied_learning_rate, build_or_restore_policy, checkpointer_for,
                       make_indexer_recall, make_logprobs, make_moe_counts, make_update, reference_params,
                       sequence_width)
from rl.process_zero_writes import NO_OUTPUTS, ProcessZeroWrites
from rl.prompt_loader import build_data
from rl.reference import ReferenceWeights
from rl.resume_checks import changes_warning, check as check_config, restore_naming_changes, trained_under
from rl.skipped_updates import SkippedUpdates
from rl.start_warnings import start_warnings
from rl.startup import PhaseClock, first_push_line, generation_line, mesh_devices, policy_line, prompts_line
from rl.watchdog import HangWatchdog
from rl.weight_sync import probe_check, probe_sampling, sync_weights
from rl.wandb_run import open_run as open_wandb_run
from sharding.precision import restart_adam

log = logging.getLogger(__name__)


class GRPOTrainer:
    """A GRPO run: the data, the policy (`rl.policy`), the generator and the checkpoints, and the loop.
    Construction builds all of them; a command that needs less (export) builds only its part. kernel_headroom:
    as `rl.policy.model_options`'s."""

    # (state, meta) of the checkpoint restored as the trainer was built (`build_or_restore_policy`), for `resume`
    _restored = None

    def __init__(self, cfg: RunConfig, policy: Policy | None = None, kernel_headroom: int | None = None):
        self.cfg = cfg
        self.run_dir = cfg.run.out_dir
        # the start hangs as a step can (prompts or a checkpoint on a filesystem that stopped answering, an engine
        # that never comes up); its limit is its own, a large model's start outlasting its steps
        self.start_watchdog = HangWatchdog(cfg.run.start_timeout_minutes, setting="run.start_timeout_minutes",
                                           resume_hint=self._resume_hint())
        self.start_watchdog.arm("the start (the prompts read, the policy built or restored, the generator started)")
        try:
            self._start(policy, kernel_headroom)
        except BaseException:
            self.start_watchdog.close()
            raise
        self.start_watchdog.disarm()  # `run` arms it for the resume: a trainer built and not run is never taken as hung

    def _resume_hint(self) -> str:
        return f"; rerunning the command resumes from the last checkpoint in {checkpoint_dir(self.cfg)}"

    def _start(self, policy: Policy | None, kernel_headroom: int | None) -> None:
        cfg = self.cfg
        os.makedirs(self.run_dir, exist_ok=True)
        self.loss_cfg = cfg.grpo.loss_config(cfg.generation.max_new_tokens)
        for line in start_warnings(cfg, cfg.model.m3_config()):
            log.warning("%s", line)
        self.phases = PhaseClock()  # a line as each phase of the start ends (rl.startup)
        try:
            self.tokenizer, self.loader, self.pad_id = build_data(cfg)
        except Exception as e:
            failed_in_job(START, e)  # the other processes stop at once, naming this one
            raise
        self.phases.done("%s", prompts_line(cfg, len(self.loader.records)))
        # a multi-host job's processes compare what each read from its own host, before any collective
        agree_in_job(START, lambda: start_facts(cfg, self.tokenizer, self.loader.records))
        self.checkpointer = checkpointer_for(cfg)
        try:
            self._build(policy, kernel_headroom)
        except BaseException:
            # A start refused here is undone (rl.refused_start removes what it created): the checkpointer's removal
            # of unfinished saves, which runs in the background, ends first, or it fails on a directory being removed
            # and prints its traceback after the run's error line.
            try:
                self.checkpointer.close()
            except Exception:  # noqa: BLE001 - the error being raised is the one to report
                log.debug("closing the checkpointer of a failed start", exc_info=True)
            raise

    def _build(self, policy: Policy | None, kernel_headroom: int | None) -> None:
        cfg = self.cfg
        if policy is None:  # a resuming run restores its checkpoint into a state built by shape here
            policy, self._restored = build_or_restore_policy(cfg, self.checkpointer, self.loss_cfg.kl, kernel_headroom)
        self.policy = policy
        self.phases.done("%s", policy_line(cfg, self.policy.state.params, self.policy.layout,
                                           self._restored[1]["step"] if self._restored else None))
        self.width = sequence_width(cfg, self.policy.model_cfg)
        # the KL's reference policy: the weights the run starts from (a resume restores the policy, not these), or
        # grpo.reference_path's
        self.reference = (ReferenceWeights(reference_params(cfg, self.policy), cfg.grpo.reference_memory)
                          if self.loss_cfg.kl != "none" else None)
        self.reference_step = 0  # the step whose policy the reference is (grpo.reference_reset_every_steps)
        self.train_step = make_update(self.policy, self.loss_cfg)
        self.logprobs = make_logprobs(self.policy)
        # The run's temperature with every token kept: what the KL's reference scores under, as verl's and TRL's do
        # (under its own top-k / top-p a token the moved policy sampled outside the reference's nucleus had an
        # infinite KL: clamped to a constant without gradient, or, clamps off, a skipped step), and the weight
        # probes (`rl.weight_sync.probe_sampling`): one pass for both, compiled at its first use.
        untruncated = probe_sampling(self.policy.sampling)
        self.untruncated_pass = (self.logprobs if untruncated == self.policy.sampling
                               else make_logprobs(self.policy, untruncated))
        # logging.indexer_recall_every / moe_drops_every: a forward of its own on a sample every N steps (models with
        # sparse / MoE layers)
        model = self.policy.model()
        self.recall = (make_indexer_recall(self.policy) if cfg.logging.indexer_recall_every
                       and model.num_sparse_layers else None)
        self.moe_counts = make_moe_counts(self.policy) if cfg.logging.moe_drops_every and model.num_moe_layers else None
        devices = mesh_devices(self.policy.layout.mesh)  # the devices that share a step's work
        self.flops = StepFlops(self.policy.model_cfg, len(devices), device_peak_flops(
            devices[0].device_kind, cfg.precision.param_dtype, cfg.logging.peak_tflops))
        p = self.policy
        self.engine = backends.make_generator(cfg, p.graphdef, p.state, pad_id=self.pad_id, run_dir=self.run_dir)
        self.phases.done("%s", generation_line(cfg))
        self.probe = probe_check(self.cfg.generation, self.policy.model_cfg.vocab_size, self.policy.sampling,
                                 self._probe_logprobs)
        self.eval_set = self._eval_set() if cfg.eval.enabled else None
        self.best = None  # {metric, value, step} of the best held-out evaluation so far (kept in checkpoints)
        self.kept = []  # checkpoint.keep_best's: the k best evaluated steps, best first (rl.evaluate.update_kept)
        self.resumed_row = None  # the resumed checkpoint's metrics row
        self.trained_under = trained_under(cfg)  # kept in every checkpoint: a resume compares itself with it
        self.changed_since_checkpoint = None
        self.skipped_updates = SkippedUpdates(cfg.optim.stop_after_skipped_steps, cfg.grpo.updates_per_step)
        self.short_steps = ShortSteps()  # dynamic sampling's steps that ran out of rounds
        # grpo.max_trajectory_age_steps 1: the next step's draw runs while a step trains (rl.ahead)
        self.ahead = AheadDraw() if cfg.grpo.max_trajectory_age_steps else None
        # in a multi-host job it runs on process 0 alone and is shared when taken (rl.shared_draw)
        self.shared_ahead = self.ahead is not None and jax.process_count() > 1
        # what process 0 alone writes (the metrics, rollout and config files): a failed write stops every process
        self.outputs = ProcessZeroWrites(jax.process_count(), self.run_dir)

    @property
    def state(self):
        return self.policy.state

    def _eval_set(self) -> held_out.EvalSet:
        es = held_out.build_eval_set(self.cfg, self.tokenizer, self.policy.sampling.stop_token_ids,
                                     self.loader.records)
        agree_in_job("its held-out prompts", lambda: {"eval_prompts": eval_facts(es)})
        shared = held_out.overlap(self.loader.records, es.records)
        if shared:  # a prompt file that is not held out (synthetic prompts exclude the training records)
            log.warning("%d of the %d evaluation prompts are also training prompts", shared, len(es.records))
        return es

    def _evaluate(self, step: int) -> dict:
        """The held-out metrics of the generator's current weights (rl.evaluate); updates the best value."""
        t0 = time.perf_counter()
        keep = self.cfg.logging.eval_rollouts
        metrics = held_out.evaluate(self.engine, self.eval_set, self.tokenizer, samples_of=keep)
        if keep:
            metrics, rows = metrics
            if jax.process_index() == 0:
                self.outputs.run(rollout_log.append, self.run_dir, [{"step": step, **r} for r in rows],
                                 rollout_log.EVAL_FILE)
        metrics["time/eval"] = time.perf_counter() - t0
        self.best = held_out.update_best(self.best, metrics, self.cfg.eval.best_metric, step)
        self.kept = held_out.update_kept(self.kept, metrics, self.cfg.eval.best_metric, step,
                                         self.cfg.checkpoint.keep_best)
        log.debug("step %d held out: %s", step, {k: v for k, v in metrics.items() if k.startswith("val/")})
        return metrics

    def _probe_logprobs(self, prompts, responses) -> np.ndarray:
        """The trainer's logprobs of the weight probes, under `rl.weight_sync.probe_sampling` (`untruncated_pass`)."""
        batch = backends.probe_batch(prompts, responses, self.width, self.pad_id)
        return np.asarray(self.untruncated_pass(self.state.params, self.state.rest, batch))[0]

    def step(self, step: int) -> dict:
        """One GRPO step, phase by phase (each timed under time/<phase>)."""
        cfg, gcfg, policy = self.cfg, self.cfg.grpo, self.policy
        t = {"start": time.perf_counter()}
        # rollout + rewards; with DAPO dynamic sampling as many rounds as it takes (rl.phases.draw)
        draw = functools.partial(phases.draw, self.engine, self.loader, self.tokenizer, cfg, policy.sampling)
        ahead = self.ahead
        if ahead is not None and ahead.pending:  # drawn while the previous step trained
            drawn, version, waited = (shared_draw.take_shared(ahead, self.engine, self.loader, self.tokenizer, cfg,
                                                              policy.sampling)
                                      if self.shared_ahead else ahead.take())
            t["generate"] = t["start"] + waited  # what the trainer waited for (of the draw's generation and scoring)
            blocked = waited
            # the draw made ahead: its generation and its scoring, off the trainer's path (an audit: its scoring
            # showed nowhere, time/reward then holding only the advantages and the batch)
            ahead_metrics = {"rollout/age_steps": step - version, "time/generate_ahead": drawn.generate_s,
                             "time/reward_ahead": drawn.draw_s - drawn.generate_s}
        else:
            drawn = draw(step)
            blocked = time.perf_counter() - t["start"]  # the whole draw, its scoring included
            t["generate"] = t["start"] + drawn.generate_s  # the scoring of every round counts as time/reward
            ahead_metrics = {"rollout/age_steps": 0} if ahead is not None else {}
        done = step + 1
        if ahead is not None and draws_ahead(done, cfg.run.total_steps, cfg.checkpoint.every_steps,
                                             self._evaluates_after(done)):
            # the generator holds the weights this step trains from (version `step`)
            next_draw = (shared_draw.ahead_draw(self.engine, self.loader, self.tokenizer, cfg, policy.sampling, done)
                         if self.shared_ahead else functools.partial(draw, done))
            ahead.launch(next_draw, self.loader.state_dict(), version=step)
        samples, reward, failures = drawn.samples, drawn.reward, drawn.failures
        self.short_steps.after(done, drawn.metrics, gcfg.prompts_per_step)
        adv = phases.advantages(reward, samples.rollout.truncated, gcfg)
        if rollout_log.due(done, cfg.logging.rollouts_every) and jax.process_index() == 0:
            self.outputs.run(rollout_log.append, self.run_dir, rollout_log.rollout_rows(
                samples, reward, adv, self.tokenizer, done, gcfg.group_size, cfg.logging.rollouts_groups, drawn.parts))
        rows = len(samples.completions)
        num_micro = rows // (gcfg.micro_batch_size * cfg.mesh.data * cfg.mesh.expert)
        micro = phases.train_batch(samples, adv, width=self.width, pad_id=self.pad_id, num_micro=num_micro,
                                   updates=gcfg.updates_per_step, by_length=bool(gcfg.micro_batch_widths))
        t["reward"] = time.perf_counter()

        micro = phases.logprobs(self.logprobs, policy.state, micro,
                                self.reference.for_pass() if self.reference is not None else None,
                                old=gcfg.old_logprobs == "pass", ref_pass=self.untruncated_pass)
        micro, route_metrics = phases.route_metrics(micro, replay=gcfg.routing_replay == "rollout",
                                                    indexer_replay=gcfg.indexer_replay == "rollout",
                                                    in_update=gcfg.old_logprobs == "update")
        if self.recall is not None and step % cfg.logging.indexer_recall_every == 0:  # steps 1, 1 + N, ... as logged
            t0 = time.perf_counter()
            route_metrics.update(phases.indexer_recall(self.recall, policy.state, micro))
            route_metrics["time/indexer_recall"] = time.perf_counter() - t0  # inside time/logprobs
        if self.moe_counts is not None and step % cfg.logging.moe_drops_every == 0:
            t0 = time.perf_counter()
            replay = gcfg.routing_replay == "rollout"
            route_metrics.update(phases.moe_drops(self.moe_counts, policy.state, micro, replay))
            route_metrics["time/moe_drops"] = time.perf_counter() - t0  # inside time/logprobs
        t["logprobs"] = time.perf_counter()

        lr = applied_learning_rate(cfg, policy.state)  # the schedule's, which waits out skipped updates
        policy.state, stats = phases.update(self.train_step, policy.state, micro, gcfg.updates_per_step)
        self.skipped_updates.after(done, stats.skipped, stats.loss, stats.grad_norm, stats.empty)
        reset = self._reset_reference(done)
        t["train"] = time.perf_counter()

        if ahead is not None:  # the engine keeps the old weights until the draw in flight is done
            # the trainer blocked on drawing: this step's draw (taken, or its own), then the next one's settle
            ahead_metrics["time/wait_rollout"] = blocked + ahead.settle()
        transfer = sync_weights(self.engine, policy.state, step + 1, self.probe)
        elapsed = time.perf_counter() - t["start"]
        timing = {p: t[p] - t[q] for p, q in (("generate", "start"), ("reward", "generate"),
                                              ("logprobs", "reward"), ("train", "logprobs"))}
        metrics = phases.step_metrics(samples, reward, failures, adv, micro, stats,
                                      lr, timing, elapsed)
        metrics.update(transfer)
        metrics.update(phases.width_metrics(micro, gcfg.micro_batch_widths))
        metrics.update(self.flops.metrics(micro["attention_mask"], timing, route_metrics,
                                          passes=int("logp_old" in micro) + int("logp_ref" in micro)))
        metrics.update(drawn.metrics)
        metrics.update(route_metrics)
        metrics.update(ahead_metrics)
        metrics.update(reset)
        metrics["time/step"] = elapsed
        return metrics

    def _reset_reference(self, done: int) -> dict:
        """ProRL's reset after the update of step `done` when it is due: the KL reference becomes the policy
        (and Adam restarts, `grpo.reference_reset_optimizer`); the metric `reference/age_steps` (0 on a reset)."""
        every = self.cfg.grpo.reference_reset_every_steps
        if not every or self.reference is None:
            return {}
        if done % every == 0:
            state = self.policy.state
            self.reference.reset(state.params, mix=self.cfg.grpo.reference_reset_mix)
            self.reference_step = done
            if self.cfg.grpo.reference_reset_optimizer:
                opt = state.opt_state._replace(inner=restart_adam(state.opt_state.inner))
                self.policy.state = state._replace(opt_state=opt)
        return {"reference/age_steps": float(done - self.reference_step)}

    # -------------------------------------------------------------------------------------- loop
    def _evaluates_after(self, done: int) -> bool:
        return self.eval_set is not None and held_out.due(done, self.cfg.run.total_steps, self.cfg.eval.every_steps)

    def _meta(self, step: int) -> dict:
        # with a draw in flight (a save the schedule did not foresee), the position before it: those
        # prompts are drawn again after a resume (rl.ahead)
        data = self.ahead.loader_state if self.ahead is not None and self.ahead.pending else self.loader.state_dict()
        return {"step": step, "data": data, "seed": self.cfg.run.seed, "weight_version": step, "best": self.best,
                "kept_best": self.kept, "reference_step": self.reference_step,
                "skipped_in_a_row": self.skipped_updates.in_a_row, **self.trained_under}

    def resume(self) -> int:
        got, self._restored = self._restored or restore_naming_changes(
            lambda: self.checkpointer.restore_latest(self.state), self.checkpointer, self.trained_under), None
        if got is None:
            if self.checkpointer.steps():  # each was named unreadable in a warning
                raise self.checkpointer.none_reads()
            if backends.engines_start_empty(self.cfg):  # engines of a random model began with vLLM's dummy weights
                self.phases.restart()
                self.phases.done("%s", first_push_line(sync_weights(self.engine, self.state, 0, self.probe)))
            return 0
        state, meta = got
        self.resumed_row = meta.get("metrics_row")
        # first: a checkpoint trained as another model, or whose data position this run's prompts cannot continue,
        # changes nothing
        self.changed_since_checkpoint = check_config(
            meta, self.trained_under, f"checkpoint step {meta['step']} in {self.checkpointer.directory}")
        try:
            self.loader.load_state_dict(meta["data"])
        except ValueError as e:
            # which prompts a file keeps also follows the prompt width and the rendering (data.overlong_prompts
            # drop): name what changed since the checkpoint, where it records that
            decide = ("data.", "generation.max_prompt_tokens", "model.path", "grpo.prompts_per_step")
            changed = [k for k, _, _ in self.changed_since_checkpoint or () if k.startswith(decide)]
            raise CheckpointMismatch(
                f"checkpoint step {meta['step']} in {self.checkpointer.directory} cannot continue this run's prompts "
                f"({e}): resume with the data it was saved with (data.*, generation.max_prompt_tokens and the "
                "tokenizer where data.overlong_prompts drops prompts, and grpo.prompts_per_step for a synthetic "
                "task, which sizes its prompt set), or start over in a new run.out_dir"
                + (f"; changed since the checkpoint: {', '.join(changed)}" if changed else "")) from None
        self.policy.state = self.policy.place(state)
        self.best = meta.get("best")
        self.kept = held_out.ranked(meta.get("kept_best") or [], self.cfg.eval.best_metric,  # as this run ranks them
                                    self.cfg.checkpoint.keep_best)
        self.checkpointer.keep_best_steps(e["step"] for e in self.kept)  # checkpoint.keep_best
        # a reset's reference (not the starting weights) was saved with the state; a run resumed without a KL drops it
        self.reference_step = int(meta.get("reference_step", 0)) if self.reference is not None else 0
        if self.reference_step:
            self.reference.reset(self.checkpointer.restore_reference(int(meta["step"]), self.state.params))
        # a run diverging when it stopped goes on counting its skipped steps toward optim.stop_after_skipped_steps
        self.skipped_updates.in_a_row = int(meta.get("skipped_in_a_row", 0))
        # checked on the probe sequences as every other push is: a resume's went unchecked, and a bad one trained a
        # step on its rollouts before the next push's check stopped the run (a helper's soak of the vLLM pool)
        pushed = sync_weights(self.engine, self.state, meta["weight_version"], self.probe)
        if pushed:  # {} where the engine shares the trainer's arrays (the JAX engine)
            log.info("%s", first_push_line(pushed, "the restored weights", meta["weight_version"]))
        log.info("resumed from step %d in %s", meta["step"], self.checkpointer.directory)
        return int(meta["step"])

    def save(self, step: int, row: dict | None = None) -> None:
        """row: the step's metrics so far, kept with the checkpoint (a resume writes it if metrics.jsonl lacks it)."""
        reference = self.reference.held if self.reference_step else None
        meta = self._meta(step)
        self.checkpointer.keep_best_steps(e["step"] for e in self.kept)  # checkpoint.keep_best
        if row is not None:
            meta["metrics_row"] = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) or
                                   hasattr(v, "item")}
        self.checkpointer.save(step, self.state, meta, reference=reference)

    def export(self, path: str | None = None) -> str:
        return self.policy.export(path or os.path.join(self.run_dir, "export"))

    def run(self) -> dict:
        cfg = self.cfg
        start_wall = time.time()
        self.start_watchdog.arm("the resume (the checkpoint's state placed, the generator given its weights)")
        try:
            first = self.resume()
        finally:
            self.start_watchdog.close()
        self.resumed_from = first  # at or past run.total_steps: nothing left to train
        self.last_step, self.stopped_by = first, None  # stopped_by: a signal's name or run.max_wall_minutes
        if jax.process_index() == 0:
            removed = self.outputs.run(rollout_log.drop_rows_past, self.run_dir, first if first > 0 else -1)
            if removed:
                log.info("removed the lines past step %d, which this run writes again: %s", first,
                         ", ".join(f"{n} from {name}" for name, n in removed.items()))
            recorded = self.outputs.run(record_config, self.run_dir, cfg)
            changed = changes_warning(first, self.changed_since_checkpoint, recorded) if recorded is not None else None
            if changed:
                log.warning("%s", changed)
        deadline = cfg.checkpoint.deadline_seconds(datetime.datetime.now())
        logger = self.outputs.run(
            RunLogger, self.run_dir, tensorboard=cfg.logging.tensorboard, progress_bar=cfg.logging.progress_bar,
            total_steps=cfg.run.total_steps, first_step=first, resumed_row=self.resumed_row,
            open_wandb=functools.partial(open_wandb_run, self.run_dir, cfg) if cfg.logging.wandb_project else None,
        ) or NO_OUTPUTS  # process 0 could not open them: the first step's agreement stops every process
        watchdog = HangWatchdog(cfg.run.hang_timeout_minutes, resume_hint=self._resume_hint())
        # The signals stay caught until the run has ended: a SIGTERM (or SLURM's SIGUSR1) during the last save's wait
        # ended the process with the save in flight, its step lost. One received after the last step stops the run
        # once the save is done; the export is then left to the rerun, which resumes at the last step and exports.
        signals = StopSignals().__enter__()
        try:
            try:
                last = self._train(first, logger, watchdog, signals, start_wall, deadline)
            finally:
                # the last save's wait (a stuck filesystem, a host that never joins orbax's barrier) and the engines'
                # shutdown can hang too
                watchdog.arm("the end of the run (its last save, the generator's shutdown)")
                try:
                    if self.ahead is not None:
                        self.ahead.close()  # before the generator shuts down: a draw in flight uses it
                    self.checkpointer.wait(quiet=True)  # a failed save is raised below, or the error raised stands
                    logger.close()
                    self.engine.shutdown()
                finally:
                    watchdog.close()
            self.checkpointer.check_saves()
            if not self.stopped_by and signals.agree(False, False, jax.process_count()).stop:  # every process alike
                self.stopped_by = signals.name or "a stop on another process"
            elif cfg.checkpoint.export_hf_at_end and self.last_step == cfg.run.total_steps:
                self.export()
            if cfg.logging.plot:
                draw_curves(self.run_dir)
            self.checkpointer.close()
        finally:
            signals.__exit__()
        return last

    def _train(self, first: int, logger, watchdog: HangWatchdog, signals: StopSignals, start_wall: float,
               deadline: float | None) -> dict:
        """The steps from `first` on (and the initial evaluation), each saved and logged; the last step's metrics.
        Stops early, saved, on a signal or the wall limit (`stopped_by`); `deadline`: checkpoint.must_save_by's
        seconds from `start_wall`."""
        cfg = self.cfg
        last = {}
        saved_for_deadline = False
        if self.eval_set is not None and cfg.eval.at_start and first == 0:
            watchdog.arm("the held-out evaluation of the initial policy")
            self.phases.restart()
            row = self._evaluate(0)
            self.outputs.run(logger.log, 0, row, advance=False)  # the initial policy: a row of its own
            self.phases.done("held-out evaluation of the initial policy: pass@1 %.3f over %d prompts x %d samples",
                             row["val/pass@1"], len(self.eval_set.records), cfg.eval.samples_per_prompt)
        for step in range(first, cfg.run.total_steps):
            watchdog.arm(f"step {step + 1}")
            self.checkpointer.check_saves()  # a background save that failed stops the run at the next step
            t0 = time.perf_counter()
            last = self.step(step)
            done = step + 1
            if self._evaluates_after(done):
                last.update(self._evaluate(done))  # before the save: the checkpoint knows the best value
            t1 = time.perf_counter()
            every = cfg.checkpoint.every_steps  # 0: only at the end (and at must_save_by)
            kept = any(e["step"] == done for e in self.kept)  # entered checkpoint.keep_best's k best
            due = bool((every and done % every == 0) or done == cfg.run.total_steps or kept)
            at_deadline = deadline is not None and not saved_for_deadline and time.time() - start_wall >= deadline
            wall = cfg.run.max_wall_minutes
            out_of_time = bool(wall) and time.time() - start_wall > 60 * wall
            # a signal or the wall limit stops the run after this step, saved once (a second save of the step
            # raised, and the run ended as if its save had failed)
            stop, save, failed, signalled = signals.agree(out_of_time, due or at_deadline, jax.process_count(),
                                                          self.outputs.failed)
            self.outputs.stop_if(failed, done)  # a write of process 0's outputs failed: all stop here
            saved_for_deadline |= at_deadline or (save and not due)  # another process's deadline counts
            if save:
                self.save(done, row=last)
            if stop:
                self.stopped_by = signals.name or ("a stop on another process" if signalled else
                                                   "run.max_wall_minutes")  # on this process's clock or another's
            last["time/checkpoint"] = time.perf_counter() - t1
            last["time/other"] = (time.perf_counter() - t0) - sum(
                last.get(f"time/{p}", 0.0)
                for p in ("generate", "reward", "logprobs", "train", "weight_transfer", "eval"))
            self.outputs.run(logger.log, done, last)
            self.last_step = done
            if self.stopped_by:
                break
        self.outputs.settle(self.last_step)  # the last row's write
        return last
