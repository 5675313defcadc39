"""One GRPO run: rollout -> reward -> advantages -> logprobs -> update -> weight sync -> checkpoint.

The trainer is the only place that knows the order of the phases; each phase is a call into a module
with plain arrays in between (architecture.md). Everything random in a step derives from
(run.seed, step), and the data position is checkpointed, so a resumed run repeats exactly what an
uninterrupted one would have done.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import m3jax
from rl import checkpoint as ckpt_lib
from rl.config import RunConfig
from rl.data import PromptLoader, load_prompts, render_prompt
from rl.generation import backends
from rl.generation.backends import sampling_of
from rl.generation.base import token_logprobs
from rl.logprobs import make_logprob_pass
from rl.grpo import advantages as adv_lib
from rl.grpo.batch import build_train_batch, split_micro
from rl.grpo.loss import generation_mismatch_metrics, grpo_loss, normalizer
from rl.observe import RunLogger, plot_run
from rl.rewards.registry import score_batch
from rl.tasks import make_task
from sharding import optim_step
from sharding.mesh import build_mesh
from sharding.layout import Layout
from sharding.train_step import init_state, make_train_step, state_shardings

log = logging.getLogger(__name__)


def learning_rate(cfg: RunConfig):
    o = cfg.optim
    if o.schedule == "constant":
        after = optax.constant_schedule(o.lr)
    else:
        decay = max(cfg.run.total_steps - o.warmup_steps, 1)
        after = (optax.linear_schedule(o.lr, 0.0, decay) if o.schedule == "linear"
                 else optax.cosine_decay_schedule(o.lr, decay))
    if not o.warmup_steps:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, o.lr, o.warmup_steps), after], [o.warmup_steps])


class GRPOTrainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run_dir = cfg.run.out_dir
        os.makedirs(self.run_dir, exist_ok=True)
        g = cfg.generation
        self.width = g.max_prompt_tokens + g.max_new_tokens
        self.loss_cfg = cfg.grpo.loss_config(g.max_new_tokens)
        self._build_data()
        self._build_model()
        self.checkpointer = ckpt_lib.Checkpointer(os.path.join(self.run_dir, "checkpoints"),
                                                  keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)

    # ------------------------------------------------------------------------------------- setup
    def _build_data(self) -> None:
        d = self.cfg.data
        if d.kind == "synthetic":
            task = make_task(d.task, num_digits=d.num_digits, seed=d.shuffle_seed)
            self.tokenizer = task.tokenizer
            records = task.dataset(max(4096, self.cfg.grpo.prompts_per_step * 64))
        else:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
            records = load_prompts(d.path, format=d.format, prompt_key=d.prompt_key, answer_key=d.answer_key,
                                   layout=d.layout)
        self.loader = PromptLoader(records, self.cfg.grpo.prompts_per_step, seed=d.shuffle_seed)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def _build_model(self) -> None:
        cfg = self.cfg
        dtype = jnp.dtype(cfg.precision.param_dtype)
        m = cfg.mesh
        # The run's layout (mesh + rules, experts on mesh.expert_axes) travels with the model.
        self.layout = Layout() if m.num_devices == 1 else build_mesh(m.to_mesh_config(), cfg.model.m3_config(),
                                                                     seq_len=self.width - 1)
        self.mesh = self.layout.mesh
        if cfg.model.path:
            model = m3jax.from_pretrained(cfg.model.path, dtype=dtype, mesh=self.layout, **cfg.model.model_options())
        else:
            model = m3jax.M3ForCausalLM(cfg.model.m3_config(), dtype=dtype, rngs=nnx.Rngs(cfg.model.init_seed),
                                        layout=self.layout, **cfg.model.model_options())
        self.model_cfg = model.cfg
        self.sampling = sampling_of(cfg, model.cfg.eos_token_id)
        o = cfg.optim
        self.optimizer = optim_step.adamw(learning_rate(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                                         weight_decay=o.weight_decay, clip_norm=o.clip_norm,
                                         moment_dtype=jnp.dtype(cfg.precision.moment_dtype),
                                         master=cfg.precision.master)
        self.graphdef, self.state = init_state(model, self.optimizer)
        self.shardings = None
        if self.mesh is not None:
            self.shardings = state_shardings(self.layout, self.state)
            self.state = jax.device_put(self.state, self.shardings)
        self.ref_params = (jax.tree.map(jnp.copy, self.state.params) if self.loss_cfg.kl != "none" else None)
        sp, loss_cfg = self.sampling, self.loss_cfg

        def loss_fn(model, mb):
            logits = model(mb["input_ids"], attention_mask=mb["attention_mask"])
            logp = token_logprobs(logits, mb["targets"], sp.temperature, sp.top_p, sp.top_k)
            return grpo_loss(logp, mb["logp_old"], mb["logp_gen"], mb["advantages"], mb["loss_mask"], loss_cfg,
                             mb.get("logp_ref"))

        self.train_step = make_train_step(
            self.graphdef, self.optimizer, loss_fn, mesh=self.layout, shardings=self.shardings,
            normalizer=lambda b: normalizer(b["loss_mask"].reshape(-1, b["loss_mask"].shape[-1]), loss_cfg))
        self.logprobs = make_logprob_pass(self.graphdef, self.sampling, self.layout)
        self.engine = backends.make_generator(cfg, self.graphdef, self.state, pad_id=self.pad_id, run_dir=self.run_dir)
        g = cfg.generation
        self.probes = None
        if g.backend != "jax" and g.verify_probes:
            half = max(g.max_seq_len // 2, 1)
            self.probes = backends.probe_sequences(g.verify_probes, self.model_cfg.vocab_size, half,
                                                   g.max_seq_len - half)

    # ------------------------------------------------------------------------------------ phases
    def _rewards(self, completions, answers, truncated) -> tuple[np.ndarray, int]:
        total, failures = np.zeros(len(completions), np.float32), 0
        extra = [{"truncated": bool(x)} for x in truncated]
        for spec in self.cfg.reward:  # one call per reward: each has its own time limit
            r, f = score_batch([(spec.name, spec.weight)], completions, answers, timeout_s=spec.timeout_s,
                               sample_kwargs=extra)
            total += r
            failures += f
        return total, failures

    def step(self, step: int) -> dict:
        cfg, gcfg = self.cfg, self.cfg.grpo
        t = {"start": time.perf_counter()}
        records = self.loader.next_batch()
        prompts = [render_prompt(r, self.tokenizer, chat_template=cfg.data.chat_template) for r in records]
        group = gcfg.group_size
        rows = [p for p in prompts for _ in range(group)]
        answers = [r.answer for r in records for _ in range(group)]
        key = jax.random.fold_in(jax.random.key(cfg.run.seed), step)
        rollout = self.engine.generate(rows, self.sampling, key, prompt_width=cfg.generation.max_prompt_tokens)
        t["generate"] = time.perf_counter()

        stops = set(self.sampling.stop_token_ids)
        # Special tokens stay in the text: dropping a sampled <sep> would shift the digits after it.
        completions = [self.tokenizer.decode([int(x) for x in rollout.tokens[i, :rollout.lengths[i]]
                                              if int(x) not in stops], skip_special_tokens=False)
                       for i in range(len(rows))]
        rewards, failures = self._rewards(completions, answers, rollout.truncated)
        estimator = adv_lib.get_advantage_estimator(gcfg.advantage)
        advantages = np.asarray(estimator(jnp.asarray(rewards), group))
        weight = np.ones(len(rows), np.float32)
        dropped = np.asarray(adv_lib.zero_variance_groups(jnp.asarray(rewards), group))
        if gcfg.dynamic_sampling:
            weight *= np.repeat(~dropped, group)
        if gcfg.overlong_filter:
            weight *= np.asarray(adv_lib.overlong_mask(jnp.asarray(rollout.truncated)))
        batch = build_train_batch(rollout, advantages, weight, width=self.width, pad_id=self.pad_id)
        t["reward"] = time.perf_counter()

        per_rank = gcfg.micro_batch_size * cfg.mesh.data * cfg.mesh.expert
        num_micro = len(rows) // per_rank
        micro = split_micro(batch, num_micro)
        micro["logp_old"] = self.logprobs(self.state.params, self.state.rest, micro)
        if self.ref_params is not None:
            micro["logp_ref"] = self.logprobs(self.ref_params, self.state.rest, micro)
        jax.block_until_ready(micro["logp_old"])
        t["logprobs"] = time.perf_counter()

        updates = gcfg.updates_per_step
        stats_total, losses, norms, skipped = {}, [], [], 0
        for u in range(updates):
            part = jax.tree.map(lambda x: x[u * num_micro // updates:(u + 1) * num_micro // updates], micro)
            self.state, m = self.train_step(self.state, part)
            losses.append(float(m["loss"]))
            norms.append(float(m["grad_norm"]))
            skipped += int(m["skipped"])
            stats_total = {k: stats_total.get(k, 0.0) + float(v) for k, v in m["sums"].items()}
        t["train"] = time.perf_counter()
        transfer = self._sync_weights(step + 1)

        mism = generation_mismatch_metrics(micro["logp_gen"].reshape(len(rows), -1),
                                           micro["logp_old"].reshape(len(rows), -1),
                                           micro["loss_mask"].reshape(len(rows), -1) > 0)
        tokens = max(stats_total.get("tokens", 0.0), 1.0)
        gen_tokens = int(rollout.lengths.sum())
        elapsed = time.perf_counter() - t["start"]
        phases = {p: t[p] - t[q] for p, q in (("generate", "start"), ("reward", "generate"),
                                              ("logprobs", "reward"), ("train", "logprobs"))}
        metrics = {
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "reward/failures": failures, "groups/zero_variance_frac": float(dropped.mean()),
            "response/length_mean": float(rollout.lengths.mean()),
            "response/truncated_frac": float(rollout.truncated.mean()),
            "loss": float(np.mean(losses)), "grad_norm": float(np.mean(norms)), "skipped_updates": skipped,
            "clip_frac": stats_total.get("clipped_tokens", 0.0) / tokens,
            "dual_clip_frac": stats_total.get("dual_clipped_tokens", 0.0) / tokens,
            "is_out_of_band_frac": stats_total.get("is_out_of_band_tokens", 0.0) / tokens,
            "kl": stats_total.get("kl_sum", 0.0) / tokens, "entropy_approx": stats_total.get("neg_logp_sum", 0.0) / tokens,
            "gen_kl_error": float(mism["gen_kl_error"]), "token_mult_prob_error": float(mism["token_mult_prob_error"]),
            "lr": float(learning_rate(cfg)(step)),
            "throughput/tokens_per_s": gen_tokens / max(elapsed, 1e-9),
            **transfer,
            **{f"time/{p}": v for p, v in phases.items()},
        }
        metrics["time/step"] = elapsed
        return metrics

    def _sync_weights(self, version: int) -> dict:
        """Hand the new weights to the generator; for a vLLM pool, report the transfer and (when
        configured) check on fixed probe sequences that every engine now computes what the trainer does."""
        t0 = time.perf_counter()
        stats = self.engine.set_weights(self.state.params, version, self.state.rest)
        if stats is None:  # the JAX engine shares the parameters: nothing moved
            return {}
        out = {"time/weight_transfer": time.perf_counter() - t0, "transfer/gb_per_s": stats.gb_per_s,
               "transfer/convert_s": stats.convert_s, "transfer/send_s": stats.send_s,
               "transfer/apply_s": stats.apply_s, "pool/resent_rows": self.engine.resent_rows,
               "pool/restarts": self.engine.restarts}
        if self.probes is not None:
            prompts, responses = self.probes
            engine_lp = self.engine.score(prompts, responses, self.sampling)
            batch = backends.probe_batch(prompts, responses, self.width, self.pad_id)
            trainer_lp = np.asarray(self.logprobs(self.state.params, self.state.rest, batch))[0]
            diff = backends.probe_max_abs_diff(engine_lp, trainer_lp, prompts)
            out["transfer/probe_max_abs_logprob_diff"] = diff
            out["transfer/probe_engines"] = len(engine_lp)
            limit = self.cfg.generation.verify_max_abs_diff
            if limit is not None and (diff > limit or len(engine_lp) == 0):
                raise RuntimeError(f"after the transfer of weight version {version}, the vLLM engines' logprobs on "
                                   f"the probe sequences differ from the trainer's by {diff:.3g} > "
                                   f"generation.verify_max_abs_diff={limit} ({len(engine_lp)} engines answered)")
        return out

    # -------------------------------------------------------------------------------------- loop
    def _meta(self, step: int) -> dict:
        return {"step": step, "data": self.loader.state_dict(), "seed": self.cfg.run.seed,
                "weight_version": step}

    def resume(self) -> int:
        got = self.checkpointer.restore_latest(self.state)
        if got is None:
            return 0
        state, meta = got
        if self.shardings is not None:
            state = jax.device_put(state, self.shardings)
        self.state = state
        self.loader.load_state_dict(meta["data"])
        self.engine.set_weights(self.state.params, meta["weight_version"], self.state.rest)
        log.info("resumed from step %d in %s", meta["step"], self.checkpointer.directory)
        return int(meta["step"])

    def save(self, step: int) -> None:
        self.checkpointer.save(step, self.state, self._meta(step))

    def export(self, path: str | None = None) -> str:
        model = nnx.merge(self.graphdef, self.state.params, self.state.rest)
        path = path or os.path.join(self.run_dir, "export")
        return m3jax.save_pretrained(model, path, layout=self.cfg.checkpoint.export_layout)

    def run(self) -> dict:
        cfg = self.cfg
        start_wall = time.time()
        first = self.resume()
        deadline = cfg.checkpoint.deadline_seconds(datetime.datetime.now())
        logger = RunLogger(self.run_dir, tensorboard=cfg.logging.tensorboard, progress_bar=cfg.logging.progress_bar,
                           total_steps=cfg.run.total_steps, first_step=first)
        last = {}
        saved_for_deadline = False
        try:
            for step in range(first, cfg.run.total_steps):
                t0 = time.perf_counter()
                last = self.step(step)
                done = step + 1
                t1 = time.perf_counter()
                if done % cfg.checkpoint.every_steps == 0 or done == cfg.run.total_steps:
                    self.save(done)
                elif deadline is not None and not saved_for_deadline and time.time() - start_wall >= deadline:
                    self.save(done)
                    saved_for_deadline = True
                last["time/checkpoint"] = time.perf_counter() - t1
                last["time/other"] = (time.perf_counter() - t0) - sum(
                    last.get(f"time/{p}", 0.0) for p in ("generate", "reward", "logprobs", "train", "weight_transfer"))
                logger.log(done, last)
                if cfg.run.max_wall_minutes and time.time() - start_wall > 60 * cfg.run.max_wall_minutes:
                    self.save(done)
                    break
        finally:
            self.checkpointer.wait()
            logger.close()
            if hasattr(self.engine, "shutdown"):
                self.engine.shutdown()
        if cfg.checkpoint.export_hf_at_end:
            self.export()
        if cfg.logging.plot:
            plot_run(self.run_dir)
        self.checkpointer.close()
        return last
