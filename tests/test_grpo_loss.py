"""The GRPO loss (ppo_clip, importance correction, KL values, aggregation) against hand-computed numbers
(see rl/grpo/*.py for the formulas; advantages, objectives and KL gradients have their own test files).

Expected values are written out by hand or computed with plain Python/numpy loops in this file,
never with the functions under test.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.grpo import LossConfig, generation_mismatch_metrics, grpo_loss, normalizer

PLAIN = dict(dual_clip=None, is_correction="none")   # only the clipped surrogate


def col(*xs):
    """[B, 1] float32 column."""
    return np.asarray(xs, np.float32)[:, None]


def ones(b, t=1):
    return np.ones((b, t), np.float32)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


# ---------------------------------------------------------------- config validation

@pytest.mark.parametrize("field,value", [
    ("eps_low", 1.0), ("eps_low", -0.1), ("eps_high", -0.01), ("dual_clip", 1.0), ("dual_clip", float("nan")),
    ("is_correction", "clip"), ("is_level", "seq"), ("is_cap", 0.0), ("is_mask_low", -1.0),
    ("is_mask_high", 0.5), ("kl", "k4"), ("kl_coef", -1.0), ("kl_coef", 0.1), ("kl_clamp", 0.0),
    ("aggregation", "mean"), ("sequence_sum_len", 0), ("sequence_sum_len", True), ("loss", "ppo"),
    ("gspo_eps_low", 1.0), ("gspo_eps_high", -1e-4), ("cispo_eps_low", 1.0), ("cispo_eps_high", -0.1),
    ("is_floor", 2.0), ("is_floor", -0.1), ("kl_on_policy", 1),
])
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=rf"LossConfig\.{field}=.*allowed"):
        LossConfig(**{field: value})


def test_config_defaults_are_the_m3_recipe():
    c = LossConfig()
    assert (c.loss, c.eps_low, c.eps_high, c.dual_clip, c.is_correction, c.is_level, c.is_cap, c.is_floor, c.kl,
            c.aggregation) == ("ppo_clip", 0.2, 0.28, 10.0, "truncate", "token", 2.0, None, "none", "token")
    LossConfig(kl="k3", kl_coef=0.1)   # valid
    LossConfig(kl="k2", kl_coef=0.1, kl_on_policy=True, is_floor=0.5)
    with pytest.raises(ValueError, match=r"LossConfig\.is_floor=.*is_correction='truncate'"):
        LossConfig(is_floor=0.5, is_correction="mask")
    hash(c)                            # static-argument ready


# ---------------------------------------------------------------- clipping

def _surrogate(rhos, advs, **cfg):
    lo = col(*([-1.0] * len(rhos)))
    lp = lo + np.log(col(*rhos))
    return grpo_loss(lp, lo, lo, np.asarray(advs, np.float32), ones(len(rhos)), LossConfig(**{**PLAIN, **cfg}))


def test_clip_both_sides():
    #        A>0 above 1+eps_high | A>0 inside | A<0 below 1-eps_low | A<0 inside | A>0 low (no clip) | A<0 high
    rhos = [1.5, 1.1, 0.5, 0.9, 0.5, 1.5]
    advs = [2.0, 2.0, -1.0, -1.0, 1.0, -1.0]
    want = [-2 * 1.28, -2 * 1.1, 0.8, 0.9, -0.5, 1.5]
    loss, st = _surrogate(rhos, advs)
    close(loss, sum(want))
    assert float(st["clipped_tokens"]) == 2.0 and float(st["dual_clipped_tokens"]) == 0.0
    for i in range(6):   # one token at a time
        close(_surrogate(rhos[i:i + 1], advs[i:i + 1])[0], want[i])


def test_dual_clip():
    # A<0, rho=20: min(-20, -1.28) = -20, dual clip max(-20, 10*-1) = -10 -> loss 10 (20 without dual clip)
    close(_surrogate([20.0], [-1.0], dual_clip=10.0)[0], 10.0)
    close(_surrogate([20.0], [-1.0])[0], 20.0)
    # A<0, rho=5 < c: untouched; A>0 is never dual-clipped
    close(_surrogate([5.0], [-1.0], dual_clip=10.0)[0], 5.0)
    close(_surrogate([20.0], [1.0], dual_clip=10.0)[0], -1.28)
    _, st = _surrogate([20.0, 5.0, 20.0], [-1.0, -1.0, 1.0], dual_clip=10.0)
    assert float(st["dual_clipped_tokens"]) == 1.0 and float(st["clipped_tokens"]) == 1.0


# ---------------------------------------------------------------- importance sampling

def _is_case(w, **cfg):
    """rho = 1, A = 1: each token's loss is -w_eff."""
    lo = col(*([-2.0] * len(w)))
    lg = lo - np.log(col(*w))                      # logp_old - logp_gen = log w
    return grpo_loss(lo, lo, lg, np.ones(len(w), np.float32), ones(len(w)), LossConfig(**{**PLAIN, **cfg}))


def test_is_truncation_token():
    loss, st = _is_case([3.0, 0.4, 1.0], is_correction="truncate", is_cap=2.0)
    close(loss, -(2.0 + 0.4 + 1.0))
    assert float(st["is_truncated_tokens"]) == 1 and float(st["is_out_of_band_tokens"]) == 2
    assert float(st["is_masked_tokens"]) == 0
    close(st["is_weight_sum"], 3.4)


def test_is_mask_token():
    loss, st = _is_case([3.0, 0.4, 1.0, 0.5, 2.0], is_correction="mask", is_mask_low=0.5, is_mask_high=2.0)
    close(loss, -(0 + 0 + 1.0 + 0.5 + 2.0))          # band edges are kept
    assert float(st["is_masked_tokens"]) == 2 and float(st["is_out_of_band_tokens"]) == 2
    loss, _ = _is_case([3.0, 0.4, 1.0], is_correction="none")
    close(loss, -3.0)


def test_is_floor():
    loss, st = _is_case([3.0, 0.1, 0.4, 1.0], is_correction="truncate", is_cap=2.0, is_floor=0.25)
    close(loss, -(2.0 + 0.25 + 0.4 + 1.0))           # 0.1 raised to the floor, 3 lowered to the cap
    assert float(st["is_floored_tokens"]) == 1 and float(st["is_truncated_tokens"]) == 1


def test_non_finite_generator_logprob_gets_weight_zero_and_is_counted():
    # rho = 1, A = 1: token loss -w_eff; the generator gave -inf (and NaN) on valid tokens 1 and 2
    lo = col(-2.0, -2.0, -2.0, -2.0)
    lg = col(-2.0 - math.log(3.0), -np.inf, np.nan, -2.0)
    run = lambda **c: grpo_loss(lo, lo, lg, np.ones(4, np.float32), ones(4), LossConfig(**{**PLAIN, **c}))  # noqa
    loss, st = run(is_correction="truncate", is_cap=2.0)
    close(loss, -(2.0 + 0 + 0 + 1.0))                 # not the cap
    assert float(st["is_inf_tokens"]) == 2 and float(st["is_truncated_tokens"]) == 1
    assert float(st["is_out_of_band_tokens"]) == 3
    loss, st = run(is_correction="mask")
    close(loss, -1.0)
    assert float(st["is_inf_tokens"]) == 2
    loss, st = run(is_correction="none")               # no correction: logp_gen unused, still counted
    close(loss, -4.0)
    assert float(st["is_inf_tokens"]) == 2
    # sequence level: the whole sequence holding the bad token gets weight 0; its gradient is 0, finite
    lo2, lg2 = np.full((2, 2), -1.0, np.float32), np.full((2, 2), -1.0, np.float32)
    lg2[0, 1] = -np.inf
    c = LossConfig(**{**PLAIN, "is_correction": "truncate", "is_level": "sequence"})
    loss, g = jax.value_and_grad(lambda x: grpo_loss(x, lo2, lg2, np.ones(2, np.float32), ones(2, 2), c)[0])(
        jnp.asarray(lo2))
    close(loss, -2.0)
    close(g, [[0.0, 0.0], [-1.0, -1.0]])


# two sequences, lengths 3 and 2; log w per token 0.3 (seq 0) and -0.2, -0.3 (seq 1); A = [1, -1], rho = 1
SEQ_MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
SEQ_LOGW = np.array([[0.3, 0.3, 0.3], [-0.2, -0.3, 0.0]], np.float32)


def _seq_case(**cfg):
    lo = np.full((2, 3), -1.0, np.float32)
    lo[1, 2] = -np.inf                             # padding garbage must not leak
    lg = lo - SEQ_LOGW
    lg[1, 2] = np.nan
    return grpo_loss(lo, lo, lg, np.array([1.0, -1.0], np.float32), SEQ_MASK, LossConfig(**{**PLAIN, **cfg}))


def test_is_sequence_level():
    w0, w1 = math.exp(0.9), math.exp(-0.5)         # products: 2.4596, 0.6065
    loss, st = _seq_case(is_correction="truncate", is_level="sequence", is_cap=2.0)
    close(loss, -3 * 2.0 + 2 * w1)
    assert float(st["is_truncated_tokens"]) == 3 and float(st["is_out_of_band_tokens"]) == 3
    loss, st = _seq_case(is_correction="mask", is_level="sequence", is_mask_low=0.5, is_mask_high=2.0)
    close(loss, 0.0 * w0 + 2 * w1)
    assert float(st["is_masked_tokens"]) == 3


def test_is_geometric_level():
    g0, g1 = math.exp(0.3), math.exp(-0.25)        # geometric means: 1.3499, 0.7788
    loss, st = _seq_case(is_correction="mask", is_level="geometric", is_mask_low=0.7, is_mask_high=1.2)
    close(loss, 2 * g1)
    assert float(st["is_masked_tokens"]) == 3
    loss, _ = _seq_case(is_correction="truncate", is_level="geometric", is_cap=1.2)
    close(loss, -3 * 1.2 + 2 * g1)
    loss, _ = _seq_case(is_correction="truncate", is_level="geometric", is_cap=2.0)
    close(loss, -3 * g0 + 2 * g1)


# ---------------------------------------------------------------- aggregation

def _agg_case(**cfg):
    mask = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], np.float32)
    lp = np.full((3, 3), -1.0, np.float32)
    loss, st = grpo_loss(lp, lp, lp, np.array([1.0, 2.0, 5.0], np.float32), mask, LossConfig(**{**PLAIN, **cfg}))
    return float(loss), float(normalizer(mask, LossConfig(**{**PLAIN, **cfg}))), st


def test_aggregation_token():
    loss, norm, st = _agg_case(aggregation="token")   # per-token loss = -A; rows of 3 and 2 tokens
    assert (loss, norm) == (-7.0, 5.0)
    assert float(st["tokens"]) == 5 and float(st["sequences"]) == 2


def test_aggregation_sequence_mean():
    loss, norm, _ = _agg_case(aggregation="sequence_mean")
    assert (loss, norm) == (-3.0, 2.0)                # means -1 and -2; the empty row does not count


def test_aggregation_sequence_sum():
    loss, norm, _ = _agg_case(aggregation="sequence_sum")
    assert (loss, norm) == (-7.0, 6.0)                # 2 sequences * padded length 3
    loss, norm, _ = _agg_case(aggregation="sequence_sum", sequence_sum_len=10)
    assert (loss, norm) == (-7.0, 20.0)


def test_normalizer_empty_batch():
    assert float(normalizer(np.zeros((2, 3)), LossConfig())) == 1.0


# ---------------------------------------------------------------- full reference and micro-batches

def _np_reference(lp, lo, lg, adv, mask, lref, cfg):
    """Independent per-token loop of the documented formula."""
    B, T = lp.shape
    per = np.zeros((B, T))
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t] > 0]
        s = sum(mask[i, t] * (lo[i, t] - lg[i, t]) for t in valid)
        for t in valid:
            a = adv[i]
            rho = math.exp(lp[i, t] - lo[i, t])
            clip = lambda v, lo_, hi_: min(max(v, lo_), hi_)  # noqa: E731
            if cfg.loss == "ppo_clip":
                o = min(rho * a, clip(rho, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
                if cfg.dual_clip is not None and a < 0:
                    o = max(o, cfg.dual_clip * a)
            elif cfg.loss == "gspo":
                sr = math.exp(sum(lp[i, u] - lo[i, u] for u in valid) / len(valid))
                o = min(sr * a, clip(sr, 1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high) * a)
            elif cfg.loss == "cispo":
                o = clip(rho, 1 - (cfg.cispo_eps_low or 1.0), 1 + cfg.cispo_eps_high) * a * lp[i, t]
            else:
                o = a * lp[i, t]
            w = {"token": math.exp(lo[i, t] - lg[i, t]), "sequence": math.exp(s),
                 "geometric": math.exp(s / sum(mask[i]))}[cfg.is_level]
            if cfg.is_correction == "truncate":
                w = max(min(w, cfg.is_cap), cfg.is_floor or 0.0)
            elif cfg.is_correction == "mask":
                w = w if cfg.is_mask_low <= w <= cfg.is_mask_high else 0.0
            else:
                w = 1.0
            x = lref[i, t] - lp[i, t]
            kl = {"none": 0.0, "k1": -x, "k2": x * x / 2, "k3": math.exp(x) - x - 1}[cfg.kl]
            if cfg.kl_on_policy:
                kl *= math.exp(lp[i, t] - lg[i, t])
            per[i, t] = -w * o + cfg.kl_coef * kl
    tot = float(np.sum(per * mask))
    nseq = sum(1 for i in range(B) if mask[i].sum() > 0)
    if cfg.aggregation == "token":
        return tot / mask.sum()
    if cfg.aggregation == "sequence_mean":
        return sum(np.sum(per[i] * mask[i]) / mask[i].sum() for i in range(B) if mask[i].sum() > 0) / nseq
    return tot / (nseq * (cfg.sequence_sum_len or T))


def _random_batch(seed=0, B=8, T=7):
    rng = np.random.default_rng(seed)
    lo = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
    lp = (lo + rng.normal(0, 0.8, (B, T))).astype(np.float32)      # wide ratios: clipped, dual-clipped tokens
    lg = (lo + rng.normal(0, 0.5, (B, T))).astype(np.float32)      # IS weights beyond the band / cap
    lref = (lo + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1.5, B).astype(np.float32)
    lengths = rng.integers(1, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    mask[:, 0] = 0.0                                                  # a prompt position
    mask[0, 1:] = 1.0
    return lp, lo, lg, adv, mask, lref


CONFIGS = [
    LossConfig(),                                                                    # M3 recipe
    LossConfig(is_correction="mask", is_level="token", kl="k3", kl_coef=0.05, kl_clamp=None,
               kl_log_ratio_clamp=None, aggregation="sequence_mean"),
    LossConfig(is_correction="truncate", is_level="sequence", is_cap=1.5, dual_clip=3.0, kl="k1", kl_coef=0.1,
               kl_clamp=None, kl_log_ratio_clamp=None, aggregation="sequence_sum"),
    LossConfig(is_correction="mask", is_level="geometric", is_mask_low=0.9, is_mask_high=1.1, dual_clip=None,
               aggregation="token"),
    LossConfig(loss="gspo", gspo_eps_low=0.1, gspo_eps_high=0.15, dual_clip=None, is_floor=0.8, kl="k2",
               kl_coef=0.1, kl_on_policy=True, kl_clamp=None, kl_log_ratio_clamp=None, aggregation="sequence_mean"),
    LossConfig(loss="cispo", cispo_eps_low=0.3, dual_clip=None, kl="k3", kl_coef=0.1, kl_on_policy=True,
               kl_clamp=None, kl_log_ratio_clamp=None),
    LossConfig(loss="reinforce", dual_clip=None, is_level="sequence", aggregation="sequence_sum"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["m3", "mask-tok-k3-seqmean", "trunc-seq-k1-seqsum", "mask-geo",
                                              "gspo-floor-k2-onpolicy", "cispo-k3-onpolicy", "reinforce-seq"])
def test_matches_reference_and_microbatch_invariant(cfg):
    lp, lo, lg, adv, mask, lref = _random_batch()
    norm = normalizer(mask, cfg)
    full, st = grpo_loss(lp, lo, lg, adv, mask, cfg, logp_ref=lref)
    close(full / norm, _np_reference(lp, lo, lg, adv, mask, lref, cfg), tol=1e-4)
    # the branches are exercised (reinforce has no clip)
    assert (float(st["clipped_tokens"]) > 0) == (cfg.loss != "reinforce") and float(st["is_out_of_band_tokens"]) > 0
    for cuts in ([2, 4, 6], [3]):                   # equal micro-batches, and an uneven split
        parts = np.split(np.arange(len(adv)), cuts)
        total, acc = 0.0, {k: 0.0 for k in st}
        for idx in parts:
            l_mb, st_mb = grpo_loss(lp[idx], lo[idx], lg[idx], adv[idx], mask[idx], cfg, logp_ref=lref[idx])
            total += float(l_mb)
            for k in acc:
                acc[k] += float(st_mb[k])
        close(total / norm, full / norm, tol=1e-5)
        for k in st:
            close(acc[k], st[k], tol=1e-4)


def test_mean_of_microbatch_means_differs():
    """The contract matters: averaging per-micro-batch token means is not the step's token mean."""
    lp, lo, lg, adv, mask, lref = _random_batch()
    cfg = LossConfig()
    full = float(grpo_loss(lp, lo, lg, adv, mask, cfg)[0] / normalizer(mask, cfg))
    halves = [np.arange(0, 3), np.arange(3, 8)]
    naive = np.mean([float(grpo_loss(lp[i], lo[i], lg[i], adv[i], mask[i], cfg)[0] / normalizer(mask[i], cfg))
                     for i in halves])
    assert abs(naive - full) > 1e-3


# ---------------------------------------------------------------- gradients

def _grads(rhos, advs, ws=None, **cfg):
    """d(loss_sum)/d(logp) for one token per row (rows are independent)."""
    n = len(rhos)
    lo = col(*([-1.0] * n))
    lp = jnp.asarray(lo + np.log(col(*rhos)))
    lg = lo - np.log(col(*(ws or [1.0] * n)))
    c = LossConfig(**{**PLAIN, **cfg})
    g = jax.grad(lambda x: grpo_loss(x, lo, lg, np.asarray(advs, np.float32), ones(n), c)[0])(lp)
    return np.asarray(g)[:, 0]


def test_gradients_unclipped_vs_clipped():
    # unclipped term active: d(-rho*A)/dlogp = -rho*A
    #   A>0 inside; A<0 inside; A>0 below 1-eps_low (the pessimistic min keeps rho*A); A<0 above 1+eps_high
    # clipped on the active side: A>0 above 1+eps_high, A<0 below 1-eps_low -> no gradient
    g = _grads([1.1, 0.9, 0.5, 1.5, 1.5, 0.5], [1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    close(g, [-1.1, 0.9, -0.5, 1.5, 0.0, 0.0])
    assert g[4] == 0.0 and g[5] == 0.0
    # dual clip (c = 10), A<0: rho = 20 > c -> no gradient; rho = 5 -> -rho*A
    g = _grads([20.0, 5.0, 20.0], [-1.0, -1.0, 1.0], dual_clip=10.0)
    close(g, [0.0, 5.0, 0.0])                       # (A>0, rho=20 is clipped by eps_high)
    assert g[0] == 0.0
    # the truncated IS weight scales the gradient (w = 0.5 kept, w = 3 -> 2) and carries none itself
    close(_grads([1.1, 1.1], [1.0, 1.0], ws=[0.5, 3.0], is_correction="truncate", is_cap=2.0), [-0.55, -2.2])


def test_gradient_ignores_padding_garbage():
    lp = jnp.array([[-1.0, -1.0]])
    lo = np.array([[-1.1, -np.inf]], np.float32)
    lg = np.array([[-1.0, np.nan]], np.float32)
    mask = np.array([[1.0, 0.0]], np.float32)
    loss, g = jax.value_and_grad(lambda x: grpo_loss(x, lo, lg, jnp.array([1.0]), mask, LossConfig())[0])(lp)
    rho, w = math.exp(0.1), math.exp(-0.1)
    close(loss, -w * rho)
    close(g, [[-w * rho, 0.0]])


def test_a_token_outside_the_trainers_top_k_gets_no_loss_and_is_counted():
    """The engine may sample a token at the edge of its nucleus that the trainer's own top-k / top-p leaves out
    (logp and logp_old -inf there). That token gets no loss (the rest's loss and gradients are those of the batch
    with it masked) and is counted; before, it made the step's loss and every gradient NaN."""
    from rl.logprobs import chunked_token_logprobs
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((1, 4, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((10, 8)), jnp.float32)
    logits = np.einsum("btd,vd->btv", np.asarray(h), np.asarray(w))
    y = np.argsort(logits, -1)[..., -1].astype(np.int32)
    y[0, 0] = np.argsort(logits[0, 0])[0]  # the least likely token: outside top_k = 3
    ref = jnp.asarray(rng.standard_normal((1, 4)) - 2.0, jnp.float32)
    cfg = LossConfig(kl="k3", kl_coef=0.1)

    def loss(h, w, mask):
        lp = chunked_token_logprobs(h, w, y, 1.0, 1.0, 3, chunk_tokens=2)
        lo = jax.lax.stop_gradient(lp)
        return grpo_loss(lp, lo, lo + 0.01, jnp.array([1.5]), mask, cfg, logp_ref=ref)

    (got, stats), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w, jnp.ones((1, 4)))
    (want, _), want_grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        h, w, jnp.asarray([[0.0, 1, 1, 1]]))
    assert float(stats["trainer_inf_tokens"]) == 1 and float(stats["tokens"]) == 3
    close(got, want)
    for g, gw in zip(grads, want_grads):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(gw), rtol=1e-6, atol=1e-7)
    metrics = generation_mismatch_metrics(jnp.full((1, 4), -1.0).at[0, 0].set(-5.0),
                                          jnp.full((1, 4), -1.0).at[0, 0].set(-jnp.inf), jnp.ones((1, 4)))
    assert float(metrics["tokens"]) == 3 and np.isfinite(float(metrics["gen_kl_error"]))
    # NaN is not a sampler's edge: it stays loud
    nan, _ = grpo_loss(jnp.full((1, 2), jnp.nan), jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones(1), jnp.ones((1, 2)),
                       LossConfig())
    assert np.isnan(float(nan))


def test_under_sequence_mean_a_token_outside_the_trainers_top_k_stays_in_its_rows_count():
    """"No loss, counted" under sequence_mean too: the row's mean stays over its 4 tokens, as a token the generator
    gave -inf is (an audit: the rest of the row weighed 1/3 each, not 1/4)."""
    lp = jnp.zeros((1, 4))
    cfg = LossConfig(aggregation="sequence_mean")
    for lo, lg in ((jnp.array([[0.0, 0, 0, -jnp.inf]]), jnp.zeros((1, 4))),  # the trainer's edge
                   (jnp.zeros((1, 4)), jnp.array([[0.0, 0, 0, -jnp.inf]]))):  # the generator's
        g = jax.grad(lambda x: grpo_loss(x, lo, lg, jnp.ones(1), jnp.ones((1, 4)), cfg)[0])(lp)
        np.testing.assert_allclose(np.asarray(g), [[-0.25, -0.25, -0.25, 0.0]], rtol=1e-6)


def test_a_token_outside_the_old_policys_top_k_alone_gets_no_loss():
    """logp_old alone -inf (the weights that sampled the batch left the token out, the current ones keep it: the
    update moved it into the nucleus) is a trainer edge too: r = exp(logp - logp_old) would be inf and make the
    step's loss and gradient non-finite. The token gets no loss and is counted, as when logp is -inf."""
    lp = jnp.array([[-1.0, -2.0, -0.5]])
    lo = jnp.array([[-1.1, -jnp.inf, -0.4]])
    cfg = LossConfig(kl="k3", kl_coef=0.1)
    ref = jnp.full((1, 3), -1.5)
    fn = lambda x, mask: grpo_loss(x, lo, lo, jnp.array([0.7]), mask, cfg, logp_ref=ref)  # noqa: E731
    (got, st), g = jax.value_and_grad(fn, has_aux=True)(lp, jnp.ones((1, 3)))
    (want, _), g_want = jax.value_and_grad(fn, has_aux=True)(lp, jnp.array([[1.0, 0.0, 1.0]]))
    assert float(st["trainer_inf_tokens"]) == 1 and float(st["tokens"]) == 2
    close(got, want)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamps", [(None, None), (20.0, 10.0)])
def test_a_token_outside_the_references_top_k_has_no_kl_and_keeps_its_policy_term(kind, clamps):
    """The reference pass scores under the run's top-k / top-p, so a sampled token can be -inf under the reference.
    Without the KL's clamps (the on-policy distillation recipe turns both off) its KL was inf: every step's loss inf,
    skipped, the run stalled (an audit: 3 steps in a row with top_k 2). Its KL term is now 0 in value and gradient,
    with or without clamps, its policy term stays, and it is counted (`ref_inf_tokens`)."""
    log_ratio_clamp, clamp = clamps
    lp, lo = jnp.array([[-1.0, -2.0, -0.5]]), jnp.array([[-1.1, -1.9, -0.4]])
    ref = jnp.array([[-1.2, -jnp.inf, -0.4]])
    cfg = LossConfig(kl=kind, kl_coef=0.1, kl_clamp=clamp, kl_log_ratio_clamp=log_ratio_clamp)
    fn = lambda x, r: grpo_loss(x, lo, lo, jnp.array([0.7]), jnp.ones((1, 3)), cfg, logp_ref=r)  # noqa: E731
    (got, st), g = jax.value_and_grad(fn, has_aux=True)(lp, ref)
    # the want: token 1's reference equal to its own logp (log-ratio 0: every kind's KL value 0 there); the other
    # tokens' values and gradients as they were, token 1's gradient its policy term's alone
    (want, want_st), g_want = jax.value_and_grad(fn, has_aux=True)(lp, ref.at[0, 1].set(-2.0))
    no_kl = jax.grad(lambda x: grpo_loss(x, lo, lo, jnp.array([0.7]), jnp.ones((1, 3)), LossConfig())[0])(lp)
    assert np.isfinite(float(got)) and np.all(np.isfinite(np.asarray(g)))
    assert float(st["ref_inf_tokens"]) == 1 and float(want_st["ref_inf_tokens"]) == 0
    close(got, want)
    close(st["kl_sum"], want_st["kl_sum"])
    np.testing.assert_allclose(np.asarray(g)[0, [0, 2]], np.asarray(g_want)[0, [0, 2]], rtol=1e-6, atol=1e-7)
    close(g[0, 1], no_kl[0, 1])


def test_on_policy_kl_of_a_token_the_generator_could_not_sample_is_zero():
    """With kl_on_policy the KL term's weight is pi/pi_gen; where logp_gen is -inf that weight does not exist, so
    the token's KL is 0 in value and gradient (its logp_gen, zeroed for the arithmetic, would otherwise weigh it
    by exp(logp), a number with no meaning). Its importance-weight stats do not count it as floored either."""
    lp = jnp.array([[-1.0, -1.0]])
    lg = jnp.array([[-1.2, -jnp.inf]])
    ref = jnp.array([[-1.5, -1.5]])
    cfg = LossConfig(dual_clip=None, kl="k1", kl_coef=1.0, kl_on_policy=True, is_floor=0.5)  # A = 0: no policy term
    fn = lambda x: grpo_loss(x, lp, lg, jnp.zeros(1), ones(1, 2), cfg, logp_ref=ref)  # noqa: E731
    (loss, st), g = jax.value_and_grad(fn, has_aux=True)(lp)
    rho0 = math.exp(-1.0 + 1.2)                      # pi / pi_gen of token 0
    close(st["kl_sum"], rho0 * 0.5)                  # k1 = logp - logp_ref = 0.5, token 1 adds nothing
    close(loss, rho0 * 0.5)
    assert float(g[0, 1]) == 0.0
    assert float(st["is_inf_tokens"]) == 1 and float(st["is_floored_tokens"]) == 0
