"""What a run's config asks for that its length or its model makes moot: warned of as the run starts, not refused.

A short trial of a long recipe (run.total_steps=2) is meant to stop early, and a recipe's settings stay meaningful
when one of its options is switched off for a comparison (model.remat=false), so these are warnings; what can
never be meant is refused at load (rl.config).
"""

from __future__ import annotations

import dataclasses

from rl.ahead import draws_ahead
from rl.config import RunConfig
from rl.evaluate import due as evaluates_after
from rl.inert_settings import inert_settings
from rl.policy import learning_rate


def start_warnings(cfg: RunConfig, model_cfg) -> list[str]:
    """One line per setting that will not act as written; `model_cfg`: the run's M3Config."""
    out, total, o, m = [], cfg.run.total_steps, cfg.optim, cfg.model
    if o.warmup_steps >= total:
        last = float(learning_rate(cfg)(total - 1))
        out.append(f"optim.warmup_steps = {o.warmup_steps} is not below run.total_steps = {total}: the learning rate "
                   f"never reaches optim.lr = {o.lr:g} (its last step trains at {last:.3g})")
    every = cfg.grpo.reference_reset_every_steps
    reset_options = [f"grpo.reference_reset_mix = {cfg.grpo.reference_reset_mix:g}"] * (
        cfg.grpo.reference_reset_mix != 1.0) + ["grpo.reference_reset_optimizer = false"] * (
        not cfg.grpo.reference_reset_optimizer)
    if not every and reset_options:  # TRL's sync_ref_model row sets them together with the period
        out.append(f"{' and '.join(reset_options)} {'has' if len(reset_options) == 1 else 'have'} no effect: "
                   "grpo.reference_reset_every_steps = 0 never resets the KL reference")
    if every and cfg.grpo.kl != "none" and every >= total:
        out.append(f"grpo.reference_reset_every_steps = {every} is not below run.total_steps = {total}: the KL "
                   "reference is not reset while the run trains")
    if not m.remat and m.remat_policy != "full":
        out.append(f"model.remat_policy = {m.remat_policy} has no effect with model.remat = false (every activation "
                   "is kept for the backward)")
    if cfg.logging.indexer_recall_every and not model_cfg.has_sparse_attention:
        out.append(f"logging.indexer_recall_every = {cfg.logging.indexer_recall_every}: the model has no sparse "
                   "(indexer) layer, so no indexer/recall is logged")
    if cfg.logging.moe_drops_every and (m.moe_capacity_factor is None or not model_cfg.has_moe):
        out.append(f"logging.moe_drops_every = {cfg.logging.moe_drops_every}: "
                   + ("the model has no MoE layer, so no moe/dropped_frac is logged" if not model_cfg.has_moe else
                      "model.moe_capacity_factor is null (dropless), so moe/dropped_frac is always 0"))
    if m.moe_capacity_factor is not None and not model_cfg.has_moe:
        out.append(f"model.moe_capacity_factor = {m.moe_capacity_factor:g} has no effect: the model has no MoE layer")
    out += inert_settings(cfg)
    moot = vllm_settings_on_the_jax_engine(cfg.generation)
    if moot:
        out.append(f"{', '.join(moot)} {'has' if len(moot) == 1 else 'have'} no effect: generation.backend = jax "
                   "generates in this process with the trainer's parameters (no vLLM engine, no weight transfer)")
    g = cfg.grpo
    if g.loss == "kl_cov" and g.old_logprobs == "pass" and g.updates_per_step == 1:
        out.append("grpo.loss = kl_cov with grpo.old_logprobs = pass: logp_old comes from a forward of its own, so on "
                   "policy logp - logp_old is round-off (~1e-7), and the penalty's gradient kl_cov_coef * sign(logp - "
                   "logp_old) is +-kl_cov_coef on the penalised tokens by chance, where the method means 0 (the tiny "
                   "demo ended at reward 0.89, against 0.994 with update); grpo.old_logprobs = update makes it 0")
    if g.max_trajectory_age_steps:
        age = f"grpo.max_trajectory_age_steps = {g.max_trajectory_age_steps}"
        if total > 1 and not any(draws_ahead(d, total, cfg.checkpoint.every_steps,
                                             evaluates_after(d, total, cfg.eval.every_steps))
                                 for d in range(1, min(total, 10_000))):
            out.append(f"{age} has no effect: a checkpoint (checkpoint.every_steps = {cfg.checkpoint.every_steps}) or "
                       f"an evaluation (eval.every_steps = {cfg.eval.every_steps}) follows every step, and the "
                       "pipeline drains before each, so no step is drawn ahead (the run is on-policy)")
        if g.is_correction == "none":
            out.append(f"{age} with grpo.is_correction = none: the steps drawn ahead, by the weights before the last "
                       "update, are trained on as if the policy being trained had drawn them")
    return out


# The generation settings only a vLLM pool reads (rl.generation.backends.make_generator, rl.weight_sync.probe_check).
VLLM_ONLY = ("weight_transport", "weight_group_device", "weight_bucket_mb", "verify_probes")


def vllm_settings_on_the_jax_engine(generation) -> list[str]:
    """'generation.<name> = <value>' for each vLLM-only setting changed from its default while the backend is jax."""
    if generation.backend != "jax":
        return []
    default = type(generation)()
    return [f"generation.{f.name} = {getattr(generation, f.name)}" for f in dataclasses.fields(generation)
            if (f.name.startswith("vllm_") or f.name in VLLM_ONLY)
            and getattr(generation, f.name) != getattr(default, f.name)]
