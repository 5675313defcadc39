"""Group-relative advantages for GRPO and its variants (Dr.GRPO, RLOO, GRPO-LOO, REINFORCE++, DAPO filters).

Layout: `rewards` is a flat array [N] of N = num_prompts * group_size samples, grouped consecutively:
samples [g*G, (g+1)*G) answer prompt g. One scalar advantage per sample; the loss broadcasts it over
the sample's response tokens.

Formulas (G = group_size, group g, sample i in g):

  baseline   b_i = mean_g(r)                       (default)
             b_i = (sum_g(r) - r_i) / (G - 1)      (leave_one_out: mean of the other G-1 samples)
  scale      s_i = std_g(r), Bessel-corrected: sqrt(sum_j (r_j - mean_g)^2 / (G - 1))
             with leave_one_out, s_i is the Bessel-corrected std of the same other G-1 samples
             (the set the baseline is taken from; NeMo-RL does the same)
  advantage  A_i = (r_i - b_i) / (s_i + eps)       scale="std"
             A_i =  r_i - b_i                      scale="none", or when the set behind s_i has
                                                   zero variance (all its rewards equal)

"Zero variance" is tested exactly (max == min of the set), not as `std < tol`: the std computed in
floating point of equal numbers can be a rounding residue, and dividing by it would turn a
no-signal group into huge advantages. For the same reason r_i - b_i is set to exactly 0 in a group
whose rewards are all equal: the fp32 mean of eight 0.3s is not 0.3, and REINFORCE++'s batch std
would scale those residues up to advantages of a few percent of a real signal's.
"""

from __future__ import annotations

import functools
import numbers
from typing import Callable

import jax
import jax.numpy as jnp

SCALES = ("std", "none")


def _grouped(rewards, group_size: int):
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be a flat array [num_prompts * group_size], got shape {rewards.shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} is invalid: must be a positive int")
    group_size = int(group_size)
    n = rewards.shape[0]
    if n % group_size:
        raise ValueError(f"rewards has {n} samples, not a multiple of group_size={group_size}")
    r = rewards.astype(jnp.float32).reshape(n // group_size, group_size)
    # every estimator is invariant to a shift of a group's rewards: taken from its least one, exactly where the
    # rewards are close (Sterbenz), so large rewards keep their differences ([1e8, 1e8 + 8]: the fp32 mean
    # 1e8 + 4 rounds to 1e8 and the advantages were [0, 1.41], not [-0.71, 0.71]: a helper's audit)
    return r - jnp.min(r, axis=1, keepdims=True)


def _root_sum_squares(c, denom: int, axis, where=None):
    """sqrt(sum(c^2) / denom) along `axis` (kept), computed as m * sqrt(sum((c/m)^2) / denom) with m = max |c|: the
    squares of deviations past ~1.8e19 overflowed float32 to inf (rewards up to rl.rewards' 1e30 are taken), the
    std became inf and every advantage of the group 0, with no warning (an audit). `where`: the entries summed."""
    a = jnp.abs(c) if where is None else jnp.where(where, jnp.abs(c), 0.0)
    m = jnp.max(a, axis=axis, keepdims=True)
    m = jnp.where(m > 0, m, 1.0)
    q = (c / m) ** 2 if where is None else jnp.where(where, (c / m) ** 2, 0.0)
    return m * jnp.sqrt(jnp.sum(q, axis=axis, keepdims=True) / denom)


def _centred(r, baseline):
    """r - baseline, [P, G], exactly 0 in a group whose rewards are all equal (where it is 0 in exact arithmetic
    and fp32 leaves a rounding residue)."""
    constant = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
    return jnp.where(constant, 0.0, r - baseline)


@functools.partial(jax.jit, static_argnames=("group_size", "scale", "leave_one_out", "eps"))
def group_advantages(rewards, group_size: int, *, scale: str = "std", leave_one_out: bool = False,
                     eps: float = 1e-6):
    """Group-relative advantages, [N] float32.

    A_i = (r_i - b_i) / (s_i + eps) with b_i the group mean (or, with `leave_one_out`, the mean of
    the other G-1 samples of the group) and s_i the Bessel-corrected std of the same set;
    A_i = r_i - b_i when `scale="none"` or when that set has zero variance (max == min).

    Args:
      rewards: [N] rewards, N = num_prompts * group_size, groups consecutive.
      group_size: G, samples per prompt.
      scale: "std" (GRPO) or "none" (Dr.GRPO / RLOO).
      leave_one_out: baseline (and std) over the other G-1 samples; needs G >= 2. With G = 2 the
        "other" set has one sample, whose std is undefined: treated as zero variance (no division).
      eps: added to the std before dividing.
    """
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is invalid: allowed {SCALES}")
    r = _grouped(rewards, group_size)
    g = int(group_size)
    if not leave_one_out:
        centred = _centred(r, jnp.mean(r, axis=1, keepdims=True))
        if scale == "none":
            return centred.reshape(-1)
        std = _root_sum_squares(centred, max(g - 1, 1), axis=1)
        constant = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
        adv = jnp.where(constant, centred, centred / (std + eps))
        return adv.reshape(-1)

    if g < 2:
        raise ValueError(f"leave_one_out needs group_size >= 2, got {g}")
    others = ~jnp.eye(g, dtype=bool)                                    # [i, j]: j is another sample than i
    baseline = (jnp.sum(r, axis=1, keepdims=True) - r) / (g - 1)       # [P, G]
    centred = _centred(r, baseline)
    if scale == "none":
        return centred.reshape(-1)
    dev = r[:, None, :] - baseline[:, :, None]                          # [P, i, j] = r_j - b_i
    std = _root_sum_squares(dev, max(g - 2, 1), axis=2, where=others[None])[..., 0]   # [P, G]
    big = jnp.finfo(jnp.float32).max
    rr = jnp.broadcast_to(r[:, None, :], (r.shape[0], g, g))
    o_max = jnp.max(jnp.where(others[None], rr, -big), axis=2)
    o_min = jnp.min(jnp.where(others[None], rr, big), axis=2)
    constant = o_max == o_min                                           # G = 2: one other sample, always
    adv = jnp.where(constant, centred, centred / (std + eps))
    return adv.reshape(-1)


@functools.partial(jax.jit, static_argnames=("group_size", "eps"))
def batch_normalized_advantages(rewards, group_size: int, *, eps: float = 1e-6):
    """REINFORCE++-baseline (Hu et al. 2025): the group mean as baseline, the whole batch's std as scale, [N] fp32.

        c_i = r_i - mean_g(r)                     (the group baseline, as GRPO's; 0 in a group of equal rewards)
        A_i = c_i / (std_batch(c) + eps)          std over all N samples of the step, Bessel-corrected
        A_i = c_i (= 0)                           when every c is equal (no signal anywhere in the batch)

    The per-sample batch mean of c is 0 by construction (each group's sums to 0), so this is the batch whitening of
    c with each sample counted once. verl's reinforce_plus_plus_baseline is not: it whitens c over response tokens
    (verl_F.masked_whiten), with a token-weighted mean, which is not 0 when lengths differ and is subtracted
    again, and a token-weighted std. Groups [1, 0], [1, 0] whose rewarded samples have 1 token and the others 3:
    +-0.866 here, +1.620 / -0.540 in verl. With equal lengths the two agree.
    Unlike GRPO's per-group std, a group with a small spread keeps small advantages."""
    r = _grouped(rewards, group_size)
    c = _centred(r, jnp.mean(r, axis=1, keepdims=True)).reshape(-1)
    n = c.shape[0]
    std = _root_sum_squares(c, max(n - 1, 1), axis=0)
    return jnp.where(jnp.max(c) == jnp.min(c), c, c / (std + eps))


ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    # GRPO (and the M3 recipe): mean baseline, divide by the group std.
    "grpo": functools.partial(group_advantages, scale="std", leave_one_out=False),
    # Dr.GRPO: mean baseline, no std division (removes the difficulty bias of small-variance groups).
    "dr_grpo": functools.partial(group_advantages, scale="none", leave_one_out=False),
    # RLOO: leave-one-out baseline, no std division.
    "rloo": functools.partial(group_advantages, scale="none", leave_one_out=True),
    # NeMo-RL's default (use_leave_one_out_baseline + normalize_rewards): leave-one-out baseline, divided by
    # the std of the same other G-1 samples.
    "grpo_loo": functools.partial(group_advantages, scale="std", leave_one_out=True),
    # REINFORCE++-baseline: group mean baseline, divided by the std of the whole batch's centred rewards.
    "reinforce_pp": batch_normalized_advantages,
}


def get_advantage_estimator(name: str) -> Callable:
    """The estimator `fn(rewards, group_size, eps=...) -> [N]` registered under `name`.

    Raises ValueError naming the allowed names for an unknown one.
    """
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(f"advantage estimator {name!r} is unknown: allowed {sorted(ADVANTAGE_ESTIMATORS)}") from None


@functools.partial(jax.jit, static_argnames="group_size")
def zero_variance_groups(rewards, group_size: int):
    """bool [num_prompts]: True where every reward of the group is equal (max_g(r) == min_g(r)).

    DAPO dynamic sampling drops these groups: with a mean baseline their advantages are all 0, so
    they carry no policy gradient and only dilute the token normaliser.
    """
    r = _grouped(rewards, group_size)
    return jnp.max(r, axis=1) == jnp.min(r, axis=1)


def overlong_mask(truncated):
    """float32 [N] loss weight per sample: 0 for truncated samples, 1 otherwise (= 1 - truncated).

    DAPO overlong filtering: a response cut at the length limit gets no loss (its reward says
    nothing reliable about the tokens), while it still counts in the group's reward statistics.
    Multiply it into the token mask: `mask * overlong_mask(truncated)[:, None]`.
    """
    t = jnp.asarray(truncated)
    if t.ndim != 1:
        raise ValueError(f"truncated must be a flat array [N], got shape {t.shape}")
    return 1.0 - t.astype(jnp.float32)
