"""Weight transfer into vLLM engines, end to end, next to a plain host memcpy of the same bytes.

Builds a ~300 MB (fp32) M3 with MoE layers, starts a pool of vLLM engines on CPU from its export, then
pushes new weights several times (trainer params -> HF tensors -> checksummed buckets -> Ray object
store -> every engine's stage + reload_weights) and prints GB/s of model bytes per update, the convert /
send / apply split, and the ratio to np.copyto of a buffer of the same size measured in this run.

    .venv/bin/python scripts/bench_weight_transfer.py [--engines 1 2] [--bucket-mb 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def config():
    from m3jax.tiny import m3_config

    # 2 full-attention layers (vLLM has no CPU sparse path): dense, then MoE with 16 experts
    return m3_config(layers=2, full_attention_layers=2, vocab_size=16384, hidden_size=1024, num_attention_heads=16,
                     num_key_value_heads=4, head_dim=64, intermediate_size=512, dense_intermediate_size=2048,
                     num_local_experts=16, index_head_dim=64, index_block_size=64, max_position_embeddings=256,
                     pad_token_id=0)


def memcpy_gb_per_s(nbytes: int, repeats: int = 5) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / 1e9 / best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    import jax
    import ray
    from flax import nnx

    import m3jax
    from m3jax.tiny import m3_model
    from rl.generation.vllm_pool import PoolConfig, VLLMPool

    cfg = config()
    model = m3_model(cfg, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"model: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f} M params, {nbytes / 1e6:.0f} MB fp32")
    copy = memcpy_gb_per_s(nbytes)
    print(f"host memcpy of {nbytes / 1e6:.0f} MB: {copy:.2f} GB/s")
    params2 = jax.tree.map(lambda x: x * 1.01, params)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model")
        m3jax.save_pretrained(model, path, layout="released")
        for n in a.engines:
            pool = VLLMPool(PoolConfig(model_dir=path, servers=n, max_model_len=256, dtype="float32",
                                       bucket_bytes=a.bucket_mb << 20, request_timeout_s=600), graphdef)
            rows = []
            for i in range(a.repeats):
                s = pool.set_weights(params2 if i % 2 == 0 else params, i + 1, rest)
                rows.append(s)
                print(f"  {n} engine(s) update {i + 1}: {s.total_s:.2f} s = {s.gb_per_s:.2f} GB/s of model bytes "
                      f"(convert {s.convert_s:.2f} s, send+stage {s.send_s:.2f} s, apply {s.apply_s:.2f} s; "
                      f"{s.buckets} buckets)")
            best = max(rows, key=lambda s: s.gb_per_s)
            print(f"{n} engine(s): best {best.gb_per_s:.2f} GB/s per update = {best.gb_per_s / copy:.2f} x memcpy; "
                  f"{best.gb_per_s * n:.2f} GB/s delivered in all = {best.gb_per_s * n / copy:.2f} x memcpy")
            pool.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
