"""Settings changed from their defaults that another setting makes inert: each objective's own clip or temperature
under another objective, the overlong penalty with its buffer off, an importance-weight cap with no correction, the
KL's clamps without a KL, and the like. Said as the run starts (`rl.start_warnings`), not refused: a recipe keeps
its values when one option is switched for a comparison (grpo.loss=gspo on a ppo_clip recipe), but whoever sets
grpo.eps_high=0.9 with loss gspo believes a clip is in force that the loss never reads.

What can never be meant is refused at load instead (`rl.config.validate`: dual_clip, cispo_eps_low, is_floor, ...).
Settings that are inert by design are left out: a recipe's `grpo.reference_memory` prepared for a KL switched on
later, the eval section with evaluation off (`python -m m3jax.eval` reads it).
"""

from __future__ import annotations

from typing import Callable, NamedTuple


class Rule(NamedTuple):
    section: str
    fields: tuple[str, ...]
    # the reason the fields have no effect under this config, or None where they act
    inert_because: Callable[[object], str | None]


def _shipped(loss: str) -> bool:
    """Whether `loss` is one of m3jax's objectives: a registered one (rl.grpo.registry) receives every grpo key and
    reads what it will (docs/extending.md), so none of them is inert under it."""
    from rl.grpo.objectives import POLICY_LOSSES, SHIPPED_POLICY_LOSSES
    return SHIPPED_POLICY_LOSSES.get(loss, False) is POLICY_LOSSES.get(loss)


def _loss_reads(losses: tuple[str, ...], who: str) -> Callable[[object], str | None]:
    return lambda cfg: None if cfg.grpo.loss in losses or not _shipped(cfg.grpo.loss) else (
        f"grpo.loss = {cfg.grpo.loss} (only {who})")


RULES: tuple[Rule, ...] = (
    Rule("grpo", ("overlong_penalty",), lambda cfg: None if cfg.grpo.overlong_buffer else
         "grpo.overlong_buffer = 0 turns the soft overlong punishment off"),
    Rule("grpo", ("eps_low", "eps_high"), _loss_reads(("ppo_clip", "clip_cov"),
                                                     "ppo_clip and clip_cov clip the ratio by eps_low / eps_high")),
    Rule("grpo", ("gspo_eps_low", "gspo_eps_high"), _loss_reads(("gspo",), "gspo reads them")),
    Rule("grpo", ("gmpo_eps_low", "gmpo_eps_high"), _loss_reads(("gmpo",), "gmpo reads them")),
    Rule("grpo", ("sapo_tau_pos", "sapo_tau_neg"), _loss_reads(("sapo",), "sapo reads them")),
    Rule("grpo", ("cispo_eps_high",), _loss_reads(("cispo",), "cispo reads them")),
    Rule("grpo", ("kl_cov_ratio", "kl_cov_coef"), _loss_reads(("kl_cov",), "kl_cov reads them")),
    Rule("grpo", ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"), _loss_reads(("clip_cov",), "clip_cov reads them")),
    # (is_level still shapes the logged is_out_of_band_frac under none: not named)
    Rule("grpo", ("is_cap",), lambda cfg: None if cfg.grpo.is_correction != "none" else
         "grpo.is_correction = none weighs every token 1"),
    Rule("grpo", ("is_cap",), lambda cfg: None if cfg.grpo.is_correction != "mask" else
         "grpo.is_correction = mask keeps the weights inside [is_mask_low, is_mask_high] and caps none"),
    Rule("grpo", ("kl_clamp", "kl_log_ratio_clamp"), lambda cfg: None if cfg.grpo.kl != "none" else
         "there is no KL term (grpo.kl = none)"),
    Rule("grpo", ("dynamic_sampling_max_rounds",), lambda cfg: None if cfg.grpo.dynamic_sampling else
         "grpo.dynamic_sampling = false draws one batch a step"),
    Rule("data", ("task", "num_digits"), lambda cfg: None if cfg.data.kind == "synthetic" else
         "data.kind = file reads its prompts from data.path"),
    # data.num_digits also sizes a held-out task of its own (eval.task) where eval.num_digits is null
    Rule("data", ("num_digits",), lambda cfg: None if cfg.data.kind != "synthetic" or cfg.data.task != "addmod" or (
        cfg.eval.enabled and cfg.eval.num_digits is None and (cfg.eval.task or "addmod") != "addmod") else
        "the addmod task's prompts always have two digits"),
    Rule("model", ("init_seed",), lambda cfg: None if not cfg.model.path else
         "model.path's weights are loaded, not drawn"),
    Rule("logging", ("rollouts_groups",), lambda cfg: None if cfg.logging.rollouts_every else
         "logging.rollouts_every = 0 writes no rollouts"),
    Rule("logging", ("wandb_entity", "wandb_mode"), lambda cfg: None if cfg.logging.wandb_project else
         "logging.wandb_project = null opens no W&B run"),
    # under generation.backend: jax every vLLM setting is named by rl.start_warnings.vllm_settings_on_the_jax_engine
    Rule("generation", ("weight_group_device",), lambda cfg: None if cfg.generation.backend != "vllm"
         or cfg.generation.weight_transport == "collective" else
         f"generation.weight_transport = {cfg.generation.weight_transport} opens no collective group"),
    Rule("generation", ("vllm_object_store_warmup",), lambda cfg: None if cfg.generation.backend != "vllm"
         or cfg.generation.weight_transport == "shm" or (cfg.generation.weight_transport == "ray"
                                                         and not cfg.generation.vllm_ray_address) else
         "generation.weight_transport = collective puts no weights through Ray's object store"
         if cfg.generation.weight_transport == "collective" else
         "the pool joins the Ray cluster at generation.vllm_ray_address, whose object store it did not size"),
    Rule("mesh", ("context_balance",), lambda cfg: None if cfg.mesh.context > 1 else
         "mesh.context = 1 has no context shards to balance"),
)


def inert_settings(cfg, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """One line per rule whose fields, some changed from their defaults, have no effect under `cfg` (a
    rl.config.RunConfig): '<section>.<field> = <value>[, ...] has/have no effect: <why>'."""
    out = []
    for rule in rules:
        section = getattr(cfg, rule.section)
        default = type(section)()
        changed = [f for f in rule.fields if getattr(section, f) != getattr(default, f)]
        if not changed or (why := rule.inert_because(cfg)) is None:
            continue
        said = ", ".join(f"{rule.section}.{f} = {_show(getattr(section, f))}" for f in changed)
        out.append(f"{said} {'has' if len(changed) == 1 else 'have'} no effect: {why}")
    return out


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def fields_named(rules: tuple[Rule, ...] = RULES) -> set[str]:
    """Every 'section.field' a rule names (tests check each is a real setting)."""
    return {f"{r.section}.{f}" for r in rules for f in r.fields}
