"""The KL penalty (rl/grpo/kl.py): estimator values by hand, and gradients against an enumerable vocabulary.

The gradient test enumerates every token y of a 6-token vocabulary with its probability as the weight
(the mask of the loss), so the EXPECTED gradient of the sampled estimator is computed exactly, and
compares it with the gradient of the exact KL(pi || pi_ref) = sum_y pi(y) log(pi(y) / pi_ref(y)).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.grpo import LossConfig, grpo_loss, kl_estimate, kl_penalty

PLAIN = dict(dual_clip=None, is_correction="none")   # only the clipped surrogate (A = 0 below: no policy term)


def ones(b, t=1):
    return np.ones((b, t), np.float32)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def _kl_case(**cfg):
    lp = np.array([[-1.0, -2.0]], np.float32)
    lref = np.array([[-1.5, -1.0]], np.float32)
    # A = 0: only the KL term remains
    return grpo_loss(lp, lp, lp, np.zeros(1, np.float32), ones(1, 2), LossConfig(**{**PLAIN, **cfg}), logp_ref=lref)


def test_kl_k1():
    loss, st = _kl_case(kl="k1", kl_coef=0.1)
    close(st["kl_sum"], 0.5 + -1.0)                # logp - logp_ref
    close(loss, 0.1 * -0.5)


def test_kl_k3_and_clamps():
    k3 = lambda x: math.exp(x) - x - 1             # x = logp_ref - logp  # noqa: E731
    loss, st = _kl_case(kl="k3", kl_coef=0.1)
    close(st["kl_sum"], k3(-0.5) + k3(1.0))        # 0.10653 + 0.71828
    close(loss, 0.1 * (k3(-0.5) + k3(1.0)))
    _, st = _kl_case(kl="k3", kl_coef=0.1, kl_clamp=0.5)
    close(st["kl_sum"], k3(-0.5) + 0.5)
    _, st = _kl_case(kl="k3", kl_coef=0.1, kl_log_ratio_clamp=0.6)
    close(st["kl_sum"], k3(-0.5) + k3(0.6))
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros(1), ones(1),
                  LossConfig(kl="k3", kl_coef=0.1))


def test_kl_gradients_per_token():
    lp = jnp.array([[-1.0, -2.0]])
    lref = np.array([[-1.5, -1.0]], np.float32)
    x = np.array([[-0.5, 1.0]])                     # logp_ref - logp
    grads = {}
    for kind in ("k1", "k2", "k3"):
        cfg = LossConfig(**PLAIN, kl=kind, kl_coef=1.0)
        grads[kind] = jax.grad(lambda v: grpo_loss(v, lp, lp, np.zeros(1), ones(1, 2), cfg, logp_ref=lref)[0])(lp)
    # score term k * dlogp plus the pathwise term (rl/grpo/kl.py):
    #   k1: -x + 1;  k3: (exp(x) - 1 - x) + (1 - exp(x)) = -x;  k2 (pathwise only): d(x^2/2)/dlogp = -x
    close(grads["k1"], -x + 1)
    close(grads["k2"], -x)
    close(grads["k3"], -x)
    # the values are the estimates themselves (the weight is 1 in value)
    _, st = _kl_case(kl="k2", kl_coef=0.1)
    close(st["kl_sum"], 0.5 * 0.25 + 0.5 * 1.0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_a_clamped_token_gives_no_gradient(kind):
    """Where a clamp acts, the estimate's pathwise gradient is gone and the score term alone is not the KL's: k3
    clamped at 10 with pi_ref 3 nats likelier (logp -5, logp_ref -2) gave +10 d logp, pushing log pi away from the
    reference (the KL's gradient is logp - logp_ref = -3). Such a token keeps its value and gives no gradient, as
    under NeMo-RL's and verl's clamps; unclamped tokens keep theirs."""
    from rl.grpo.kl import kl_estimate, kl_penalty
    lp = jnp.array([-5.0, -2.5, -2.0 - 25.0])  # x = 3 (k3 > 10 clamped; k1, k2 not), x = 0.5, x = 25 (x clamped)
    lref = jnp.full(3, -2.0)
    penalty = lambda v: kl_penalty(v, lref, kind, log_ratio_clamp=20.0, clamp=10.0)  # noqa: E731
    grad = np.asarray(jax.grad(lambda v: penalty(v).sum())(lp))
    np.testing.assert_allclose(np.asarray(penalty(lp)), np.asarray(kl_estimate(lp, lref, kind, 20.0, 10.0)),
                               rtol=1e-6)
    want_unclamped = {"k1": 1 - 0.5, "k2": -0.5, "k3": -0.5}[kind]  # -x (+ 1, k1's zero-mean score term)
    np.testing.assert_allclose(grad[1], want_unclamped, rtol=1e-6)
    assert grad[2] == 0.0
    if kind == "k3":
        assert grad[0] == 0.0
    else:  # k1 = -3 and k2 = 4.5 are inside the clamps: their gradients stay
        np.testing.assert_allclose(grad[0], {"k1": 1 - 3.0, "k2": -3.0}[kind], rtol=1e-6)


# ---------------------------------------------------------------- expected gradient by enumeration

Z = np.array([0.3, -1.2, 0.8, 0.0, -0.4, 1.5])        # policy logits (the parameters)
Z_REF = np.array([-0.5, 0.7, 0.2, -1.0, 0.9, 0.1])    # reference logits
Z_GEN = np.array([0.1, -0.9, 1.1, 0.3, -0.2, 1.2])    # a generator that differs from the policy


def _exact_kl(z):
    lp = jax.nn.log_softmax(z)
    return jnp.sum(jnp.exp(lp) * (lp - jax.nn.log_softmax(jnp.asarray(Z_REF, z.dtype))))


def _rel(g, want):
    return float(jnp.linalg.norm(g - want) / jnp.linalg.norm(want))


def _expected_grad_of_loss(kind, z_sample=None, **cfg):
    """sum_y q(y) grad_z loss(y): one row per token y, weighted by q = pi (or the generator's pi_gen)."""
    c = LossConfig(**PLAIN, kl=kind, kl_coef=1.0, **cfg)     # default clamps (20 / 10) stay inactive here
    lref = jax.nn.log_softmax(jnp.asarray(Z_REF, jnp.float32))[:, None]

    def loss(z):
        lp = jax.nn.log_softmax(z)[:, None]
        sampler = lp if z_sample is None else jax.nn.log_softmax(jnp.asarray(z_sample, z.dtype))[:, None]
        lg = jax.lax.stop_gradient(sampler)
        q = jnp.exp(lg)
        return grpo_loss(lp, jax.lax.stop_gradient(lp), lg, jnp.zeros(len(Z)), q, c, logp_ref=lref)[0]

    return jax.grad(loss)(jnp.asarray(Z, jnp.float32))


def _expected_grad(per_token):
    """sum_y pi(y) grad_z per_token(logp_y, logp_ref_y), in float64 (the pure functions keep the dtype)."""
    with jax.enable_x64():
        z = jnp.asarray(Z, jnp.float64)
        lref = jax.nn.log_softmax(jnp.asarray(Z_REF, jnp.float64))

        def f(z):
            lp = jax.nn.log_softmax(z)
            return jnp.sum(jax.lax.stop_gradient(jnp.exp(lp)) * per_token(lp, lref))

        return np.asarray(jax.grad(f)(z)), np.asarray(jax.grad(_exact_kl)(z))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_expected_kl_gradient_is_the_kl_gradient(kind):
    want = jax.grad(_exact_kl)(jnp.asarray(Z, jnp.float32))
    assert _rel(_expected_grad_of_loss(kind), want) <= 1e-6            # the loss, float32
    got, want64 = _expected_grad(lambda lp, lr: kl_penalty(lp, lr, kind))
    assert _rel(got, want64) <= 1e-12                                   # the pure function, float64


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_the_estimate_alone_does_not_have_the_kl_gradient(kind):
    """What the loss did before: differentiating the estimate. k1 averages to 0, k3 to grad KL(pi_ref || pi)."""
    got, want = _expected_grad(lambda lp, lr: kl_estimate(lp, lr, kind))
    assert _rel(got, want) > 0.1
    if kind == "k1":
        close(got, np.zeros(len(Z)), tol=1e-12)
    else:
        with jax.enable_x64():
            p_ref = jax.nn.softmax(jnp.asarray(Z_REF, jnp.float64))
            forward = jax.grad(lambda z: jnp.sum(p_ref * (jnp.log(p_ref) - jax.nn.log_softmax(z))))(
                jnp.asarray(Z, jnp.float64))
        close(got, forward, tol=1e-12)


def test_k2_takes_no_score_term():
    """k2 is biased in value, so rho * k2 would differentiate E[k2], not the KL: its weight is stop-gradient."""
    rho_k2 = lambda lp, lr: jnp.exp(lp - jax.lax.stop_gradient(lp)) * kl_estimate(lp, lr, "k2")  # noqa: E731
    got, want = _expected_grad(rho_k2)
    assert _rel(got, want) > 0.01


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_on_policy_approximation(kind):
    """Tokens sampled by a generator pi_gen != pi: with kl_on_policy the penalty weighted by pi/pi_gen keeps
    the KL's expected gradient (and, for k1 / k3, its expected value); without it the gradient is off."""
    want = jax.grad(_exact_kl)(jnp.asarray(Z, jnp.float32))
    assert _rel(_expected_grad_of_loss(kind, Z_GEN, kl_on_policy=True), want) <= 1e-6
    assert _rel(_expected_grad_of_loss(kind, Z_GEN), want) > 0.01
    if kind != "k2":
        lp, lg = jax.nn.log_softmax(jnp.asarray(Z)), jax.nn.log_softmax(jnp.asarray(Z_GEN))
        lref = jax.nn.log_softmax(jnp.asarray(Z_REF))
        close(jnp.sum(jnp.exp(lg) * kl_penalty(lp, lref, kind, logp_sample=lg)), _exact_kl(jnp.asarray(Z)))


def test_the_log_ratio_clamp_bounds_both_sides():
    """x = logp_ref - logp is clamped to [-c, c], not only above: a token the policy has made far likelier than the
    reference (x = -25) must read as x = -20, or k1 and k2 reach 25 and 312.5 and dominate the step's KL; it keeps
    its value and gives no gradient, as the upper side does."""
    lp, lref = jnp.array([0.0]), jnp.array([-25.0])
    np.testing.assert_allclose(np.asarray(kl_estimate(lp, lref, "k1", log_ratio_clamp=20.0)), [20.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kl_estimate(lp, lref, "k2", log_ratio_clamp=20.0)), [200.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kl_estimate(lp, lref, "k3", log_ratio_clamp=20.0)),
                               [math.expm1(-20.0) + 20.0], rtol=1e-6)
    for kind in ("k1", "k2", "k3"):
        g = jax.grad(lambda v: kl_penalty(v, lref, kind, log_ratio_clamp=20.0).sum())(lp)  # noqa: B023
        assert float(g[0]) == 0.0, kind
