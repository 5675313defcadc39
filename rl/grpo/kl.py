"""The KL penalty to a reference policy: per-token estimators of KL(pi || pi_ref) and a penalty whose
gradient is, in expectation over the sampled tokens, the gradient of that KL.

Why the penalty is not simply the estimate. The tokens are sampled from pi itself, so the gradient of
E_{y~pi}[k(y)] has two parts, the pathwise one E[grad k] and the score-function one E[k grad log pi]
(grad E_pi[f_theta] = E_pi[grad f_theta + f_theta grad log pi]). Differentiating the estimate alone
keeps only the first:
  k1 = log pi - log pi_ref:        E[grad k1] = E[grad log pi] = 0       (never pulls towards pi_ref)
  k3 = r - 1 - log r, r = pi_ref/pi: E[grad k3] = -sum_y pi_ref grad log pi = grad KL(pi_ref || pi)
                                   (the forward KL, not the reverse one it estimates)
The true gradient of the reverse KL is grad KL(pi || pi_ref) = E_pi[(log pi - log pi_ref) grad log pi].
Multiplying the estimate by rho = exp(logp - sg(logp)) (value 1, gradient grad log pi) adds the
score-function term, so that E[grad(rho k)] = grad E_pi[k] = grad KL for the unbiased k1 and k3 (Tang &
Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL"; for k3 the per-sample gradient
is (log pi - log pi_ref) grad log pi, verl's `k3+`; NeMo-RL does the same for k1 / k3 only since v0.7.0
(#2506), while NeMo-RL up to v0.6, TRL, verl's k1 / k3 / low_var_kl and DeepSeekMath differentiate k alone,
which for k3 is the forward KL's gradient; docs/loss.md).
k2 = (log r)^2 / 2 is a biased estimate of the KL's value, but its pathwise gradient
(log pi - log pi_ref) grad log pi is already the KL's gradient per sample, so it is used without rho
(rho would add grad E[k2], which is not grad KL).

On-policy approximation (NeMo-RL's `use_on_policy_kl_approximation`): the tokens really come from the
generator pi_gen, not from the current pi (another mini-batch has moved pi, or the engines differ).
With rho = exp(logp - logp_gen) (value pi/pi_gen, gradient rho grad log pi) the same identities hold
under y ~ pi_gen: E_gen[rho k] = E_pi[k] and E_gen[grad(rho k)] = grad E_pi[k]; k2 takes sg(rho).

Clamps (NeMo-RL's kl_input_clamp_value / kl_output_clamp_value): x = logp_ref - logp is clamped before
the estimator and the estimate after it. A token where either clamp acts keeps the penalty's value but gives
no gradient, as under NeMo-RL's and verl's clamps: there the estimate's pathwise gradient is gone, and the score
term alone, k grad log pi, is not the KL's (with k3 clamped at 10 where pi_ref is 2.6 nats likelier than pi, it
pushed log pi down, away from the reference: +10 grad log pi against the KL's -3 at logp -5, logp_ref -2).

Pure functions of float arrays (any float dtype is kept: the loss calls them in float32, tests may use
float64).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

KL_TYPES = ("none", "k1", "k2", "k3")


def kl_estimate(logp, logp_ref, kind: str = "k3", log_ratio_clamp: Optional[float] = None,
                clamp: Optional[float] = None):
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi (Schulman 2020).

    x = logp_ref - logp = log r, clamped to [-log_ratio_clamp, log_ratio_clamp] when given;
      k1 = -x                    unbiased, can be negative
      k2 = x^2 / 2               biased (E[k2] = KL to second order), >= 0, low variance
      k3 = exp(x) - 1 - x        unbiased, >= 0, lower variance than k1
    then clamped to [-clamp, clamp] when given. k1 and k3 are NeMo-RL's `calculate_kl`.
    This is the VALUE; for a loss use `kl_penalty`, whose gradient is the KL's.
    """
    return _estimate(logp, logp_ref, kind, log_ratio_clamp, clamp)[0]


def _estimate(logp, logp_ref, kind, log_ratio_clamp, clamp):
    """(kl_estimate's value, where a clamp acted)."""
    x = logp_ref - logp
    clamped = jnp.zeros(jnp.shape(x), bool)
    if log_ratio_clamp is not None:
        clamped = jnp.abs(x) > log_ratio_clamp
        x = jnp.clip(x, -log_ratio_clamp, log_ratio_clamp)
    if kind == "k1":
        kl = -x
    elif kind == "k2":
        kl = 0.5 * x * x
    elif kind == "k3":
        kl = jnp.expm1(x) - x
    else:
        raise ValueError(f"kl kind={kind!r} is invalid: allowed ('k1', 'k2', 'k3')")
    if clamp is not None:
        clamped = clamped | (jnp.abs(kl) > clamp)
        kl = jnp.clip(kl, -clamp, clamp)
    return kl, clamped


def kl_penalty(logp, logp_ref, kind: str = "k3", log_ratio_clamp: Optional[float] = None,
               clamp: Optional[float] = None, logp_sample=None):
    """Per-token KL(pi || pi_ref) penalty whose expected gradient is grad KL(pi || pi_ref).

      rho     = exp(logp - sg(logp))                 tokens sampled from pi       (value 1)
              = exp(logp - logp_sample)              tokens sampled from pi_sample (on-policy approximation)
      penalty = rho * k            k = k1, k3  (E[grad(rho k)] = grad E_pi[k] = grad KL)
              = sg(rho) * k2       (grad k2 = (logp - logp_ref) grad logp: already grad KL in expectation)
    with k = kl_estimate(logp, logp_ref, kind, log_ratio_clamp, clamp). The value is rho * k
    (= k without logp_sample); where a clamp acts it has no gradient (module docstring). `logp_sample` must be
    finite where the penalty is used (the loss gives tokens with a non-finite generator log-prob weight 0 before
    calling this).
    """
    k, clamped = _estimate(logp, logp_ref, kind, log_ratio_clamp, clamp)
    base = jax.lax.stop_gradient(logp) if logp_sample is None else jax.lax.stop_gradient(logp_sample)
    rho = jnp.exp(logp - base)
    if kind == "k2":
        rho = jax.lax.stop_gradient(rho)
    penalty = rho * k
    return jnp.where(clamped, jax.lax.stop_gradient(penalty), penalty)
