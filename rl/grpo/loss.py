"""The GRPO policy loss: clipped ratio, dual clip, train/inference importance correction, optional KL.

Three log-probabilities of each sampled token (all [B, T], gathered at the sampled token):
  logp      the trainer's current forward pass (the only one that carries gradient);
  logp_old  recomputed by the trainer with the weights that generated the batch, before any update;
  logp_gen  reported by the generation engine while sampling.

Per valid token t of sequence i (mask[i, t] > 0), with advantage A_i:

  rho     = exp(logp - logp_old)
  obj     = min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
  obj     = max(obj, c * A)                    if A < 0 and dual_clip = c   (bounds the loss by -c*A)
  w       = sg(exp(logp_old - logp_gen))       token level, sg = stop-gradient
          = sg(exp(sum_t m_t (logp_old - logp_gen)))           is_level="sequence"  (product of ratios)
          = sg(exp(sum_t m_t (logp_old - logp_gen) / sum_t m_t)) is_level="geometric" (geometric mean)
  w_eff   = min(w, is_cap)                                     is_correction="truncate" (TIS)
          = w * 1[is_mask_low <= w <= is_mask_high]            is_correction="mask"     (ICE-POP / MIS)
          = 1                                                  is_correction="none"
  kl      = logp - logp_ref                                    kl="k1"
          = exp(x) - 1 - x,  x = logp_ref - logp               kl="k3"
            (x clamped to +-kl_log_ratio_clamp first, the estimate clamped to +-kl_clamp after)
  loss_t  = -w_eff * obj + kl_coef * kl

The importance weight multiplies the policy-gradient term only, not the KL term (as in NeMo-RL's
ClippedPGLossFn). A masked-out (out-of-band) token keeps its place in the denominator: its weight is 0,
as in NeMo-RL's "icepop"; the normaliser never depends on log-probs.

Sequence-level weights: `is_level="sequence"` is the product of the per-token ratios, exp(sum of the
log-ratios) - the true importance ratio of the whole response, what NeMo-RL uses with
`sequence_level_importance_ratios` (exp of the masked sum of prev - generation log-probs) and verl
calls the "sequence" level. It is the right quantity to *truncate* (min(w, cap) with cap ~2-10). It is
the wrong one to *mask* on long responses: a per-token mismatch of 1e-3 over 6,144 tokens moves the
product by a factor of e^(+-6), so a [0.5, 2] band would reject almost everything. For masking, use
`is_level="geometric"` = exp(mean log-ratio), the length-normalised form that NeMo-RL's "seq-mask-tis"
and verl's "geometric" level test against a tight band (about [0.999, 1.002]). We apply the geometric
mean as the sequence's weight (verl's geometric level); NeMo-RL's seq-mask-tis instead keeps the
per-token weights of the sequences it retains.

Aggregation contract - the function returns SUMS, the caller divides once per optimizer step:
  "token"          loss_sum = sum_{i,t} m * loss_t;        divide by the global number of valid tokens
  "sequence_mean"  loss_sum = sum_i (sum_t m*loss_t / sum_t m); divide by the global number of sequences
  "sequence_sum"   loss_sum = sum_{i,t} m * loss_t;        divide by (number of sequences * L), with L a
                   constant length (cfg.sequence_sum_len, else the padded T of the batch): Dr.GRPO's
                   "constant normaliser", which keeps long and short responses on one per-token scale.
"Global" means the whole step: all micro-batches and all data-parallel ranks. `normalizer(mask, cfg)`
returns that denominator for a full batch's mask, so the step loss is
  sum over micro-batches of grpo_loss(...)[0]  /  normalizer(full_mask, cfg)
which equals the loss of the whole batch computed at once (a mean of per-micro-batch means would not).
A sequence counts when its mask has any valid token.

`grpo_loss`, `normalizer` and `generation_mismatch_metrics` are jitted (the config is a static
argument); inside a caller's jit they simply inline.

Padding positions (mask == 0) may hold anything (-inf, NaN): every input is replaced by 0 there
before use, so neither the loss nor its gradient can be poisoned by them. Everything is computed in
float32 whatever the input dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

IS_CORRECTIONS = ("truncate", "mask", "none")
IS_LEVELS = ("token", "sequence", "geometric")
KL_TYPES = ("none", "k1", "k3")
AGGREGATIONS = ("token", "sequence_mean", "sequence_sum")


def _bad(field: str, value, allowed: str) -> ValueError:
    return ValueError(f"LossConfig.{field}={value!r} is invalid: allowed {allowed}")


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """GRPO loss options. Defaults are the MiniMax-M3 recipe: clip 0.2 / 0.28, dual clip 10,
    truncated importance sampling at 2 (per token), no KL, token-level aggregation.

    Fields:
      eps_low, eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high] (DAPO clip-higher).
      dual_clip: c > 1, for A < 0 the objective is bounded below by c*A; None turns it off.
      is_correction: "truncate" (w = min(w, is_cap)), "mask" (w = 0 outside [is_mask_low,
        is_mask_high]) or "none" (w = 1). The band is also used for the out-of-band diagnostic.
      is_level: "token", "sequence" (product of ratios) or "geometric" (exp of the mean log-ratio).
      is_cap: truncation cap, > 0.
      is_mask_low, is_mask_high: the kept band for "mask" (0 <= low < high); default [0.5, 2]
        (verl's default lower bound is the reciprocal of the upper one).
      kl: "none", "k1" or "k3" estimator of KL(pi || pi_ref) on the sampled tokens.
      kl_coef: >= 0, must be 0 when kl="none".
      kl_log_ratio_clamp: clamp of x = logp_ref - logp before the estimator (None: off; NeMo-RL: 20).
      kl_clamp: clamp of the per-token estimate to [-kl_clamp, kl_clamp] (None: off; NeMo-RL: 10).
      aggregation: "token", "sequence_mean" or "sequence_sum" (see the module docstring).
      sequence_sum_len: the constant length L of "sequence_sum"; None = the mask's padded T.
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: Optional[float] = 10.0
    is_correction: str = "truncate"
    is_level: str = "token"
    is_cap: float = 2.0
    is_mask_low: float = 0.5
    is_mask_high: float = 2.0
    kl: str = "none"
    kl_coef: float = 0.0
    kl_log_ratio_clamp: Optional[float] = 20.0
    kl_clamp: Optional[float] = 10.0
    aggregation: str = "token"
    sequence_sum_len: Optional[int] = None

    def __post_init__(self):
        if not (_is_real(self.eps_low) and 0.0 <= self.eps_low < 1.0):
            raise _bad("eps_low", self.eps_low, "a float in [0, 1)")
        if not (_is_real(self.eps_high) and self.eps_high >= 0.0):
            raise _bad("eps_high", self.eps_high, "a float >= 0")
        if self.dual_clip is not None and not (_is_real(self.dual_clip) and self.dual_clip > 1.0):
            raise _bad("dual_clip", self.dual_clip, "None (off) or a float > 1")
        if self.is_correction not in IS_CORRECTIONS:
            raise _bad("is_correction", self.is_correction, str(IS_CORRECTIONS))
        if self.is_level not in IS_LEVELS:
            raise _bad("is_level", self.is_level, str(IS_LEVELS))
        if not (_is_real(self.is_cap) and self.is_cap > 0.0):
            raise _bad("is_cap", self.is_cap, "a float > 0")
        if not (_is_real(self.is_mask_low) and self.is_mask_low >= 0.0):
            raise _bad("is_mask_low", self.is_mask_low, "a float >= 0")
        if not (_is_real(self.is_mask_high) and self.is_mask_high > self.is_mask_low):
            raise _bad("is_mask_high", self.is_mask_high, f"a float > is_mask_low={self.is_mask_low!r}")
        if self.kl not in KL_TYPES:
            raise _bad("kl", self.kl, str(KL_TYPES))
        if not (_is_real(self.kl_coef) and self.kl_coef >= 0.0):
            raise _bad("kl_coef", self.kl_coef, "a float >= 0")
        if self.kl == "none" and self.kl_coef != 0.0:
            raise _bad("kl_coef", self.kl_coef, "0 when kl='none' (choose kl='k1' or 'k3' to use a KL penalty)")
        for name in ("kl_log_ratio_clamp", "kl_clamp"):
            v = getattr(self, name)
            if v is not None and not (_is_real(v) and v > 0.0):
                raise _bad(name, v, "None (off) or a float > 0")
        if self.aggregation not in AGGREGATIONS:
            raise _bad("aggregation", self.aggregation, str(AGGREGATIONS))
        v = self.sequence_sum_len
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise _bad("sequence_sum_len", v, "None (use the padded length) or a positive int")


def kl_estimate(logp, logp_ref, kind: str = "k3", log_ratio_clamp: Optional[float] = None,
                clamp: Optional[float] = None):
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi (Schulman 2020).

    x = logp_ref - logp, clamped to [-log_ratio_clamp, log_ratio_clamp] when given;
      k1 = -x = logp - logp_ref          (unbiased, can be negative)
      k3 = exp(x) - 1 - x                (unbiased, >= 0, lower variance)
    then clamped to [-clamp, clamp] when given. Same definition as NeMo-RL's `calculate_kl`.
    """
    x = logp_ref - logp
    if log_ratio_clamp is not None:
        x = jnp.clip(x, -log_ratio_clamp, log_ratio_clamp)
    if kind == "k1":
        kl = -x
    elif kind == "k3":
        kl = jnp.expm1(x) - x
    else:
        raise ValueError(f"kl kind={kind!r} is invalid: allowed ('k1', 'k3')")
    if clamp is not None:
        kl = jnp.clip(kl, -clamp, clamp)
    return kl


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


@functools.partial(jax.jit, static_argnames="cfg")
def grpo_loss(logp, logp_old, logp_gen, advantages, mask, cfg: LossConfig, logp_ref=None):
    """Masked SUM of the per-token GRPO loss, and a dict of summed statistics.

    loss_t = -w_eff * obj + kl_coef * kl, with (see the module docstring for every option)
      rho = exp(logp - logp_old), obj = min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A),
      obj = max(obj, c*A) for A < 0 (dual clip), w = sg(exp(logp_old - logp_gen)) truncated / masked,
      per token or per sequence, kl = k1 or k3 estimate against logp_ref.
    Returned loss_sum: sum_{i,t} m*loss_t ("token", "sequence_sum") or
    sum_i sum_t m*loss_t / sum_t m ("sequence_mean"); divide by `normalizer(full_step_mask, cfg)`.

    Args:
      logp, logp_old, logp_gen: [B, T] log-probs of the sampled tokens (logp carries the gradient).
      advantages: [B] (one per sequence) or [B, T].
      mask: [B, T], 1 (or a weight) for response tokens that get loss, 0 for prompt and padding.
      cfg: LossConfig (static).
      logp_ref: [B, T] reference-policy log-probs; required when cfg.kl != "none".

    Returns (loss_sum, stats). Every stat is a float32 scalar SUM over this batch, so micro-batch
    values add up; divide by `tokens` (or `sequences`) for fractions and means:
      tokens, sequences, clipped_tokens (clip active on the side that zeroes the gradient),
      dual_clipped_tokens, is_out_of_band_tokens (w outside [is_mask_low, is_mask_high], whatever the
      mode), is_truncated_tokens (w > is_cap, "truncate"), is_masked_tokens ("mask"), kl_sum
      (unscaled estimate), neg_logp_sum (-logp: approximate entropy), ratio_sum, is_weight_sum
      (w_eff), pg_loss_sum (the policy term alone, token-summed).
    """
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    logp = jnp.asarray(logp)
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got shape {logp.shape}")
    shape = logp.shape
    m = _mask_f32(mask, shape)
    valid = m > 0
    lp = _clean(logp, valid, "logp", shape)
    lo = jax.lax.stop_gradient(_clean(logp_old, valid, "logp_old", shape))
    lg = jax.lax.stop_gradient(_clean(logp_gen, valid, "logp_gen", shape))

    adv = jnp.asarray(advantages).astype(jnp.float32)
    if adv.shape == (shape[0],):
        adv = adv[:, None]
    elif adv.shape != shape:
        raise ValueError(f"advantages has shape {adv.shape}, expected ({shape[0]},) or {shape}")
    a = jax.lax.stop_gradient(jnp.broadcast_to(adv, shape))

    # Clipped surrogate with dual clip.
    rho = jnp.exp(lp - lo)
    unclipped = rho * a
    clipped = jnp.clip(rho, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * a
    obj = jnp.minimum(unclipped, clipped)
    clip_active = clipped < unclipped
    if cfg.dual_clip is not None:
        floor = cfg.dual_clip * a
        dual_active = (a < 0) & (floor > obj)
        obj = jnp.where(a < 0, jnp.maximum(obj, floor), obj)
    else:
        dual_active = jnp.zeros(shape, bool)

    # Train/inference importance weight (no gradient: depends on logp_old and logp_gen only).
    log_w = lo - lg
    if cfg.is_level == "token":
        w = jnp.exp(log_w)
    else:
        s = jnp.sum(m * log_w, axis=-1, keepdims=True)
        if cfg.is_level == "geometric":
            n = jnp.sum(m, axis=-1, keepdims=True)
            s = jnp.where(n > 0, s / jnp.where(n > 0, n, 1.0), 0.0)
        w = jnp.broadcast_to(jnp.exp(s), shape)
    in_band = (w >= cfg.is_mask_low) & (w <= cfg.is_mask_high)
    if cfg.is_correction == "truncate":
        w_eff = jnp.minimum(w, cfg.is_cap)
        truncated, masked = w > cfg.is_cap, jnp.zeros(shape, bool)
    elif cfg.is_correction == "mask":
        w_eff = jnp.where(in_band, w, 0.0)
        truncated, masked = jnp.zeros(shape, bool), ~in_band
    else:
        w_eff = jnp.ones(shape, jnp.float32)
        truncated = masked = jnp.zeros(shape, bool)
    w_eff = jax.lax.stop_gradient(w_eff)

    pg = -w_eff * obj
    if cfg.kl != "none":
        if logp_ref is None:
            raise ValueError(f"LossConfig.kl={cfg.kl!r} needs logp_ref")
        lr = jax.lax.stop_gradient(_clean(logp_ref, valid, "logp_ref", shape))
        kl = kl_estimate(lp, lr, cfg.kl, cfg.kl_log_ratio_clamp, cfg.kl_clamp)
        per_token = pg + cfg.kl_coef * kl
    else:
        kl = jnp.zeros(shape, jnp.float32)
        per_token = pg

    if cfg.aggregation == "sequence_mean":
        n = jnp.sum(m, axis=-1)
        seq = jnp.sum(m * per_token, axis=-1)
        loss_sum = jnp.sum(jnp.where(n > 0, seq / jnp.where(n > 0, n, 1.0), 0.0))
    else:
        loss_sum = jnp.sum(m * per_token)

    sg = jax.lax.stop_gradient
    count = lambda b: jnp.sum(m * b.astype(jnp.float32))  # noqa: E731
    stats = {
        "tokens": jnp.sum(m),
        "sequences": _num_sequences(m),
        "clipped_tokens": count(clip_active),
        "dual_clipped_tokens": count(dual_active),
        "is_out_of_band_tokens": count(~in_band),
        "is_truncated_tokens": count(truncated),
        "is_masked_tokens": count(masked),
        "kl_sum": jnp.sum(m * sg(kl)),
        "neg_logp_sum": jnp.sum(m * sg(-lp)),
        "ratio_sum": jnp.sum(m * sg(rho)),
        "is_weight_sum": jnp.sum(m * w_eff),
        "pg_loss_sum": jnp.sum(m * sg(pg)),
    }
    return loss_sum, stats


@functools.partial(jax.jit, static_argnames="kl_type")
def generation_mismatch_metrics(logp_gen, logp_old, mask, kl_type: str = "k3"):
    """Generator-vs-trainer mismatch diagnostics, defined as NeMo-RL's ClippedPGLossFn defines them.

    With d = logp_gen - logp_old on valid tokens (N = sum(mask)):
      token_mult_prob_error = (1/N) sum_t m_t * exp(|d_t| * m_t)
          the mean multiplicative probability error; 1 when the two engines agree exactly.
      gen_kl_error = (1/N) sum_t m_t * k(x_t),  x_t = logp_old - logp_gen
          with k3(x) = exp(x) - 1 - x (NeMo-RL's default kl type; estimates KL(P_gen || P_train) on
          tokens sampled from the generator), or k1(x) = -x = logp_gen - logp_old. No clamping.
      policy_kl_error = the same with the roles swapped (x_t = logp_gen - logp_old): KL(P_train || P_gen).
      seq_mult_prob_error [B] = sum_t m exp(|d| m) / sum_t m per sequence (NaN for a sequence with no
          valid token), and its median over sequences, seq_mult_prob_error_median (NaN-ignoring).
    NeMo-RL's CI gate "median token_mult_prob_error < 1.1" is a median over training steps of the
    per-step token mean; the per-sequence median is an extra view that one bad sequence cannot move.

    Also returns the sums (tokens, mult_prob_error_sum, gen_kl_sum, policy_kl_sum) so values can be
    accumulated over micro-batches / ranks and divided once. Means over zero tokens are NaN.
    No gradient flows through any of it.
    """
    if kl_type not in ("k1", "k3"):
        raise ValueError(f"kl_type={kl_type!r} is invalid: allowed ('k1', 'k3')")
    lg = jnp.asarray(logp_gen)
    if lg.ndim != 2:
        raise ValueError(f"logp_gen must be [B, T], got shape {lg.shape}")
    shape = lg.shape
    m = _mask_f32(mask, shape)
    valid = m > 0
    lg = jax.lax.stop_gradient(_clean(lg, valid, "logp_gen", shape))
    lo = jax.lax.stop_gradient(_clean(logp_old, valid, "logp_old", shape))

    mult = m * jnp.exp(jnp.abs(lg - lo) * m)
    gen_kl = m * kl_estimate(lg, lo, kl_type)          # x = logp_old - logp_gen
    pol_kl = m * kl_estimate(lo, lg, kl_type)          # x = logp_gen - logp_old
    tokens = jnp.sum(m)

    def mean(total):
        return jnp.where(tokens > 0, total / jnp.where(tokens > 0, tokens, 1.0), jnp.nan)

    n_seq = jnp.sum(m, axis=-1)
    seq_mult = jnp.where(n_seq > 0, jnp.sum(mult, axis=-1) / jnp.where(n_seq > 0, n_seq, 1.0), jnp.nan)
    mult_sum, gen_sum, pol_sum = jnp.sum(mult), jnp.sum(gen_kl), jnp.sum(pol_kl)
    return {
        "token_mult_prob_error": mean(mult_sum),
        "gen_kl_error": mean(gen_sum),
        "policy_kl_error": mean(pol_sum),
        "seq_mult_prob_error": seq_mult,
        "seq_mult_prob_error_median": jnp.nanmedian(seq_mult),
        "tokens": tokens,
        "mult_prob_error_sum": mult_sum,
        "gen_kl_sum": gen_sum,
        "policy_kl_sum": pol_sum,
    }
