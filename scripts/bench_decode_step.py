"""One decode step with its cache, as the JAX engine's decode loop runs it, side by side per model.

Each contestant is one jitted `fori_loop` of --steps single-token steps that carries the stacked cache (written
in place, as `rl.generation.jax_engine` carries it): ms per step = the loop's median wall time / --steps. The
cache holds --slots slots of random keys, and the steps sit at its end (positions slots - steps ..), so every
step sees nearly the whole cache; no attention mask, as the engine's decode steps. Contestants:

  auto            the model as built
  sparse grouped  sparse layers forced onto the grouped path: what a decode step ran, before session 29, on a
                  config whose whole sequence runs grouped (`m3jax.model.sparse.one_device_path`)
  full flash      full layers with attention_impl "flash": what "auto" ran over 512 slots or more before
                  session 29 (`m3jax.model.attention.unfused_impl`)

Models: the tiny release-like model (m3jax.tiny's HF reference config: a full layer then 3 sparse MoE layers,
blocks of 8, top-2; up to its 1,024 positions), and scripts/bench_sparse_model.py's 2-layer hidden-512 model
(8 heads of 128, blocks of 64, top-4) all-sparse and all-full.

    .venv/bin/python scripts/bench_decode_step.py
    .venv/bin/python scripts/bench_decode_step.py --slots 1024 4096 --iters 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import bench_sparse_model as bsm  # noqa: E402
from m3jax import tiny  # noqa: E402
from m3jax.model import attention  # noqa: E402


def decode_loop(model, batch: int, slots: int, steps: int):
    """(compiled loop, its arguments): `steps` decode steps at positions slots - steps .. slots - 1."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def run(params, rest, cache):
        m = nnx.merge(graphdef, params, rest)

        def body(t, carry):
            tok, cache = carry
            logits, cache = m(tok, positions=jnp.full((batch, 1), slots - steps, jnp.int32) + t, cache=cache)
            return jnp.argmax(logits, -1).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, steps, body, (jnp.ones((batch, 1), jnp.int32), cache))

    keys = iter(jax.random.split(jax.random.key(1), 64))
    cache = jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, a.dtype), model.init_cache(batch, slots))
    compiled = jax.jit(run).lower(params, rest, cache).compile()
    return compiled, (params, rest, cache)


def contestants(model_name: str):
    """{contestant: (build the model, forced one-device path or None)} for a model."""
    if model_name == "tiny release_like":
        hf = tiny.hf_model(tiny.hf_config("release_like"), seed=0)
        return {"auto": (lambda: tiny.m3_from_hf(hf), None),
                "full flash": (lambda: tiny.m3_from_hf(hf, attention_impl="flash"), None)}
    full = model_name == "bench all-full"
    cfg = tiny.m3_config(full_attention_layers=2 if full else 0, **bsm.DIMS)
    if full:
        return {"auto": (lambda: tiny.m3_model(cfg, seed=0), None),
                "full flash": (lambda: tiny.m3_model(cfg, seed=0, attention_impl="flash"), None)}
    return {"auto": (lambda: tiny.m3_model(cfg, seed=0), None),
            "sparse grouped": (lambda: tiny.m3_model(cfg, seed=0), "grouped")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed loop")
    ap.add_argument("--iters", type=int, default=5, help="timed loops per contestant (round-robin)")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.default_backend()}, load {os.getloadavg()[0]:.1f}")
    print("| model | batch | slots | contestant | ms per step | vs auto |")
    print("|---|---|---|---|---|---|")
    real = attention.one_device_path
    for model_name, batch in (("tiny release_like", 16), ("bench all-sparse", 8), ("bench all-full", 8)):
        for slots in args.slots:
            if model_name == "tiny release_like" and slots > tiny.HF_TINY["max_position_embeddings"]:
                continue  # past the tiny config's positions
            runs = {}
            for name, (build, path) in contestants(model_name).items():
                if path:  # read at trace time
                    attention.one_device_path = lambda *a, path=path: path
                try:
                    runs[name] = decode_loop(build(), batch, slots, args.steps)
                finally:
                    attention.one_device_path = real
                jax.block_until_ready(runs[name][0](*runs[name][1]))  # warm
            times = {name: [] for name in runs}
            for _ in range(args.iters):
                for name, (compiled, call_args) in runs.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(compiled(*call_args))
                    times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
            base = statistics.median(times["auto"])
            for name, ts in times.items():
                med = statistics.median(ts)
                print(f"| {model_name} | {batch} | {slots} | {name} | {med:.2f} | {med / base:.2f}x |")
    print(f"load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
