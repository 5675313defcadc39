"""gpu_check.py check 13: the JAX engine's decode step with the layer stacks scanned (`model.scan_layers`, the
default) against unrolled, on the same weights.

Compiled for an H200 without one (BENCHMARKS.md, session 31), the scanned decode step copies every layer's weights
out of the stacks at each step (34 dynamic slices, the 16 local experts' gate/up alone 1.2 GB a layer: 2.14 GB of
temporaries), where the unrolled one reads them in place (0.055 GB). A decode step is bound by the bytes it reads, so
the copies may cost more than the matmuls; on CPU unrolling did not pay (session 29). This times one step of each
(`--small`: tiny shapes, the CPU smoke test) and checks that both give the same logits.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpu_check_kernels import emit, m3_shaped
from m3jax import M3ForCausalLM


def decode_layers(small: bool, layers: int, experts: int, batch: int, slots: int, iters: int = 5) -> None:
    cfg = m3_shaped(small, layers, experts)
    model = M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    unrolled, _ = nnx.split(nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                                                 scan_layers=False)))
    cache = model.init_cache(batch, slots)
    del model
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, 1)), jnp.int32)
    pos = jnp.full((batch, 1), slots // 2, jnp.int32)  # mid-cache: the step reads the slots up to it (zeros here)
    mask = jnp.ones((batch, slots), jnp.int32)
    out = {}
    for name, gd in (("scanned", graphdef), ("unrolled", unrolled)):
        step = jax.jit(lambda s, c, i, p, m, gd=gd: nnx.merge(gd, s)(i, positions=p, attention_mask=m, cache=c))
        t0 = time.perf_counter()
        compiled = step.lower(state, cache, ids, pos, mask).compile()
        compile_s = time.perf_counter() - t0
        logits, _ = jax.block_until_ready(compiled(state, cache, ids, pos, mask))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(state, cache, ids, pos, mask))
            times.append(time.perf_counter() - t0)
        out[name] = {"step_ms": float(np.median(times)) * 1e3, "compile_s": compile_s,
                     "temp_gb": compiled.memory_analysis().temp_size_in_bytes / 1e9,
                     "logits": np.asarray(logits, np.float32)}
    ref = out["scanned"].pop("logits")
    got = out["unrolled"].pop("logits")
    emit(check="decode_layers", layers=layers, experts=experts, batch=batch, slots=slots, **out,
         unrolled_vs_scanned=out["scanned"]["step_ms"] / out["unrolled"]["step_ms"],
         logits_rel_diff=float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)))
