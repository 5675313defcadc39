"""How far bf16 Adam moments stray from fp32 Adam's (precision.moment_dtype: bfloat16), rounded to nearest against
rounded stochastically (`sharding.precision.round_stochastically`, what the optimizer stores), side by side on the
same gradients, and what rounding costs in time on this machine's optimizer update.

Two gradient streams over 1024 elements: (a) steady, ~1 for 3000 updates then ~0.1 for 3000 (b2 = 0.999); (b)
Gaussian gradients of a random size per element (log-normal), 3000 updates. For each: nu / nu_fp32 (mean, and the
5 / 95 % points over the elements) at chosen updates.

    PYTHONPATH=. python scripts/bench_bf16_moments.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from sharding.precision import scale_by_adam

B2 = 0.999


def nu_trace(grads: jax.Array, how: str, marks: tuple[int, ...]) -> dict[int, np.ndarray]:
    """nu after each update in `marks` when stored in fp32, bf16 rounded to nearest, or as the optimizer stores it."""
    if how == "stochastic":
        opt = scale_by_adam(0.9, B2, 1e-8, jnp.bfloat16)

        def body(state, g):
            _, state = opt.update(g, state)
            return state, state.nu.astype(jnp.float32)

        _, nus = jax.lax.scan(body, opt.init(grads[0]), grads)
    else:
        dtype = jnp.float32 if how == "fp32" else jnp.bfloat16

        def body(nu, g):
            nu = (B2 * nu.astype(jnp.float32) + (1 - B2) * g * g).astype(dtype)
            return nu, nu.astype(jnp.float32)

        _, nus = jax.lax.scan(body, jnp.zeros(grads.shape[1], dtype), grads)
    nus = np.asarray(nus)
    return {t: nus[t - 1] for t in marks}


def report(name: str, grads: jax.Array, marks: tuple[int, ...]) -> None:
    exact = nu_trace(grads, "fp32", marks)
    for how in ("nearest", "stochastic"):
        got = nu_trace(grads, how, marks)
        cells = []
        for t in marks:
            r = got[t] / exact[t]
            cells.append(f"{t}: {r.mean():.3f} ({np.percentile(r, 5):.3f}-{np.percentile(r, 95):.3f})")
        print(f"  {name:8s} {how:10s} nu / nu_fp32 at update " + ", ".join(cells))


def update_time(moment_dtype, n: int = 1 << 22, repeats: int = 20) -> float:
    """Median seconds of one scale_by_adam update of n elements (jitted, state donated)."""
    opt = scale_by_adam(0.9, B2, 1e-8, moment_dtype)
    step = jax.jit(opt.update, donate_argnums=1)
    g = jax.random.normal(jax.random.key(0), (n,))
    state = opt.init(g)
    _, state = step(g, state)
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, state = step(g, state)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    n = 1024
    scale = 1.0 + jnp.arange(n, dtype=jnp.float32) / n
    steady = jnp.concatenate([jnp.broadcast_to(scale, (3000, n)), jnp.broadcast_to(0.1 * scale, (3000, n))])
    size = jnp.exp(jax.random.normal(jax.random.key(1), (n,)))
    noisy = jax.random.normal(jax.random.key(2), (3000, n)) * size
    print("bf16 nu against fp32 Adam's (b2 = 0.999), 1024 elements:")
    report("steady", steady, (1000, 3000, 6000))
    report("noisy", noisy, (100, 1000, 3000))
    f32, bf16 = update_time(jnp.float32), update_time(jnp.bfloat16)
    print(f"one update of 4M elements, median of 20: fp32 moments {f32 * 1e3:.2f} ms, bf16 stochastically rounded "
          f"{bf16 * 1e3:.2f} ms ({bf16 / f32:.2f}x)")


if __name__ == "__main__":
    main()
