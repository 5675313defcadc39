"""The GRPO loss: a policy-gradient objective by name, the train/inference importance correction, an
optional KL penalty, and the step's aggregation. Each piece is its own module:

  rl.grpo.objectives   ppo_clip (default: the M3 recipe), gspo, gmpo, sapo, cispo, reinforce, kl_cov, clip_cov
  rl.grpo.importance   w = exp(logp_old - logp_gen): truncate (with an optional floor) / mask / none
  rl.grpo.kl           k1 / k2 / k3 estimates of KL(pi || pi_ref) with the KL's gradient
  rl.grpo.mismatch     generator-vs-trainer diagnostics
  rl.grpo.loss_config  LossConfig, the options below, validated when made

Three log-probabilities of each sampled token (all [B, T], gathered at the sampled token):
  logp      the trainer's current forward pass (the only one that carries gradient);
  logp_old  recomputed by the trainer with the weights the step starts from, before any update (those that
            generated the batch; one update newer with grpo.max_trajectory_age_steps: 1, the lag then in w);
  logp_gen  reported by the generation engine while sampling.

Per valid token t of sequence i (mask[i, t] > 0), with advantage A_i:

  loss_t = w_eff * pg_t * h_t + kl_coef * kl_t - entropy_coef * H_t
    pg_t  = the objective's per-token loss (ppo_clip: -max(min(r A, clip(r) A), c A) ...)
    w_eff = the importance weight (no gradient)
    h_t   = 1, or with high_entropy_fraction rho < 1: [sg(H_t) >= the (1 - rho) quantile of sg(H) over the
            batch's valid tokens] (Wang et al. 2025, "Beyond the 80/20 rule": the policy gradient of the
            high-entropy "forking" tokens only; the normaliser still counts every token)
    kl_t  = rl.grpo.kl.kl_penalty (value: the estimate; gradient: the KL's, in expectation)
    H_t   = the exact entropy of the sampling distribution at t (an entropy bonus; its gradient is the
            entropy's own, rl.generation.base.token_logprobs_and_entropy)

The importance weight multiplies the policy term only, not the KL term (as in NeMo-RL's
ClippedPGLossFn); with `kl_on_policy` the KL term has its own weight pi/pi_gen (rl.grpo.kl). A
masked-out (out-of-band) token keeps its place in the denominator: its weight is 0, as in NeMo-RL's
"icepop"; the normaliser never depends on log-probs.

Aggregation contract - the function returns SUMS, the caller divides once per optimizer step:
  "token"          loss_sum = sum_{i,t} m * loss_t;        divide by the global number of valid tokens
  "sequence_mean"  loss_sum = sum_i (sum_t m*loss_t / sum_t m); divide by the global number of sequences
  "sequence_sum"   loss_sum = sum_{i,t} m * loss_t;        divide by (number of sequences * L), with L a
                   constant length (cfg.sequence_sum_len, else the padded T of the batch): Dr.GRPO's
                   "constant normaliser", which keeps long and short responses on one per-token scale.
                   L (generation.max_new_tokens in a run) is TRL's max_completion_length, but TRL's dr_grpo
                   divides by all B sequences and this by those with a valid token: rows given weight 0
                   (overlong_filter, dynamic sampling's fill) leave the count and raise the others' scale.
                   verl's seq-mean-token-sum-norm divides by L alone (loss_scale_factor).
"Global" means the whole step: all micro-batches and all data-parallel ranks. `normalizer(mask, cfg)`
returns that denominator for a full batch's mask, so the step loss is
  sum over micro-batches of grpo_loss(...)[0]  /  normalizer(full_mask, cfg)
which equals the loss of the whole batch computed at once (a mean of per-micro-batch means would not).
A sequence counts when its mask has any valid token.

`grpo_loss` and `normalizer` are jitted (the config is a static argument); inside a caller's jit they
simply inline.

Padding positions (mask == 0) may hold anything (-inf, NaN): every input is replaced by 0 there
before use, so neither the loss nor its gradient can be poisoned by them. Everything is computed in
float32 whatever the input dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rl.grpo.importance import IS_CORRECTIONS, IS_LEVELS, importance_weight
from rl.grpo.kl import KL_TYPES, kl_estimate, kl_penalty
from rl.grpo.loss_config import AGGREGATIONS, LOSSES, LossConfig
from rl.grpo.mismatch import generation_mismatch_metrics
from rl.grpo.objectives import get_policy_loss
from rl.grpo.token_selection import high_entropy_tokens

__all__ = ["AGGREGATIONS", "IS_CORRECTIONS", "IS_LEVELS", "KL_TYPES", "LOSSES", "LossConfig",
           "generation_mismatch_metrics", "grpo_loss", "kl_estimate", "normalizer"]


def _mask_f32(mask, shape):
    m = jnp.asarray(mask).astype(jnp.float32)
    if m.shape != shape:
        raise ValueError(f"mask has shape {m.shape}, expected {shape} (the log-probs' shape)")
    return m


def _clean(x, valid, name, shape):
    x = jnp.asarray(x)
    if x.shape != shape:
        raise ValueError(f"{name} has shape {x.shape}, expected {shape}")
    return jnp.where(valid, x.astype(jnp.float32), 0.0)


def _num_sequences(m):
    return jnp.sum((jnp.sum(m, axis=-1) > 0).astype(jnp.float32))


@functools.partial(jax.jit, static_argnames="cfg")
def normalizer(mask, cfg: LossConfig):
    """The step's loss denominator for `cfg.aggregation`, from the mask [B, T] of the WHOLE step.

      "token"          sum(mask)                                 (valid tokens)
      "sequence_mean"  #sequences with any valid token
      "sequence_sum"   #sequences with any valid token * L,  L = cfg.sequence_sum_len or T
                       (TRL's dr_grpo counts every sequence, masked or not; verl's seq-mean-token-sum-norm
                       divides by L alone)

    Pass the full global batch (a sharded global array is fine: the sum is global). A zero count
    returns 1 so that an all-masked step gives loss 0, not NaN (its loss sum is 0 anyway).
    """
    m = jnp.asarray(mask).astype(jnp.float32)
    if m.ndim != 2:
        raise ValueError(f"mask must be [B, T], got shape {m.shape}")
    if cfg.aggregation == "token":
        d = jnp.sum(m)
    elif cfg.aggregation == "sequence_mean":
        d = _num_sequences(m)
    else:
        length = cfg.sequence_sum_len if cfg.sequence_sum_len is not None else m.shape[1]
        d = _num_sequences(m) * float(length)
    return jnp.where(d > 0, d, 1.0)


def aggregate(per_token, m, aggregation: str, counted=None):
    """The summed loss of per-token terms [B, T] under mask m [B, T] (fp32 weights), as `normalizer` expects:
    sum_{i,t} m*x ("token", "sequence_sum") or sum_i (sum_t m*x / sum_t c) ("sequence_mean"; rows without a
    masked token add 0), c = `counted` (default m): the tokens a row's mean is over, those m leaves without loss
    included."""
    if aggregation == "sequence_mean":
        n = jnp.sum(m if counted is None else counted, axis=-1)
        seq = jnp.sum(m * per_token, axis=-1)
        return jnp.sum(jnp.where(n > 0, seq / jnp.where(n > 0, n, 1.0), 0.0))
    return jnp.sum(m * per_token)


@functools.partial(jax.jit, static_argnames="cfg")
def grpo_loss(logp, logp_old, logp_gen, advantages, mask, cfg: LossConfig, logp_ref=None, entropy=None):
    """Masked SUM of the per-token GRPO loss, and a dict of summed statistics.

    loss_t = w_eff * pg_t * h_t + kl_coef * kl_t - entropy_coef * H_t (module docstring; pg_t from
    rl.grpo.objectives[cfg.loss], w_eff from rl.grpo.importance, kl_t from rl.grpo.kl.kl_penalty).
    Returned loss_sum: sum_{i,t} m*loss_t ("token", "sequence_sum") or
    sum_i sum_t m*loss_t / sum_t m ("sequence_mean"); divide by `normalizer(full_step_mask, cfg)`.

    Args:
      logp, logp_old, logp_gen: [B, T] log-probs of the sampled tokens (logp carries the gradient).
        logp_gen may be -inf (or NaN) on a valid token: that token gets importance weight 0 and is counted.
        logp or logp_old -inf on a valid token (outside the trainer's own top-k / top-p): no loss, counted.
        logp_ref -inf on a valid token (outside the reference's top-k / top-p): no KL term, counted.
      advantages: [B] (one per sequence) or [B, T].
      mask: [B, T], 1 (or a weight) for response tokens that get loss, 0 for prompt and padding.
      cfg: LossConfig (static).
      logp_ref: [B, T] reference-policy log-probs; required when cfg.kl != "none".
      entropy: [B, T] entropy of the sampling distribution at each token (carries the gradient); required when
        cfg.entropy_coef > 0 or cfg.high_entropy_fraction < 1. Given, its sum is returned as "entropy_sum".

    Returns (loss_sum, stats). Every stat is a float32 scalar SUM over this batch, so micro-batch
    values add up; divide by `tokens` (or `sequences`) for fractions and means:
      tokens, sequences, clipped_tokens (the objective's clip is active; ppo_clip/gspo/gmpo: on the side that
      zeroes the gradient, cispo: its weight was clipped), dual_clipped_tokens, is_out_of_band_tokens
      (w outside [is_mask_low, is_mask_high], whatever the mode), is_truncated_tokens (w > is_cap,
      "truncate"), is_floored_tokens (w < is_floor), is_masked_tokens ("mask"), is_inf_tokens (valid
      tokens whose logp_gen is not finite), trainer_inf_tokens (valid tokens left out because logp or logp_old is
      -inf: not counted in `tokens`), kl_sum (the penalty's value, unscaled), neg_logp_sum
      (-logp: approximate entropy), ratio_sum (the objective's ratio), is_weight_sum (w_eff),
      pg_loss_sum (the policy term alone, token-summed), entropy_sum (the exact entropy, when given);
      low_entropy_tokens (valid tokens whose policy term high_entropy_fraction dropped, when it is < 1);
      ref_inf_tokens (valid tokens whose logp_ref is -inf, outside the reference's top-k / top-p: no KL term;
      when cfg.kl is set).
    """
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    logp = jnp.asarray(logp)
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got shape {logp.shape}")
    shape = logp.shape
    m = _mask_f32(mask, shape)
    valid = m > 0
    sg = jax.lax.stop_gradient
    lp = _clean(logp, valid, "logp", shape)
    lo = sg(_clean(logp_old, valid, "logp_old", shape))
    # A valid token that the trainer's own top-k / top-p leaves out (logp or logp_old -inf: the engine sampled it at
    # the edge of a nucleus whose numerics differ a little) has no ratio, KL or objective: it gets no loss, as a
    # token the generator could not have sampled gets weight 0, and is counted. Before, one made the step's loss
    # and gradient NaN and the step was skipped. NaN stays NaN: that is a broken model, not a sampler's edge.
    outside = valid & ((lp == -jnp.inf) | (lo == -jnp.inf))
    counted = m  # a row's sequence_mean stays over all its tokens (else the rest of the row weighed 1/3, not 1/4)
    m = jnp.where(outside, 0.0, m)
    valid = valid & ~outside
    lp, lo = jnp.where(valid, lp, 0.0), jnp.where(valid, lo, 0.0)
    lg = sg(_clean(logp_gen, valid, "logp_gen", shape))
    bad_gen = valid & ~jnp.isfinite(lg)
    lg = jnp.where(bad_gen, 0.0, lg)

    adv = jnp.asarray(advantages).astype(jnp.float32)
    if adv.shape == (shape[0],):
        adv = adv[:, None]
    elif adv.shape != shape:
        raise ValueError(f"advantages has shape {adv.shape}, expected ({shape[0]},) or {shape}")
    a = sg(jnp.broadcast_to(adv, shape))

    if cfg.needs_entropy and entropy is None:
        users = [f"{k}={getattr(cfg, k)!r}" for k, on in (("entropy_coef", cfg.entropy_coef > 0),
                                                         ("high_entropy_fraction", cfg.high_entropy_fraction < 1))
                 if on]
        raise ValueError(f"LossConfig.{' and '.join(users)} needs the per-token entropy")
    ent = None if entropy is None else _clean(entropy, valid, "entropy", shape)

    term = get_policy_loss(cfg.loss)(lp, lo, a, m, cfg)
    iw = importance_weight(lo, lg, m, bad_gen, correction=cfg.is_correction, level=cfg.is_level, cap=cfg.is_cap,
                           floor=cfg.is_floor, mask_low=cfg.is_mask_low, mask_high=cfg.is_mask_high)
    pg = iw.w_eff * term.loss
    if cfg.high_entropy_fraction < 1.0:
        forking = high_entropy_tokens(ent, valid, cfg.high_entropy_fraction)
        pg = jnp.where(forking, pg, 0.0)
    if cfg.kl != "none":
        if logp_ref is None:
            raise ValueError(f"LossConfig.kl={cfg.kl!r} needs logp_ref")
        lr = sg(_clean(logp_ref, valid, "logp_ref", shape))
        # A valid token outside the reference's own top-k / top-p (the reference pass scores under the run's
        # sampling transform) has an infinite KL: without the clamps it made the loss inf and every such step was
        # skipped, so a KL run with top_k / top_p stopped training. It gets no KL term (its policy term stays) and
        # is counted, as a token outside the trainer's own is. Its log-ratio is set to 0 first: a where() after an
        # inf would still send 0 * inf = NaN into the gradient.
        ref_outside = valid & (lr == -jnp.inf)
        lr = jnp.where(ref_outside, sg(lp), lr)
        kl = kl_penalty(lp, lr, cfg.kl, cfg.kl_log_ratio_clamp, cfg.kl_clamp, lg if cfg.kl_on_policy else None)
        kl = jnp.where(ref_outside, 0.0, kl)
        if cfg.kl_on_policy:  # a token the generator could not have sampled has no importance weight
            kl = jnp.where(bad_gen, 0.0, kl)
        per_token = pg + cfg.kl_coef * kl
    else:
        kl = jnp.zeros(shape, jnp.float32)
        per_token = pg

    if cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * ent

    loss_sum = aggregate(per_token, m, cfg.aggregation, counted)

    count = lambda b: jnp.sum(m * b.astype(jnp.float32))  # noqa: E731
    stats = {
        "tokens": jnp.sum(m),
        "sequences": _num_sequences(m),
        "clipped_tokens": count(term.clipped),
        "dual_clipped_tokens": count(term.dual_clipped),
        "is_out_of_band_tokens": count(~iw.in_band),
        "is_truncated_tokens": count(iw.truncated),
        "is_floored_tokens": count(iw.floored),
        "is_masked_tokens": count(iw.masked),
        "is_inf_tokens": count(bad_gen),
        "trainer_inf_tokens": jnp.sum(outside.astype(jnp.float32)),
        "kl_sum": jnp.sum(m * sg(kl)),
        "neg_logp_sum": jnp.sum(m * sg(-lp)),
        "ratio_sum": jnp.sum(m * term.ratio),
        "is_weight_sum": jnp.sum(m * iw.w_eff),
        "pg_loss_sum": jnp.sum(m * sg(pg)),
    }
    if cfg.kl != "none":
        stats["ref_inf_tokens"] = count(ref_outside)
    if cfg.high_entropy_fraction < 1.0:
        stats["low_entropy_tokens"] = count(~forking)
    if ent is not None:
        stats["entropy_sum"] = jnp.sum(m * sg(ent))
    return loss_sum, stats
