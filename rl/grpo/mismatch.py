"""Generator-vs-trainer mismatch diagnostics, defined as NeMo-RL's ClippedPGLossFn defines them."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from rl.grpo.kl import kl_estimate


@functools.partial(jax.jit, static_argnames="kl_type")
def generation_mismatch_metrics(logp_gen, logp_old, mask, kl_type: str = "k3"):
    """Mismatch between the generator's and the trainer's log-probs of the sampled tokens.

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
    per-step token mean; the per-sequence median is an extra view that one bad sequence cannot move. With
    grpo.max_trajectory_age_steps: 1 logp_old is one update newer than the generator's weights, so these measure
    that lag plus the numerics (an audit's tiny run: 1.05-1.21 where age 0 read 1.0): a numerics gate holds at
    age 0 only.

    A valid token whose generator log-prob is not finite (-inf, NaN), or whose trainer log-prob is -inf (outside
    the trainer's own top-k / top-p), is left out of every value here (one such token would make each mean
    infinite); the loss counts those tokens (`is_inf_tokens`, `trainer_inf_tokens`).

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
    m = jnp.asarray(mask).astype(jnp.float32)
    lo = jnp.asarray(logp_old)
    for name, x in (("mask", m), ("logp_old", lo)):
        if x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {shape}")
    lg = lg.astype(jnp.float32)
    m = jnp.where(jnp.isfinite(lg) & (lo != -jnp.inf), m, 0.0)
    valid = m > 0
    lg = jax.lax.stop_gradient(jnp.where(valid, lg, 0.0))
    lo = jax.lax.stop_gradient(jnp.where(valid, lo.astype(jnp.float32), 0.0))

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


# The sums of `generation_mismatch_metrics` that add up over micro-batches: what a train step returns when it is its
# own logp_old (grpo.old_logprobs: update), under "mismatch/<name>".
MISMATCH_SUMS = ("tokens", "mult_prob_error_sum", "gen_kl_sum", "policy_kl_sum")


# The generator's id arrays a batch may carry, and the metric comparing the trainer's own choice with each: the MoE
# routes [B, S, n_moe_layers, k] and the indexer's key blocks [B, S, n_sparse_layers, Hi, K].
ID_MISMATCH_METRICS = {"routes": "moe/route_mismatch_frac", "block_ids": "indexer/selection_mismatch_frac"}


def id_mismatch_from_sums(sums: dict) -> dict:
    """Each `ID_MISMATCH_METRICS` metric whose `id_mismatch_sums` a train step summed as "<metric>/differ" and
    "<metric>/entries" (grpo.old_logprobs: update, where the update compares its own choices)."""
    return {name: float(mismatch_fraction(sums[f"{name}/differ"], sums[f"{name}/entries"]))
            for name in ID_MISMATCH_METRICS.values() if f"{name}/differ" in sums}


def mismatch_from_sums(sums: dict, prefix: str = "mismatch/") -> dict:
    """token_mult_prob_error, gen_kl_error and policy_kl_error from the summed `MISMATCH_SUMS` (NaN over no token):
    the step's values of `generation_mismatch_metrics`, whichever micro-batches the sums came from."""
    tokens = float(sums[prefix + "tokens"])

    def mean(name):
        return float(sums[prefix + name]) / tokens if tokens > 0 else math.nan

    return {"token_mult_prob_error": mean("mult_prob_error_sum"), "gen_kl_error": mean("gen_kl_sum"),
            "policy_kl_error": mean("policy_kl_sum")}


def id_mismatch_sums(trainer_ids, generator_ids, mask, what: str = "[B, S, ..., ids]"):
    """(differ, entries) over the mask's tokens, for id arrays [B, S, ..., n] (the last axis a set of ids):

        differ  = sum_{b,s,...} mask[b,s] * [set(trainer[b,s,...]) != set(gen[b,s,...])]
        entries = sum_{b,s} mask[b,s] * (the count of the axes between S and the ids)
    Sums, so that micro-batches and devices add them before the one division (`mismatch_fraction`)."""
    t = jnp.sort(jnp.asarray(trainer_ids).astype(jnp.int32), axis=-1)
    g = jnp.sort(jnp.asarray(generator_ids).astype(jnp.int32), axis=-1)
    if t.shape != g.shape or t.ndim < 3:
        raise ValueError(f"trainer_ids {t.shape} and generator_ids {g.shape}: expected the same {what}")
    m = jnp.asarray(mask).astype(jnp.float32)
    if m.shape != t.shape[:2]:
        raise ValueError(f"mask has shape {m.shape}, expected {t.shape[:2]}")
    differ = jnp.any(t != g, axis=-1).astype(jnp.float32)  # [B, S, ...]
    return jnp.sum(differ.reshape(*m.shape, -1).sum(-1) * m), jnp.sum(m) * math.prod(t.shape[2:-1])


def mismatch_fraction(differ, entries):
    """differ / entries of `id_mismatch_sums`; NaN when no entry is counted."""
    return jnp.where(entries > 0, differ / jnp.where(entries > 0, entries, 1.0), jnp.nan)


def _set_mismatch(trainer_ids, generator_ids, mask, ndim: int, what: str):
    """Share of the mask's (token, ...) entries whose last-axis id sets differ; NaN when none is counted."""
    if jnp.ndim(trainer_ids) != ndim:
        raise ValueError(f"trainer_ids {jnp.shape(trainer_ids)} and generator_ids {jnp.shape(generator_ids)}: "
                         f"expected the same {what}")
    return mismatch_fraction(*id_mismatch_sums(trainer_ids, generator_ids, mask, what))


def selection_mismatch_frac(trainer_ids, generator_ids, mask):
    """Share of (token, sparse layer, index head) triples whose top-K key-block set differs between the
    trainer's indexer and the generator's.

    trainer_ids, generator_ids [B, S, L, Hi, K] block ids (-1 = none; the generator's are int16), mask
    [B, S] (1 = a valid token). With N = sum(mask) valid tokens, L sparse layers and Hi index heads,
        selection_mismatch_frac = (1 / (N L Hi)) sum_{b,s,l,h} mask[b,s] * [set(trainer[b,s,l,h]) != set(gen[b,s,l,h])]
    Order-insensitive (each K-tuple is sorted first; -1 entries count as ids). NaN when no token is valid
    (or L = 0). The indexer's selection without replay drives the trainer's attention, so a differing set
    means the trainer attended over other keys than the sampler did.
    """
    return _set_mismatch(trainer_ids, generator_ids, mask, 5, "[B, S, L, Hi, K]")


def route_mismatch_frac(trainer_ids, generator_ids, mask):
    """Share of (token, MoE layer) pairs whose top-k expert set differs between trainer and generator.

    trainer_ids, generator_ids [B, S, L, k] expert ids (any integer dtype; the generator's are int16),
    mask [B, S] (1 = a valid token). With N = sum(mask) valid tokens and L layers,
        route_mismatch_frac = (1 / (N L)) sum_{b,s,l} mask[b,s] * [set(trainer[b,s,l]) != set(gen[b,s,l])]
    Order-insensitive: each k-tuple is sorted before the comparison. NaN when no token is valid (or L = 0).
    Under routing replay it still compares the trainer router's own top-k (what it would have chosen) with the
    generator's: the disagreement that replay hides from the loss. Any numeric difference that flips a near-tie
    of the router shows here (a flipped choice moves the token's logprob by far more than rounding).
    """
    return _set_mismatch(trainer_ids, generator_ids, mask, 4, "[B, S, L, k]")
