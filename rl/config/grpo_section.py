"""The `grpo` section of a run config: the batch, the loss (objective, importance correction, KL, entropy) and the
DAPO / replay / off-policy options (`rl.grpo`, `rl.trainer`).

Declared like the sections of `rl.config.schema` (`_f`); its cross-field rules are in `rl.config.validate`.
"""

from __future__ import annotations

import dataclasses

from rl.config.schema import _f, _Section



class OpenChoices:
    """The allowed values of a field whose registry users extend: the built-in names, then those registered
    (`rl.grpo.register_advantage_estimator`, `register_policy_loss`) before the config is checked."""

    def __init__(self, builtin: tuple[str, ...], register_with: str):
        self.builtin, self.registered = tuple(builtin), []
        self.register_with = register_with  # named in the error: a launcher left out made it read as a typo

    def add(self, name: str) -> None:
        if name not in self:
            self.registered.append(name)

    def __iter__(self):
        return iter(self.builtin + tuple(self.registered))

    def __contains__(self, name) -> bool:
        return name in self.builtin or name in self.registered

    def __len__(self) -> int:
        return len(self.builtin) + len(self.registered)

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other)

    __hash__ = None


# The choices below mirror their originals (named beside each; tests/test_run_config.py checks them), so that
# loading a config imports no jax.
ADVANTAGES = OpenChoices(("grpo", "dr_grpo", "rloo", "grpo_loo", "reinforce_pp"),  # rl.grpo.advantages
                         "rl.grpo.register_advantage_estimator")
# rl.grpo.loss.LOSSES (rl.grpo.objectives)
LOSSES = OpenChoices(("ppo_clip", "gspo", "gmpo", "sapo", "cispo", "reinforce", "kl_cov", "clip_cov"),
                     "rl.grpo.register_policy_loss")
IS_CORRECTIONS = ("truncate", "mask", "none")                  # rl.grpo.loss.IS_CORRECTIONS
IS_LEVELS = ("token", "sequence", "geometric")                 # rl.grpo.loss.IS_LEVELS
KL_TYPES = ("none", "k1", "k2", "k3")                          # rl.grpo.loss.KL_TYPES
AGGREGATIONS = ("token", "sequence_mean", "sequence_sum")      # rl.grpo.loss.AGGREGATIONS


@dataclasses.dataclass(frozen=True)
class GrpoSection(_Section):
    prompts_per_step: int = _f(32, "prompts sampled per step", min=1)
    group_size: int = _f(16, "samples (generations) per prompt, G", min=2)
    micro_batch_size: int = _f(1, "sequences per data-parallel rank (mesh.data x mesh.expert) in one "
                                  "forward/backward; gradients accumulate over micro-batches", min=1)
    updates_per_step: int = _f(1, "optimizer updates per step: the step's sequences are split into this "
                                  "many mini-batches (1 = on-policy)", min=1)
    old_logprobs: str = _f("pass", "where logp_old (the trainer's log-probs before the update: the ratio's "
                                   "denominator and the importance weight's numerator) comes from: pass = a forward "
                                   "over the step's sequences before the update; update = the update's own log-probs, "
                                   "gradient stopped (the same numbers when the step makes one update from the weights "
                                   "it scores under: needs updates_per_step 1; saves that forward, about a quarter of "
                                   "a step's compute)", choices=("pass", "update"))
    micro_batch_widths: tuple[int, ...] = _f([], "token positions a micro-batch may be cut to: each update's "
                                                 "sequences are sorted by length and a micro-batch runs at the "
                                                 "smallest of these that holds its longest sequence (else the full "
                                                 "width), in the logprob passes and the train step, one compiled "
                                                 "program per width; with mesh.context > 1, multiples of "
                                                 "mesh.context x the model's index_block_size; [] = every "
                                                 "micro-batch at the full width",
                                             items={"min": 1}, distinct=True)
    advantage: str = _f("grpo", "grpo: (r - group mean) / group std; dr_grpo: no std; rloo: leave-one-out "
                                "baseline; grpo_loo: leave-one-out baseline and std (NeMo-RL's default); reinforce_pp: group "
                                "mean baseline / the whole step's std (REINFORCE++-baseline)",
                        choices=ADVANTAGES)
    loss: str = _f("ppo_clip", "policy objective (rl.grpo.objectives): ppo_clip (clipped ratio), gspo (sequence "
                               "ratio clipped per sequence), gmpo (geometric mean of token ratios clipped in log "
                               "space), sapo (a soft sigmoid gate instead of the clip), cispo (clipped "
                               "stop-gradient weight x REINFORCE), reinforce (-A logp), kl_cov (the unclipped "
                               "surrogate with a KL penalty on the tokens whose logp and advantage covary most: Cui "
                               "et al. 2025), clip_cov (ppo_clip, "
                               "and no gradient on a few tokens drawn among those whose logp and advantage covary "
                               "strongly: the same paper)",
                   choices=LOSSES)
    eps_low: float = _f(0.2, "ppo_clip: ratio clipped below at 1 - eps_low", min=0, lt=1)
    eps_high: float = _f(0.28, "ppo_clip: ratio clipped above at 1 + eps_high (clip-higher when > eps_low)", min=0)
    dual_clip: float | None = _f(None, "ppo_clip's dual clip c: for A < 0 the objective is bounded by c*A; null = "
                                       "off", gt=1)
    gspo_eps_low: float = _f(3e-4, "gspo: sequence ratio clipped below at 1 - gspo_eps_low", min=0, lt=1)
    gspo_eps_high: float = _f(4e-4, "gspo: sequence ratio clipped above at 1 + gspo_eps_high", min=0)
    gmpo_eps_low: float = _f(0.4, "gmpo: each token's log-ratio clipped below at -gmpo_eps_low (the paper's "
                                   "e^-0.4)", min=0)
    gmpo_eps_high: float = _f(0.4, "gmpo: ... and above at gmpo_eps_high (e^0.4)", min=0)
    sapo_tau_pos: float = _f(1.0, "sapo: gate temperature for A >= 0 (TRL's default)", gt=0)
    sapo_tau_neg: float = _f(1.05, "sapo: gate temperature for A < 0 (TRL's default)", gt=0)
    cispo_eps_low: float | None = _f(None, "cispo: weight clipped below at 1 - cispo_eps_low; null = no lower "
                                           "bound (MiniMax-M1)", min=0, lt=1)
    cispo_eps_high: float = _f(0.28, "cispo: weight clipped above at 1 + cispo_eps_high", min=0)
    kl_cov_ratio: float = _f(0.002, "kl_cov: share of a micro-batch's valid tokens, those of largest covariance of "
                                    "logp and advantage, that get the penalty", gt=0, max=1)
    kl_cov_coef: float = _f(1.0, "kl_cov: weight of the penalty |logp - logp_old| on those tokens", min=0)
    clip_cov_ratio: float = _f(2e-4, "clip_cov: share of a micro-batch's valid tokens drawn to lose their gradient "
                                     "(verl's default)", gt=0, max=1)
    clip_cov_lb: float = _f(1.0, "clip_cov: the tokens are drawn among those with covariance of logp and advantage "
                                 "above this (verl's default) ...")
    clip_cov_ub: float = _f(5.0, "... and below this (verl's default)")
    high_entropy_fraction: float = _f(1.0, "the share of each micro-batch's valid tokens, those of highest entropy of "
                                           "the sampling distribution, whose policy term counts (Wang et al. 2025, "
                                           "'Beyond the 80/20 rule': 0.2; TRL's top_entropy_quantile); the KL and "
                                           "entropy terms keep every token, the normaliser counts every token; "
                                           "1 = all tokens (off)", gt=0, max=1)
    is_correction: str = _f("truncate", "trainer-vs-generator importance weight w = exp(logp_old - logp_gen): "
                                        "truncate (min(w, is_cap)), mask (0 outside [is_mask_low, is_mask_high]) "
                                        "or none; a non-finite logp_gen gets weight 0", choices=IS_CORRECTIONS)
    is_level: str = _f("token", "importance weight per token, per sequence (product of ratios) or geometric "
                                "(exp of the mean log-ratio)", choices=IS_LEVELS)
    is_cap: float = _f(2.0, "truncation cap of the importance weight", gt=0)
    is_floor: float | None = _f(None, "lower bound of the truncated importance weight (is_correction=truncate); "
                                      "null = none", min=0)
    is_mask_low: float = _f(0.5, "lower edge of the kept band of is_correction=mask", min=0)
    is_mask_high: float = _f(2.0, "upper edge of the kept band of is_correction=mask", gt=0)
    kl: str = _f("none", "KL penalty to the reference policy: none, or the k1 / k2 / k3 estimator (gradient: "
                         "the KL's, rl.grpo.kl)", choices=KL_TYPES)
    kl_coef: float = _f(0.0, "KL penalty weight (0 with kl=none, > 0 otherwise)", min=0)
    kl_log_ratio_clamp: float | None = _f(20.0, "clamp of logp_ref - logp before the KL estimator; null = off", gt=0)
    kl_clamp: float | None = _f(10.0, "clamp of the per-token KL estimate; null = off", gt=0)
    kl_on_policy: bool = _f(False, "weight the KL term by pi/pi_gen, for tokens the generator sampled (NeMo-RL's "
                                   "use_on_policy_kl_approximation)")
    reference_memory: str = _f("device", "where the KL's reference weights (a copy of the initial params) live between "
                                         "the reference logprob passes: device, or host (the devices' pinned host "
                                         "memory, brought onto them for each pass: the train step's peak holds no "
                                         "reference)", choices=("device", "host"))
    reference_path: str | None = _f(None, "the KL reference: this HF checkpoint (the policy's architecture and "
                                          "shapes) instead of the starting weights; a teacher for on-policy "
                                          "distillation (grpo.kl k2: the reverse KL per sampled token; the task "
                                          "reward may have weight 0); null = the starting weights")
    reference_reset_every_steps: int = _f(0, "ProRL's reference reset: after the update of steps N, 2N, ... the KL "
                                             "reference becomes the current policy (kept in checkpoints from then "
                                             "on); 0 = never: the reference is the starting weights", min=0)
    reference_reset_mix: float = _f(1.0, "a reset sets the reference to mix x policy + (1 - mix) x reference: 1 = "
                                         "the policy itself (ProRL's hard reset); TRL's sync_ref_model uses 0.6 "
                                         "(ref_model_mixup_alpha, with reference_reset_optimizer false)", gt=0, max=1)
    reference_reset_optimizer: bool = _f(True, "with each reference reset also restart Adam (moments and its bias-"
                                               "correction count at 0; the learning-rate schedule goes on), as "
                                               "ProRL does")
    entropy_coef: float = _f(0.0, "entropy bonus: each response token's loss minus entropy_coef x the exact entropy "
                                  "of the sampling distribution there (after temperature, top-k, top-p; computed "
                                  "from the loss's own logits blocks, with its gradient); > 0 also logs `entropy`",
                             min=0)
    aggregation: str = _f("token", "token: sum of token losses / valid tokens in the whole step; sequence_mean: "
                                   "mean over sequences of their token mean; sequence_sum: sum / (sequences x L)",
                          choices=AGGREGATIONS)
    sequence_sum_len: int | None = _f(None, "the constant L of aggregation=sequence_sum; null = "
                                            "generation.max_new_tokens", min=1)
    dynamic_sampling: bool = _f(False, "DAPO: draw further batches of prompts until the step holds prompts_per_step "
                                       "groups whose rewards are not all equal (rl.grpo.dapo)")
    dynamic_sampling_max_rounds: int = _f(10, "batches of prompts one step may draw with dynamic_sampling; when they "
                                              "run out, zero-variance groups fill the step at loss weight 0", min=1)
    overlong_filter: bool = _f(False, "DAPO: no loss on responses cut at generation.max_new_tokens")
    overlong_buffer: int = _f(0, "DAPO soft overlong punishment: over the last this many tokens before "
                                 "generation.max_new_tokens the reward falls linearly to -overlong_penalty; 0 = off",
                              min=0)
    overlong_penalty: float = _f(1.0, "the largest overlong punishment (at max_new_tokens)", gt=0)
    routing_replay: str = _f("none", "MoE routing replay: none, or rollout (the logprob pass and the loss use the "
                                     "generator's expert ids per token and MoE layer, weights recomputed from the "
                                     "live router; the JAX engine, or vLLM engines on GPU: CPU vLLM cannot "
                                     "return routes)",
                             choices=("none", "rollout"))
    indexer_replay: str = _f("none", "indexer selection replay: none, or rollout (the logprob pass and the loss attend "
                                     "over the key blocks the generator's indexer kept, per token, sparse layer and "
                                     "index head; needs generation.backend jax, the one that returns them)",
                             choices=("none", "rollout"))
    max_trajectory_age_steps: int = _f(0, "0: on-policy (generate, then train, each step in turn); 1: the next step's "
                                          "rollouts are generated with the current weights while this step trains "
                                          "(one step off policy; the importance correction uses the generator's "
                                          "logprobs), draining at checkpoints and evaluations (rl.ahead)",
                                       min=0, max=1)

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def loss_config(self, max_new_tokens: int | None = None):
        """rl.grpo.loss.LossConfig of these settings."""
        from rl.grpo.loss import LossConfig
        return LossConfig(loss=self.loss, eps_low=self.eps_low, eps_high=self.eps_high, dual_clip=self.dual_clip,
                          gspo_eps_low=self.gspo_eps_low, gspo_eps_high=self.gspo_eps_high,
                          gmpo_eps_low=self.gmpo_eps_low, gmpo_eps_high=self.gmpo_eps_high,
                          sapo_tau_pos=self.sapo_tau_pos, sapo_tau_neg=self.sapo_tau_neg,
                          cispo_eps_low=self.cispo_eps_low, cispo_eps_high=self.cispo_eps_high,
                          kl_cov_ratio=self.kl_cov_ratio, kl_cov_coef=self.kl_cov_coef,
                          clip_cov_ratio=self.clip_cov_ratio, clip_cov_lb=self.clip_cov_lb,
                          clip_cov_ub=self.clip_cov_ub, high_entropy_fraction=self.high_entropy_fraction,
                          is_correction=self.is_correction, is_level=self.is_level, is_cap=self.is_cap,
                          is_floor=self.is_floor, is_mask_low=self.is_mask_low, is_mask_high=self.is_mask_high,
                          kl=self.kl, kl_coef=self.kl_coef, kl_log_ratio_clamp=self.kl_log_ratio_clamp,
                          kl_clamp=self.kl_clamp, kl_on_policy=self.kl_on_policy, aggregation=self.aggregation,
                          sequence_sum_len=self.sequence_sum_len or max_new_tokens, entropy_coef=self.entropy_coef)
