"""LossConfig: the GRPO loss's options (`rl.grpo.loss.grpo_loss`), validated when made."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from rl.grpo.importance import IS_CORRECTIONS, IS_LEVELS
from rl.grpo.kl import KL_TYPES
from rl.grpo.objectives import POLICY_LOSSES

LOSSES = tuple(POLICY_LOSSES)
AGGREGATIONS = ("token", "sequence_mean", "sequence_sum")


def _bad(field: str, value, allowed: str) -> ValueError:
    return ValueError(f"LossConfig.{field}={value!r} is invalid: allowed {allowed}")


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _eps_ok(v, *, below_one: bool) -> bool:
    return _is_real(v) and v >= 0.0 and (v < 1.0 or not below_one)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """GRPO loss options. Defaults are the MiniMax-M3 recipe: ppo_clip with clip 0.2 / 0.28, dual clip
    10, truncated importance sampling at 2 (per token), no KL, token-level aggregation.

    One default differs from the run config's: `dual_clip` is 10.0 here (the API's, the M3 recipe's c = 10)
    but null (off) in configs/base.yaml (`rl.config.grpo_section`), so a run gets no dual clip unless its
    config sets it; the m3-* recipes set 10. Every other default is the config's.

    Fields:
      loss: the objective, one of LOSSES (rl.grpo.objectives).
      eps_low, eps_high: ppo_clip's ratio clip [1 - eps_low, 1 + eps_high] (DAPO clip-higher).
      dual_clip: ppo_clip's c > 1: for A < 0 the objective is bounded below by c*A; None turns it off.
      gspo_eps_low, gspo_eps_high: gspo's clip of the sequence ratio (paper: 3e-4 / 4e-4).
      gmpo_eps_low, gmpo_eps_high: gmpo's clip of each token's log-ratio to [-low, high] (paper: 0.4 / 0.4).
      sapo_tau_pos, sapo_tau_neg: sapo's gate temperatures for A >= 0 and A < 0 (the paper's and TRL's 1.0 / 1.05).
      cispo_eps_low, cispo_eps_high: cispo's clip of its weight [1 - low, 1 + high]; low None = no lower
        bound (MiniMax-M1's setting). verl's clip_ratio_low / high mean the same; TRL's epsilon_high e caps
        the weight at e itself, which is cispo_eps_high = e - 1.
      kl_cov_ratio, kl_cov_coef: kl_cov's share of a batch's valid tokens that get the penalty (in (0, 1]) and
        the penalty's weight (>= 0); defaults 0.002 / 1.0, the paper's 7B recipe (verl's config: 0.0002 / 0.1).
      clip_cov_ratio, clip_cov_lb, clip_cov_ub: clip_cov's share of a batch's valid tokens drawn to lose their
        gradient (in (0, 1]) and the open band (lb, ub) of covariance they are drawn from (verl's defaults).
      high_entropy_fraction: rho in (0, 1], the share of a batch's valid tokens, those of highest entropy, whose
        policy term counts; 1 = all (off); the paper's 0.2. < 1 needs the per-token entropy.
      is_correction: "truncate" (w = min(w, is_cap), raised to is_floor when set), "mask" (w = 0 outside
        [is_mask_low, is_mask_high]) or "none" (w = 1). The band is also used for the out-of-band
        diagnostic.
      is_level: "token", "sequence" (product of ratios) or "geometric" (exp of the mean log-ratio).
      is_cap: truncation cap, > 0.
      is_floor: lower bound of the truncated weight, in [0, is_cap); None = none. "truncate" only.
      is_mask_low, is_mask_high: the kept band for "mask" (0 <= low < high); default [0.5, 2]
        (verl's default lower bound is the reciprocal of the upper one).
      kl: "none", "k1", "k2" or "k3" estimator of KL(pi || pi_ref) on the sampled tokens.
      kl_coef: >= 0, must be 0 when kl="none".
      kl_log_ratio_clamp: clamp of x = logp_ref - logp before the estimator (None: off; NeMo-RL: 20).
      kl_clamp: clamp of the per-token estimate to [-kl_clamp, kl_clamp] (None: off; NeMo-RL: 10).
      kl_on_policy: weight the KL term by pi/pi_gen (NeMo-RL's use_on_policy_kl_approximation).
      aggregation: "token", "sequence_mean" or "sequence_sum" (see the module docstring). The GRPO and SAPO
        papers (TRL's "grpo" / "sapo", verl's seq-mean-token-mean) use "sequence_mean".
      sequence_sum_len: the constant length L of "sequence_sum"; None = the mask's padded T.
      entropy_coef: >= 0, the entropy bonus's weight; > 0 needs the per-token entropy.
    """

    loss: str = "ppo_clip"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: Optional[float] = 10.0
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    gmpo_eps_low: float = 0.4
    gmpo_eps_high: float = 0.4
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cispo_eps_low: Optional[float] = None
    cispo_eps_high: float = 0.28
    kl_cov_ratio: float = 0.002
    kl_cov_coef: float = 1.0
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    high_entropy_fraction: float = 1.0
    is_correction: str = "truncate"
    is_level: str = "token"
    is_cap: float = 2.0
    is_floor: Optional[float] = None
    is_mask_low: float = 0.5
    is_mask_high: float = 2.0
    kl: str = "none"
    kl_coef: float = 0.0
    kl_log_ratio_clamp: Optional[float] = 20.0
    kl_clamp: Optional[float] = 10.0
    kl_on_policy: bool = False
    aggregation: str = "token"
    sequence_sum_len: Optional[int] = None
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.loss not in POLICY_LOSSES:  # the built-ins and those registered (rl.grpo.registry)
            raise _bad("loss", self.loss, str(tuple(POLICY_LOSSES)))
        for name in ("eps_low", "gspo_eps_low"):
            if not _eps_ok(getattr(self, name), below_one=True):
                raise _bad(name, getattr(self, name), "a float in [0, 1)")
        if self.cispo_eps_low is not None and not _eps_ok(self.cispo_eps_low, below_one=True):
            raise _bad("cispo_eps_low", self.cispo_eps_low, "None (no lower bound) or a float in [0, 1)")
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            if not (_is_real(getattr(self, name)) and getattr(self, name) > 0.0):
                raise _bad(name, getattr(self, name), "a float > 0")
        for name in ("gmpo_eps_low", "gmpo_eps_high"):
            if not (_is_real(getattr(self, name)) and getattr(self, name) >= 0.0):
                raise _bad(name, getattr(self, name), "a float >= 0 (a bound of the log-ratio)")
        for name in ("eps_high", "gspo_eps_high", "cispo_eps_high"):
            if not _eps_ok(getattr(self, name), below_one=False):
                raise _bad(name, getattr(self, name), "a float >= 0")
        if not (_is_real(self.kl_cov_ratio) and 0.0 < self.kl_cov_ratio <= 1.0):
            raise _bad("kl_cov_ratio", self.kl_cov_ratio, "a float in (0, 1]")
        if not (_is_real(self.kl_cov_coef) and self.kl_cov_coef >= 0.0):
            raise _bad("kl_cov_coef", self.kl_cov_coef, "a float >= 0")
        for name in ("clip_cov_ratio", "high_entropy_fraction"):
            if not (_is_real(getattr(self, name)) and 0.0 < getattr(self, name) <= 1.0):
                raise _bad(name, getattr(self, name), "a float in (0, 1]")
        if not _is_real(self.clip_cov_lb):
            raise _bad("clip_cov_lb", self.clip_cov_lb, "a float")
        if not (_is_real(self.clip_cov_ub) and self.clip_cov_ub > self.clip_cov_lb):
            raise _bad("clip_cov_ub", self.clip_cov_ub, f"a float > clip_cov_lb={self.clip_cov_lb!r}")
        if self.dual_clip is not None and not (_is_real(self.dual_clip) and self.dual_clip > 1.0):
            raise _bad("dual_clip", self.dual_clip, "None (off) or a float > 1")
        if self.is_correction not in IS_CORRECTIONS:
            raise _bad("is_correction", self.is_correction, str(IS_CORRECTIONS))
        if self.is_level not in IS_LEVELS:
            raise _bad("is_level", self.is_level, str(IS_LEVELS))
        if not (_is_real(self.is_cap) and self.is_cap > 0.0):
            raise _bad("is_cap", self.is_cap, "a float > 0")
        if self.is_floor is not None and not (_is_real(self.is_floor) and 0.0 <= self.is_floor < self.is_cap):
            raise _bad("is_floor", self.is_floor, f"None (off) or a float in [0, is_cap={self.is_cap!r})")
        if self.is_floor is not None and self.is_correction != "truncate":
            raise _bad("is_floor", self.is_floor, "None unless is_correction='truncate'")
        if not (_is_real(self.is_mask_low) and self.is_mask_low >= 0.0):
            raise _bad("is_mask_low", self.is_mask_low, "a float >= 0")
        if not (_is_real(self.is_mask_high) and self.is_mask_high > self.is_mask_low):
            raise _bad("is_mask_high", self.is_mask_high, f"a float > is_mask_low={self.is_mask_low!r}")
        if self.kl not in KL_TYPES:
            raise _bad("kl", self.kl, str(KL_TYPES))
        if not (_is_real(self.kl_coef) and self.kl_coef >= 0.0):
            raise _bad("kl_coef", self.kl_coef, "a float >= 0")
        if self.kl == "none" and self.kl_coef != 0.0:
            raise _bad("kl_coef", self.kl_coef, "0 when kl='none' (choose kl='k1', 'k2' or 'k3' to use a KL penalty)")
        for name in ("kl_log_ratio_clamp", "kl_clamp"):
            v = getattr(self, name)
            if v is not None and not (_is_real(v) and v > 0.0):
                raise _bad(name, v, "None (off) or a float > 0")
        if not isinstance(self.kl_on_policy, bool):
            raise _bad("kl_on_policy", self.kl_on_policy, "a bool")
        if self.aggregation not in AGGREGATIONS:
            raise _bad("aggregation", self.aggregation, str(AGGREGATIONS))
        v = self.sequence_sum_len
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise _bad("sequence_sum_len", v, "None (use the padded length) or a positive int")
        if not (_is_real(self.entropy_coef) and self.entropy_coef >= 0.0):
            raise _bad("entropy_coef", self.entropy_coef, "a float >= 0")

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss reads the per-token entropy: the bonus, or the high-entropy token selection."""
        return self.entropy_coef > 0 or self.high_entropy_fraction < 1.0
