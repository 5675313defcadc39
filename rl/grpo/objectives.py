"""Policy-gradient objectives, by name (`grpo.loss`): ppo_clip, gspo, gmpo, sapo, cispo, reinforce, kl_cov,
clip_cov.

Each is a pure function of [B, T] arrays (float32, already zero at padding) that returns a
`PolicyTerm`: the per-token loss (to be minimised) before the train/inference importance weight and the
aggregation that `rl.grpo.loss.grpo_loss` applies to every objective alike, plus what the diagnostics
count. Notation: lp = logp (carries the gradient), lo = logp_old, A = the advantage (no gradient),
m = the mask (a weight), r = exp(lp - lo) the token ratio (its log capped at LOG_RATIO_CAP), sg = stop-gradient.

On-policy with one update per batch (lp == lo, r = 1) all but clip_cov have the same gradient, -A grad lp per
token; they differ once the policy has moved from the one that sampled the batch
(`grpo.updates_per_step` > 1), which is where their clipping rules act. clip_cov also acts on policy: it stops
the gradient of a few tokens drawn by their covariance.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PolicyTerm:
    loss: jax.Array          # [B, T] per-token loss (before the importance weight and the mask)
    ratio: jax.Array         # [B, T] the ratio the objective uses (no gradient), for ratio_sum
    clipped: jax.Array       # [B, T] bool: a clip is active (see each objective)
    dual_clipped: jax.Array  # [B, T] bool: the dual clip is active (ppo_clip only)


def _sg(x):
    return jax.lax.stop_gradient(x)


# exp overflows float32 past a log-ratio of 88.7: r = inf, and the branch a clip (or jnp.minimum) does not select
# passed 0 * inf = NaN back, a NaN gradient for the whole step from one token the clip covers (an audit, 2026-12-08).
# Capped here, r <= e^60 ~ 1.1e26 stays finite times any advantage; below the cap every value and gradient is as
# before, above it the value is the cap's and the gradient through the ratio 0 (where a clip already stops it
# exactly). verl clamps the log-ratio at 20, which also changes finite values.
LOG_RATIO_CAP = 60.0


def _capped(log_ratio):
    """min(log_ratio, LOG_RATIO_CAP), gradient 1 up to the cap and 0 above it."""
    return jnp.where(log_ratio > LOG_RATIO_CAP, LOG_RATIO_CAP, log_ratio)


def _ratio(lp, lo):
    """r = exp(min(lp - lo, LOG_RATIO_CAP))."""
    return jnp.exp(_capped(lp - lo))


def _clip(x, low: float, high: float):
    """clip(x, low, high) with gradient 1 on [low, high], bounds included, as torch.clamp's. jnp.clip's is 1/2 at a
    bound, so with eps_low = 0 (or eps_high = 0) every on-policy token (r = 1, on the bound) lost a quarter of its
    gradient: jnp.minimum splits its tie in halves, and the clipped half carried only half (a helper's audit)."""
    return jnp.where(x < low, low, jnp.where(x > high, high, x))


def ppo_clip(lp, lo, a, *, eps_low: float, eps_high: float, dual_clip: Optional[float]) -> PolicyTerm:
    """The clipped surrogate with clip-higher and dual clip (PPO / GRPO / DAPO; the M3 recipe).

      r    = exp(lp - lo)
      obj  = min(r*A, clip(r, 1 - eps_low, 1 + eps_high) * A)
      obj  = max(obj, c*A)           for A < 0 when dual_clip = c
      loss = -obj
    `clipped` marks tokens where the clipped branch is the smaller one (the gradient is zero there).
    """
    r = _ratio(lp, lo)
    unclipped = r * a
    clipped = _clip(r, 1.0 - eps_low, 1.0 + eps_high) * a
    obj = jnp.minimum(unclipped, clipped)
    clip_active = clipped < unclipped
    if dual_clip is not None:
        floor = dual_clip * a
        dual_active = (a < 0) & (floor > obj)
        obj = jnp.where(a < 0, jnp.maximum(obj, floor), obj)
    else:
        dual_active = jnp.zeros(r.shape, bool)
    return PolicyTerm(-obj, _sg(r), clip_active, dual_active)


def gspo(lp, lo, a, m, *, eps_low: float, eps_high: float) -> PolicyTerm:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token form (GSPO-token).

      s_i    = exp( sum_t m (lp - lo) / sum_t m )          sequence ratio: geometric mean of token ratios
      s_i,t  = sg(s_i) * exp(lp_t - sg(lp_t))              value s_i, gradient s_i * grad lp_t
      loss_t = -min(s_i,t * A, clip(s_i,t, 1 - eps_low, 1 + eps_high) * A)
    Every token of sequence i has the same value and the same clip decision (the sequence is clipped as
    a whole); the gradient flows through each token's log-prob. With a per-sequence advantage this is
    GSPO: summed over the sequence's tokens and divided by its length (aggregation "sequence_mean") it
    is the paper's sequence objective min(s_i A, clip(s_i) A) with gradient
    s_i A (1/|y_i|) sum_t grad lp_t. The paper's clip range is ~3e-4 / 4e-4 (a geometric mean moves much
    less than a token ratio). A sequence with no valid token gets s = 1.
    """
    n = jnp.sum(m, axis=-1, keepdims=True)
    mean_log = jnp.sum(m * (lp - lo), axis=-1, keepdims=True) / jnp.where(n > 0, n, 1.0)
    s = jnp.broadcast_to(jnp.exp(_sg(_capped(mean_log))), lp.shape)
    s_tok = s * jnp.exp(lp - _sg(lp))
    unclipped = s_tok * a
    clipped = _clip(s_tok, 1.0 - eps_low, 1.0 + eps_high) * a
    obj = jnp.minimum(unclipped, clipped)
    return PolicyTerm(-obj, s, clipped < unclipped, jnp.zeros(lp.shape, bool))


def gmpo(lp, lo, a, m, *, eps_low: float, eps_high: float) -> PolicyTerm:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"; verl's `geo_mean`), token form: the
    geometric mean of the token ratios, each clipped in log space on the pessimistic side first.

      d_t    = lp_t - lo_t,   c_t = sign(A) * min(sign(A) d_t, sign(A) clip(d_t, -eps_low, eps_high))
      s_i    = exp( sum_t m c_t / sum_t m )                 (a sequence's geometric mean of clipped ratios)
      s_i,t  = sg(s_i) * exp(c_t - sg(c_t))                 value s_i, gradient s_i * grad c_t
      loss_t = -A * s_i,t
    With aggregation "sequence_mean" this is the paper's objective -A_i s_i, mean over sequences, with gradient
    -A_i s_i (1/|y_i|) sum_t grad c_t; a token whose log-ratio is clipped (c_t constant: `clipped`) drops out of
    it, the others keep theirs. Unlike GSPO the clip is per token, so one extreme token cannot stop a whole
    sequence's gradient, and the range is in log space: the paper's (e^-0.4, e^0.4) is eps 0.4 / 0.4.
    """
    d = lp - lo
    sign = jnp.sign(a)
    c = sign * jnp.minimum(sign * d, sign * _clip(d, -eps_low, eps_high))
    n = jnp.sum(m, axis=-1, keepdims=True)
    mean_log = jnp.sum(m * c, axis=-1, keepdims=True) / jnp.where(n > 0, n, 1.0)
    s = jnp.broadcast_to(jnp.exp(_sg(mean_log)), lp.shape)
    clip_active = sign * jnp.clip(d, -eps_low, eps_high) < sign * d
    return PolicyTerm(-a * s * jnp.exp(c - _sg(c)), s, clip_active, jnp.zeros(lp.shape, bool))


def sapo(lp, lo, a, *, tau_pos: float, tau_neg: float) -> PolicyTerm:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"; TRL's `sapo`): a smooth gate in place of the
    clip, with a sharper one for negative advantages.

      r      = exp(lp - lo),   tau = tau_pos where A >= 0, tau_neg where A < 0
      loss_t = -sigmoid(tau (r - 1)) * (4 / tau) * A
    d loss / d lp = -4 sigmoid'(tau (r - 1)) r A: -A on policy (r = 1, sigmoid' = 1/4) like every objective here,
    falling smoothly to 0 as r leaves 1 (faster for larger tau) instead of dropping to 0 at a clip edge. Nothing is
    clipped (`clipped` is empty). The paper's temperatures are 1.0 / 1.05; the paper, TRL and verl average each
    sequence's tokens first, which is aggregation "sequence_mean" (not the default "token").
    """
    r = _ratio(lp, lo)
    tau = jnp.where(a >= 0, tau_pos, tau_neg)
    loss = -jax.nn.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * a
    none = jnp.zeros(lp.shape, bool)
    return PolicyTerm(loss, _sg(r), none, none)


def cispo(lp, lo, a, *, eps_low: Optional[float], eps_high: float) -> PolicyTerm:
    """CISPO (MiniMax-M1 report, 2025): clipped, stop-gradient importance weight times REINFORCE.

      r_hat  = clip(r, 1 - eps_low, 1 + eps_high)     lower bound 0 when eps_low is None (M1's setting)
      loss_t = -sg(r_hat) * A * lp
    Gradient -r_hat A grad lp: no token loses its gradient (PPO's clip zeroes it), the weight is only
    bounded. `clipped` marks tokens whose weight was clipped (either side).
    The cap is 1 + eps_high, as in verl's `cispo` (clip_ratio_high) and NeMo-RL's (ratio_clip_max). TRL's
    `loss_type="cispo"` caps at `epsilon_high` itself (ScaleRL's eps_max, recommended 5.0) with no lower bound:
    TRL's epsilon_high e is eps_high = e - 1 here (5.0 -> 4.0). verl and NeMo-RL always apply a lower bound
    (1 - clip_ratio_low, 1 - ratio_clip_min); eps_low None (M1's setting) has none.
    """
    r = _ratio(lp, lo)
    low = 0.0 if eps_low is None else 1.0 - eps_low
    r_hat = _sg(jnp.clip(r, low, 1.0 + eps_high))
    clip_active = (r > 1.0 + eps_high) | (r < low)
    return PolicyTerm(-r_hat * a * lp, _sg(r), clip_active, jnp.zeros(lp.shape, bool))


def reinforce(lp, lo, a) -> PolicyTerm:
    """REINFORCE with the group baseline already in A (no ratio, no clip):  loss_t = -A * lp.

    `lo` is unused by the loss (kept for the common signature); the ratio is still reported.
    """
    return PolicyTerm(-a * lp, _sg(_ratio(lp, lo)), jnp.zeros(lp.shape, bool), jnp.zeros(lp.shape, bool))


def _covariance(lp, a, valid):
    """cov_t = (sg(lp_t) - mean(sg(lp))) * (A_t - mean(A)), means over the valid tokens; 0 elsewhere."""
    n = jnp.maximum(jnp.sum(valid), 1)
    mean = lambda x: jnp.sum(jnp.where(valid, x, 0.0)) / n  # noqa: E731
    lps = _sg(lp)
    return jnp.where(valid, (lps - mean(lps)) * (a - mean(a)), 0.0)


def _share(ratio: float, valid):
    """max(1, floor(ratio * n)): how many of the n valid tokens a share picks (at least one)."""
    return jnp.maximum(1, jnp.floor(ratio * jnp.sum(valid)).astype(jnp.int32))


def _first_k(score, chosen, k):
    """Bool mask of the k entries of `chosen` with the smallest `score` (ties: the earlier position in row-major
    order); fewer when fewer are chosen."""
    flat = jnp.where(chosen, score, jnp.inf).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return chosen & (rank < k).reshape(chosen.shape)


def _batch_key(lo, valid):
    """A PRNG key drawn from the batch itself: the wrapping integer sum of logp_old's float32 bits over the valid
    tokens. Integer addition does not depend on the order of the sum, so every mesh, rerun and resume that sees
    this batch draws the same tokens, and no key has to thread through the train step."""
    bits = jax.lax.bitcast_convert_type(lo.astype(jnp.float32), jnp.uint32)
    seed = jnp.sum(jnp.where(valid, bits, jnp.uint32(0)), dtype=jnp.uint32)
    return jax.random.fold_in(jax.random.key(0x436C6970), seed)


def kl_cov(lp, lo, a, m, *, ratio: float, coef: float) -> PolicyTerm:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"):
    the unclipped surrogate, and a KL penalty on the few tokens whose log-prob and advantage covary most, the
    ones whose updates drive the policy's entropy down.

      cov_t  = (sg(lp_t) - mean(sg(lp))) * (A_t - mean(A))     means over the valid tokens (m > 0) of the batch
      S      = the k = max(1, floor(ratio * n)) valid tokens of largest cov_t (n valid tokens; ties: the earlier
               position in row-major order)
      loss_t = -r_t A_t + coef * |lp_t - lo_t| * [t in S]      (the penalty's gradient coef sign(lp - lo): 0 on policy)
    "The batch" is what the loss sees: one micro-batch. `clipped` marks S (its share is `clip_frac`).
    The config's ratio 0.002 and coef 1.0 are the paper's Qwen2.5-7B recipe, not verl's defaults (0.0002, 0.1).
    """
    valid = m > 0
    selected = _first_k(-_covariance(lp, a, valid), valid, _share(ratio, valid))  # largest first
    d = lp - lo
    r = jnp.exp(_capped(d))
    # |d| written as sg(sign(d)) d: the gradient is coef sign(d), 0 on policy (jnp.abs's is 1 at d = 0)
    loss = -r * a + jnp.where(selected, coef * _sg(jnp.sign(d)) * d, 0.0)
    return PolicyTerm(loss, _sg(r), selected, jnp.zeros(lp.shape, bool))


def clip_cov(lp, lo, a, m, *, eps_low: float, eps_high: float, ratio: float, cov_low: float,
             cov_high: float) -> PolicyTerm:
    """Clip-Cov (Cui et al. 2025, the KL-Cov paper's other fix; verl's `clip_cov`): ppo_clip's surrogate without
    its dual clip, and no gradient on a few tokens drawn among those whose log-prob and advantage covary strongly.

      cov_t  = (sg(lp_t) - mean(sg(lp))) * (A_t - mean(A))       means over the valid tokens (m > 0) of the batch
      C      = the valid tokens with cov_low < cov_t < cov_high that ppo_clip's clip leaves alone
      D      = min(|C|, max(1, floor(ratio * n))) tokens of C drawn uniformly without replacement (n valid tokens)
      loss_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) * [t not in D]
    Unlike the other objectives it acts on policy: D loses its gradient also when r = 1. The draw is seeded by
    the batch (`_batch_key`). `clipped` marks the tokens without gradient: ppo_clip's clip, or D.
    """
    valid = m > 0
    term = ppo_clip(lp, lo, a, eps_low=eps_low, eps_high=eps_high, dual_clip=None)
    clip_active = valid & term.clipped
    cov = _covariance(lp, a, valid)
    candidates = valid & ~clip_active & (cov > cov_low) & (cov < cov_high)
    drawn = _first_k(jax.random.uniform(_batch_key(lo, valid), lp.shape), candidates, _share(ratio, valid))
    return PolicyTerm(jnp.where(drawn, 0.0, term.loss), term.ratio, clip_active | drawn, term.dual_clipped)


# name -> fn(lp, lo, a, m, cfg) with cfg a rl.grpo.loss.LossConfig (read by attribute, not imported here).
POLICY_LOSSES: dict[str, Callable[..., PolicyTerm]] = {
    "ppo_clip": lambda lp, lo, a, m, cfg: ppo_clip(lp, lo, a, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                                   dual_clip=cfg.dual_clip),
    "gspo": lambda lp, lo, a, m, cfg: gspo(lp, lo, a, m, eps_low=cfg.gspo_eps_low, eps_high=cfg.gspo_eps_high),
    "gmpo": lambda lp, lo, a, m, cfg: gmpo(lp, lo, a, m, eps_low=cfg.gmpo_eps_low, eps_high=cfg.gmpo_eps_high),
    "sapo": lambda lp, lo, a, m, cfg: sapo(lp, lo, a, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg),
    "cispo": lambda lp, lo, a, m, cfg: cispo(lp, lo, a, eps_low=cfg.cispo_eps_low, eps_high=cfg.cispo_eps_high),
    "reinforce": lambda lp, lo, a, m, cfg: reinforce(lp, lo, a),
    "kl_cov": lambda lp, lo, a, m, cfg: kl_cov(lp, lo, a, m, ratio=cfg.kl_cov_ratio, coef=cfg.kl_cov_coef),
    "clip_cov": lambda lp, lo, a, m, cfg: clip_cov(lp, lo, a, m, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                                   ratio=cfg.clip_cov_ratio, cov_low=cfg.clip_cov_lb,
                                                   cov_high=cfg.clip_cov_ub),
}
# the objectives m3jax ships, as shipped (rl.grpo.registry may add to POLICY_LOSSES or replace one of them)
SHIPPED_POLICY_LOSSES = dict(POLICY_LOSSES)


def get_policy_loss(name: str) -> Callable[..., PolicyTerm]:
    """The objective `fn(lp, lo, a, m, cfg) -> PolicyTerm` registered under `name`."""
    try:
        return POLICY_LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"policy loss {name!r} is unknown: allowed {tuple(POLICY_LOSSES)}") from None
