"""Weight transfer into vLLM engines, end to end, next to a plain host memcpy of the same bytes.

Builds a ~300 MB (fp32) M3 with MoE layers (`--large`: 1.03 GB), starts a pool of vLLM engines on CPU
from its export, then pushes new weights several times (trainer params -> HF tensors -> checksummed
buckets -> the transport -> every engine's verify + stage -> commit = apply) and prints GB/s of model
bytes per update, the split sender (convert + pack + CRC, overlapping the wire) / wire (send + every
engine's verify) / apply (commit), and the ratio to np.copyto of a buffer of the same size measured in
this run. Transports: `ray` (Ray object store), `shm` (files under /dev/shm that the engines map,
rl.generation.shared_segments) and `collective` (a gloo group, rl.generation.collective);
apply: `auto` (one copy in place, rl.generation.inplace) or `reload` (vLLM's reload_weights).

    .venv/bin/python scripts/bench_weight_transfer.py [--engines 1 2] [--transport ray shm collective]
        [--apply auto reload] [--large] [--bucket-mb 64] [--repeats 3] [--tensor-parallel 2]
        [--executor ray] [--whole] [--malloc-tuning on off] [--object-store-warmup on off]

Every configuration gets a Ray of its own (started by its pool, shut down after it), so that the object store
is sized and warmed for it as in a run (rl.generation.local_ray).
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def large_config():
    from m3jax.tiny import m3_config

    # 1.03 GB fp32: vocab 32768 x hidden 1536 (embed + lm_head 403 MB), a dense layer (6144 wide), a MoE layer
    # with 32 experts of 768 (467 MB)
    return m3_config(layers=2, full_attention_layers=2, vocab_size=32768, hidden_size=1536, num_attention_heads=24,
                     num_key_value_heads=4, head_dim=64, intermediate_size=768, dense_intermediate_size=6144,
                     num_local_experts=32, index_head_dim=64, index_block_size=64, max_position_embeddings=256,
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
    ap.add_argument("--transport", nargs="+", default=["ray", "collective"], help="generation.weight_transport values")
    ap.add_argument("--apply", nargs="+", default=["auto"], choices=["auto", "reload"],
                    help="engine weight apply: auto (in place where covered) or reload (vLLM reload_weights)")
    ap.add_argument("--malloc-tuning", nargs="+", default=["on"], choices=["on", "off"],
                    help="generation.vllm_malloc_tuning: CPU engines start with rl.generation.host_memory's tunables")
    ap.add_argument("--object-store-warmup", nargs="+", default=["on"], choices=["on", "off"],
                    help="generation.vllm_object_store_warmup: the pool's own Ray fills its store while engines start")
    ap.add_argument("--large", action="store_true", help="a 1.03 GB model instead of 287 MB")
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="ranks per engine: > 1 runs vLLM's mp executor (worker processes, each writes its slice; "
                         "expert parallel over the same ranks), staged under /dev/shm on the ray transport")
    ap.add_argument("--executor", default="auto", choices=["auto", "mp", "ray"],
                    help="generation.vllm_executor; ray: every worker is a rank of the collective path's groups")
    ap.add_argument("--whole", action="store_true",
                    help="collective into Ray-executor workers: send every tensor whole, as before the "
                         "tensor-parallel slices (rl.generation.weight_slices), for an A/B")
    a = ap.parse_args()

    import jax
    import ray
    from flax import nnx

    import m3jax
    from m3jax.tiny import m3_model
    from rl.generation.vllm_pool import PoolConfig, VLLMPool

    if a.whole:  # the receivers still report their slices; the plan drops them, so every group gets whole tensors
        from rl.generation import weight_routes

        plan = weight_routes.plan
        weight_routes.plan = lambda rs: plan([[e["experts"] if isinstance(e, dict) else e for e in r] for r in rs])

    cfg = large_config() if a.large else config()
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
        for n, apply, transport, tuning, warm in ((n, ap_, t, m, w) for n in a.engines for ap_ in a.apply
                                                  for t in a.transport for m in a.malloc_tuning
                                                  for w in a.object_store_warmup):
            pool = VLLMPool(PoolConfig(model_dir=path, servers=n, max_model_len=256, dtype="float32",
                                       bucket_bytes=a.bucket_mb << 20, request_timeout_s=600, transport=transport,
                                       weight_apply=apply, tensor_parallel=a.tensor_parallel,
                                       expert_parallel=a.tensor_parallel, executor=a.executor,
                                       malloc_tuning=tuning == "on", warm_object_store=warm == "on"), graphdef)
            modes = sorted({m for m, _ in ray.get([s.actor.apply_mode.remote() for s in pool.slots])})
            tag = (f"{n} engine(s) of TP {a.tensor_parallel} ({pool.cfg.executor}), {transport}, malloc tuning {tuning}, "
                   f"store warm-up {warm}"
                   f"{' (whole tensors)' if a.whole else ''}, apply {'/'.join(modes)}")
            rows = []
            for i in range(a.repeats):
                s = pool.set_weights(params2 if i % 2 == 0 else params, i + 1, rest)
                rows.append(s)
                print(f"  {tag} update {i + 1}: {s.total_s:.2f} s = {s.gb_per_s:.2f} GB/s of model bytes "
                      f"(sender {s.convert_s:.2f} s, wire {s.send_s:.2f} s, apply {s.apply_s:.2f} s, "
                      f"group setup {s.setup_s:.2f} s; {s.buckets} buckets of {s.bytes / 1e6:.0f} MB"
                      + (f"; into each group: {', '.join(f'{b / 1e6:.0f}' for b in s.route_bytes)} MB"
                         if s.route_bytes else "") + ")", flush=True)
            best = max(rows, key=lambda s: s.gb_per_s)
            median = statistics.median(s.gb_per_s for s in rows[1:] or rows)  # the first update pays once-only costs
            print(f"{tag}: best {best.gb_per_s:.2f} GB/s per update = {best.gb_per_s / copy:.3f} x memcpy; "
                  f"{best.gb_per_s * n:.2f} GB/s delivered in all = {best.gb_per_s * n / copy:.3f} x memcpy; "
                  f"median of updates 2-{len(rows)}: {median / copy:.3f} x memcpy per update", flush=True)
            pool.shutdown()
            ray.shutdown()  # the next configuration's pool starts (and sizes, and warms) a Ray of its own


if __name__ == "__main__":
    main()
