"""The train/inference importance weight: how much the trainer's policy that produced the batch (logp_old)
and the generation engine that sampled it (logp_gen) disagree on each token, and what the loss does
with it. It multiplies the policy-gradient term of every objective and carries no gradient.

  w      = exp(lo - lg)                                    is_level="token"
         = exp(sum_t m (lo - lg))                          is_level="sequence"  (product of ratios)
         = exp(sum_t m (lo - lg) / sum_t m)                is_level="geometric" (geometric mean)
  w_eff  = clip(w, is_floor, is_cap)                       is_correction="truncate" (TIS; no floor when None)
         = w * 1[is_mask_low <= w <= is_mask_high]         is_correction="mask"     (ICE-POP / MIS)
         = 1                                               is_correction="none"

A generator log-prob that is not finite (-inf: the engine's sampler had excluded the token, e.g. by
its own top-p; NaN: a broken engine) on a valid token makes w infinite or undefined. Such a token gets
w_eff = 0, not the cap - its sample cannot be importance-corrected - and so does every token of its
sequence at the sequence and geometric levels (their weight is a function of the whole sequence). With
is_correction="none" the weight stays 1 (the generator's log-probs are not used). Such tokens are
counted (`bad_gen`) and are out of every band.

Why the sequence level exists and when to use the geometric one: `is_level="sequence"` is the true
importance ratio of the whole response (NeMo-RL's `sequence_level_importance_ratios`, verl's "sequence"
level), the right quantity to *truncate* (cap ~2-10). It is the wrong one to *mask* on long responses:
a per-token mismatch of 1e-3 over 6,144 tokens moves the product by e^(+-6). For masking use
"geometric", the length-normalised form. Here the geometric mean is the sequence's weight itself, which no
reference does any more: NeMo-RL's "seq-mask-tis" uses it only as a mask (sequences outside a tight band,
about [0.999, 1.002], get 0; those kept get their untruncated token-level weights), and verl, whose
experimental geometric IS-weight level (#3694, Oct 2025) was removed in #3984 (Nov 2025; its weight levels
are token and sequence), uses it only as a rejection test (rollout_rs "geometric", since #4544 "seq_mean_k1").
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

IS_CORRECTIONS = ("truncate", "mask", "none")
IS_LEVELS = ("token", "sequence", "geometric")


@dataclasses.dataclass(frozen=True)
class ImportanceWeight:
    w_eff: jax.Array      # [B, T] the weight the policy term is multiplied by (no gradient)
    in_band: jax.Array    # [B, T] bool: is_mask_low <= w <= is_mask_high (and the generator log-prob finite)
    truncated: jax.Array  # [B, T] bool: w > is_cap, lowered to the cap ("truncate")
    floored: jax.Array    # [B, T] bool: w < is_floor, raised to the floor ("truncate" with a floor)
    masked: jax.Array     # [B, T] bool: weight 0 because out of band ("mask")


def importance_weight(lo, lg, m, bad_gen, *, correction: str, level: str, cap: float, floor: Optional[float],
                      mask_low: float, mask_high: float) -> ImportanceWeight:
    """The weights of the module docstring for [B, T] float32 arrays.

    lo, lg: logp_old and logp_gen, zero wherever they are not used (padding, and lg where bad_gen);
    m: the mask (a weight); bad_gen: bool [B, T], valid tokens whose generator log-prob is not finite.
    """
    shape = lo.shape
    log_w = lo - lg
    if level == "token":
        w = jnp.exp(log_w)
        bad = bad_gen
    elif level in ("sequence", "geometric"):
        s = jnp.sum(m * log_w, axis=-1, keepdims=True)
        if level == "geometric":
            n = jnp.sum(m, axis=-1, keepdims=True)
            s = jnp.where(n > 0, s / jnp.where(n > 0, n, 1.0), 0.0)
        w = jnp.broadcast_to(jnp.exp(s), shape)
        bad = jnp.broadcast_to(jnp.any(bad_gen, axis=-1, keepdims=True), shape)
    else:
        raise ValueError(f"is_level={level!r} is invalid: allowed {IS_LEVELS}")
    in_band = (w >= mask_low) & (w <= mask_high) & ~bad
    none = jnp.zeros(shape, bool)
    truncated = floored = masked = none
    if correction == "truncate":
        w_eff = jnp.minimum(w, cap)
        truncated = (w > cap) & ~bad
        if floor is not None:
            w_eff = jnp.maximum(w_eff, floor)
            floored = (w < floor) & ~bad
        w_eff = jnp.where(bad, 0.0, w_eff)
    elif correction == "mask":
        w_eff = jnp.where(in_band, w, 0.0)
        masked = ~in_band
    elif correction == "none":
        w_eff = jnp.ones(shape, jnp.float32)
    else:
        raise ValueError(f"is_correction={correction!r} is invalid: allowed {IS_CORRECTIONS}")
    return ImportanceWeight(jax.lax.stop_gradient(w_eff), in_band, truncated, floored, masked)
