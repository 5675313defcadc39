"""Parameter precision: bf16 params with an exact fp32 master kept in the optimizer state.

Three modes of `with_master_weights(inner, mode)`:
- "none":    the inner optimizer updates the params in their own dtype (fp32 training, or pure bf16);
- "fp32":    an fp32 master copy lives in the state; the inner optimizer runs on it; params are
             `to_bf16(master)` (2 + 4 bytes per parameter before moments);
- "compact": only a 16-bit remainder lives beside the bf16 param; (param, remainder) reconstruct the
             fp32 master bit for bit (2 + 2 bytes per parameter before moments).

`to_bf16` rounds to nearest with ties away from zero (in magnitude). Round-to-nearest-even cannot be
used: an even bf16 value has 2^16 + 1 fp32 values rounding to it, one too many for a 16-bit
remainder (NVIDIA's `store_param_remainders` makes the same choice). It differs from `astype` only on
exact halfway values, by one bf16 ulp. Both master modes use it, so they give bitwise equal params.

Because the step must leave `params == to_bf16(master)` exactly, the new params are not formed by
adding a delta (`optax.apply_updates` would round p + (new - p) twice, which is inexact when a
parameter shrinks by more than 2^16 in one step): in the master modes the "updates" this
transformation returns ARE the new params, and `apply` (not `optax.apply_updates`) installs them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

MODES = ("none", "fp32", "compact")


def param_dtype(master: str):
    """The dtype params are loaded and kept in: bf16 when the optimizer keeps an fp32 master (or its
    remainder), fp32 when it does not (the reference system's load-dtype rule)."""
    if master not in MODES:
        raise ValueError(f"precision mode {master!r}: expected one of {MODES}")
    return jnp.float32 if master == "none" else jnp.bfloat16


def to_bf16(master: jax.Array) -> jax.Array:
    """fp32 -> bf16, nearest with ties away from zero: top 16 bits of (bits + 0x8000). A NaN stays NaN (the carry
    turned NaNs with low mantissa bits, e.g. 0x7FFFFFFF, which NVIDIA GPUs produce, into -0.0: an audit)."""
    bits = jax.lax.bitcast_convert_type(master, jnp.uint32)
    rounded = jax.lax.bitcast_convert_type(((bits + 0x8000) >> 16).astype(jnp.uint16), jnp.bfloat16)
    return jnp.where(jnp.isnan(master), master.astype(jnp.bfloat16), rounded)


def remainder(master: jax.Array, param: jax.Array) -> jax.Array:
    """int16 r with bits(master) = bits(param) << 16 + r, r in [-2^15, 2^15 - 1] by the rounding above."""
    bits = jax.lax.bitcast_convert_type(master, jnp.uint32)
    high = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(bits - high, jnp.int32).astype(jnp.int16)


def join(param: jax.Array, rem: jax.Array) -> jax.Array:
    """The exact fp32 master from a bf16 param and its int16 remainder."""
    high = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.uint32) << 16
    low = jax.lax.bitcast_convert_type(rem.astype(jnp.int32), jnp.uint32)
    return jax.lax.bitcast_convert_type(high + low, jnp.float32)


def _is_low(p) -> bool:
    return p.dtype == jnp.bfloat16


def params_from_master(master, like):
    """The params a master implies: to_bf16 for bf16 params, a plain cast for the others (fp32 router)."""
    return jax.tree.map(lambda m, p: to_bf16(m) if _is_low(p) else m.astype(p.dtype), master, like)


class MasterState(NamedTuple):
    master: Any  # fp32 tree ("fp32"), int16 remainder tree ("compact"), or () ("none")
    inner: Any


def with_master_weights(inner: optax.GradientTransformation, mode: str = "fp32") -> optax.GradientTransformation:
    """Run `inner` on an fp32 master of the bf16 params (see module docstring for the modes)."""
    if mode not in MODES:
        raise ValueError(f"precision mode {mode!r}: expected one of {MODES}")

    def init(params):
        if mode == "none":
            return MasterState((), inner.init(params))
        # Copies, never aliases of the params: the state is donated together with them.
        master = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)
        store = master if mode == "fp32" else jax.tree.map(
            lambda p: jnp.zeros_like(p, jnp.int16) if _is_low(p) else jnp.array(p, jnp.float32, copy=True), params)
        return MasterState(store, inner.init(master))

    def update(grads, state, params):
        if mode == "none":
            updates, inner_state = inner.update(grads, state.inner, params)
            return updates, MasterState((), inner_state)
        if mode == "fp32":
            master = state.master
        else:
            master = jax.tree.map(lambda p, r: join(p, r) if _is_low(p) else r, params, state.master)
        grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, inner_state = inner.update(grads32, state.inner, master)
        new_master = optax.apply_updates(master, updates)
        new_params = params_from_master(new_master, params)
        if mode == "fp32":
            store = new_master
        else:
            store = jax.tree.map(lambda m, p: remainder(m, p) if _is_low(p) else m, new_master, new_params)
        return new_params, MasterState(store, inner_state)

    return optax.GradientTransformation(init, update)


def apply(params, updates, opt_state: MasterState):
    """New params after `update`: the returned trees themselves in master modes, else p + u (also for a plain optax
    optimizer's state, which `sharding.train_step` takes as mode "none")."""
    if isinstance(opt_state, MasterState) and opt_state.master != ():
        return updates
    return optax.apply_updates(params, updates)


def master_of(params, opt_state: MasterState):
    """The fp32 master the state holds (for tests and checkpoint conversion)."""
    if not isinstance(opt_state, MasterState) or opt_state.master == ():
        return jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return jax.tree.map(lambda p, r: join(p, r) if r.dtype == jnp.int16 else r, params, opt_state.master)


class ScaleByAdamState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any


def restart_adam(inner):
    """`inner` (an optimizer state) with every `ScaleByAdamState` back to its init: count 0, both moments 0, each a
    new buffer placed as the old one (ProRL's optimizer reset). Everything else (the schedule's count, the
    master weights' store outside `inner`) is kept, so the learning-rate schedule goes on where it was."""
    fresh = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731  (zeros_like keeps the array's sharding)
    return jax.tree.map(lambda s: ScaleByAdamState(fresh(s.count), fresh(s.mu), fresh(s.nu))
                        if isinstance(s, ScaleByAdamState) else s, inner,
                        is_leaf=lambda s: isinstance(s, ScaleByAdamState))


def _mix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every output bit depends on every input bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def round_stochastically(x: jax.Array, seed: jax.Array) -> jax.Array:
    """fp32 `x` as bf16, rounded up with probability (x - down) / (up - down), so E[round(x)] = x: the fp32 bits
    plus a uniform 16-bit dither `seed` (uint32, its low 16 bits used), truncated to bf16's. Round to nearest
    drops any change below half a bf16 ulp (0.2 %): Adam's nu, whose decay moves it by 1 - b2 = 0.1 % a step,
    froze (a constant gradient of 1 left nu at 0.25 instead of 0.95 after 3000 steps, so updates grew up to 2x;
    gradients of random size: nu 1.7x fp32's after 6000). Inf and NaN stay what they are."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    up = (bits + (seed & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000)
    rounded = jax.lax.bitcast_convert_type(up, jnp.float32).astype(jnp.bfloat16)
    return jnp.where(jnp.isnan(x), x.astype(jnp.bfloat16), rounded)  # the dither's carry made some NaNs +-0


def dither(g: jax.Array, count: jax.Array, stream: int) -> jax.Array:
    """A uint32 per element for `round_stochastically`, from the element's gradient bits, the step's count and a
    stream number (mu and nu draw independently): a function of the element alone, so a layer-sliced update
    (sharding.optim_step) rounds as the whole-tree one does, and a resumed run as the uninterrupted one."""
    g_bits = jax.lax.bitcast_convert_type(g.astype(jnp.float32), jnp.uint32)
    salt = count.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x632BE5AB * (stream + 1) & 0xFFFFFFFF)
    return _mix32(_mix32(g_bits ^ salt) + salt)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  moment_dtype=jnp.float32) -> optax.GradientTransformation:
    """Adam's direction with both moments stored in `moment_dtype`, computed in fp32 (optax keeps nu in fp32).

    mu = b1 mu + (1-b1) g;  nu = b2 nu + (1-b2) g^2;  u = mu_hat / (sqrt(nu_hat) + eps).
    bf16 moments are stored rounded stochastically (`round_stochastically`), where round to nearest froze nu: each
    step's rounding is within one bf16 ulp and unbiased, so a stored moment follows the fp32 one in expectation,
    with a spread (docs/limitations.md; scripts/bench_bf16_moments.py).
    """
    def init(params):
        # Two separate trees: a buffer appearing twice in a donated state is donated twice. zeros_like, on each
        # parameter's shards: jnp.zeros(shape) made every moment whole on one device (a release-sized model's fp32
        # moments are 3.4 TB), and on several hosts placing them then gathered each one from every host.
        zeros = lambda: jax.tree.map(lambda p: jnp.zeros_like(p, moment_dtype), params)  # noqa: E731
        return ScaleByAdamState(jnp.zeros([], jnp.int32), zeros(), zeros())

    def update(grads, state, params=None):
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: b1 * m.astype(jnp.float32) + (1 - b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v.astype(jnp.float32) + (1 - b2) * g * g, state.nu, grads)
        c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
        updates = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        if jnp.dtype(moment_dtype) == jnp.bfloat16:
            def store(t, stream):
                return jax.tree.map(lambda x, g: round_stochastically(x, dither(g, count, stream)), t, grads)
        else:
            def store(t, stream):
                return jax.tree.map(lambda x: x.astype(moment_dtype), t)
        return updates, ScaleByAdamState(count, store(mu, 0), store(nu, 1))

    return optax.GradientTransformation(init, update)
