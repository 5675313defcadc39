"""Generation throughput: the vLLM pool (CPU engines in Ray actors) vs the embedded JAX engine, same
model and weights, same prompts and sampling parameters, measured side by side in one run.

    .venv/bin/python scripts/bench_pool_generate.py [--rows 256] [--new 32] [--engines 1 2]

The model is tiny-vllm.yaml's shape by default (`--wide` for a 4x wider one). Both backends run after a
warm-up call (JAX compiles its program once per shape; vLLM builds its engines before timing starts).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def config(wide: bool):
    from m3jax.tiny import m3_config

    h = 256 if wide else 64  # 2 full-attention layers (vLLM has no CPU sparse path): dense, then MoE (4 experts)
    return m3_config(layers=2, full_attention_layers=2, hidden_size=h, num_attention_heads=4 if wide else 2,
                     num_key_value_heads=1, head_dim=64, intermediate_size=h, dense_intermediate_size=2 * h,
                     num_local_experts=4, index_head_dim=16, index_block_size=8, max_position_embeddings=256,
                     pad_token_id=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--wide", action="store_true")
    a = ap.parse_args()

    import jax
    import ray
    from flax import nnx

    import m3jax
    from m3jax.tiny import m3_model
    from rl.generation.base import SamplingParams
    from rl.generation.jax_engine import JaxEngine
    from rl.generation.vllm_pool import PoolConfig, VLLMPool

    cfg = config(a.wide)
    model = m3_model(cfg, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, (a.rows, a.prompt)).tolist()
    sp = SamplingParams(max_new_tokens=a.new, temperature=1.0)  # no stop token: every row decodes a.new tokens
    tokens = a.rows * a.new

    def timed(gen, key):
        gen.generate(prompts, sp, jax.random.key(99))  # warm-up
        t = time.perf_counter()
        r = gen.generate(prompts, sp, key)
        return time.perf_counter() - t, r

    jax_s, _ = timed(JaxEngine(graphdef, params, rest), jax.random.key(0))
    print(f"{a.rows} rows x {a.new} new tokens, prompt {a.prompt}, hidden {cfg.hidden_size}")
    print(f"JAX engine: {jax_s:.2f} s = {tokens / jax_s:.0f} tok/s")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model")
        m3jax.save_pretrained(model, path, layout="released")
        for n in a.engines:
            pool = VLLMPool(PoolConfig(model_dir=path, servers=n, max_model_len=a.prompt + a.new + 8,
                                       dtype="float32"), graphdef)
            s, r = timed(pool, jax.random.key(0))
            assert int(r.lengths.sum()) == tokens
            print(f"vLLM pool, {n} engine(s): {s:.2f} s = {tokens / s:.0f} tok/s; pool / JAX = {jax_s / s:.2f}")
            pool.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
