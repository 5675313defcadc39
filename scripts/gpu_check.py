"""One script for a lent GPU: correctness smoke + MFU of an M3-shaped train step + MoE grouped-matmul cost
(check 8, the vLLM engine, is scripts/gpu_check_vllm.py, which this runs).

    python scripts/gpu_check.py                 # on the GPU machine (about 3-6 minutes)
    python scripts/gpu_check.py --small         # CPU smoke test of the script itself
    python scripts/gpu_check.py --skip mesh & python scripts/gpu_check.py --only mesh   # check 11 beside the rest

The checks run in the order of need (the kernel choices first, the figures already taken last), each guarded: one
that fails prints its error and the next runs. On the GPU machine the image's own jax runs it (0.11.2 in session 25)
with PYTHONPATH at the repository root; check 11 needs no GPU (`gpu_check_mesh.py --target-config`), so a lent
machine's call can be

    export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.8
    timeout 480 python3 scripts/gpu_check.py --skip mesh 2>&1 | tee $OUT/gpu_check.log

Before one is lent, `scripts/gpu_compile.py` compiles these programs for an H200 on the CPU machine: a program XLA's
GPU compiler refuses shows there.

Prints one JSON line per check; keep the output with BENCHMARKS.md. Checks:
1. devices and versions;
2. parity: the tiny model's logits on the accelerator vs on the CPU (same params), fp32;
3. model attention: the model's full layer on cuDNN (`attention_impl: cudnn`, what `auto` now runs on a GPU)
   against dense and flash, bf16, logits and gradient, the fallback poisoned so the numbers prove cuDNN ran;
   and the sparse layers' forward on the paged kernel (`sparse_attention: paged`) against gather's, likewise;
   MFU: a jitted train step (bf16 + compact master + bf16 moments, remat) of an M3-shaped model at the
   real widths (d 6144, 64 heads x 128, 4 KV heads, experts of 3072) with few layers and experts so it
   fills one GPU; MFU = model FLOPs (m3jax.plan.flops.step_flops) / (step time x peak FLOP/s);
3b. layer costs: one decoder layer of each kind (full / flash / sparse attention, dense MLP / MoE on ragged_dot / on
   tiled) at the MFU check's widths, forward and forward+backward, to split the step's time by layer kind (the
   first GPU run's step took 18 s, 0.18 s at the plan's 40 % MFU: BENCHMARKS.md, session 25);
4. MoE: grouped expert matmuls (ragged_dot) vs every expert on every token, same routing, timed;
5. MoE kernels: `model.moe_kernel` ragged_dot vs tiled vs pallas (sharding.pallas_grouped) on an expert-parallel receive pool mostly padding
   (1 local expert with a 32x pool, M3's 32-node layout; 4 local experts with a 16x pool), bf16, forward and
   forward+backward: the figure `auto`'s GPU choice (ragged_dot until measured) waits for;
6. attention kernels at one M3 layer's shapes (64 query heads, 4 KV heads x 128, bf16, causal): the dense
   path (`attention_impl: dense`), `flash` (m3jax.model.flash), cuDNN through `jax.nn.dot_product_attention`
   for the full layer; for a sparse layer (the indexer's top-16 shape, ids replayed): the masked dense path,
   masked flash, and `model.sparse_attention: gather`'s three implementations (m3jax.model.sparse: per-tile
   gathers, the meshes' path; grouped matmuls and gathered slots, one device's, picked by shape): forward and forward+backward times, each
   output against the dense (masked) path's; at 1,024 and 8,192 keys (whether `attention_impl: auto`, flash
   from 512 keys as measured on CPU, should switch elsewhere on a GPU);
7. the LM head: token logprobs and their gradient from full [T, 200064] logits vs `model.logprob_chunk_tokens`
   blocks (rl.logprobs.chunked_token_logprobs), times and the largest difference: what chunking costs in time;
8. vLLM long context: the pool's GPU vLLM engine on an M3-shaped tiny model with sparse layers at vLLM's kernel
   shapes (head_dim 128, 128-token blocks, top-4) over a 2,304-token prompt + 256 greedy tokens (> 2,048: the
   indexer keeps 4 of up to 20 blocks): generated (decode) and scored (prefill) logprobs against the trainer's
   (JAX, fp32, same bf16-rounded weights). The engine runs in a child process (JAX holds most of the GPU); the
   check says why it is skipped without vllm or a CUDA device. `selection_effect` (CPU side, run by --small):
   how far the logprobs move when every block is selected, the scale of a wrong block choice. The engine
   also returns its MoE routes (issue 14 item 1): `routes` gives moe/route_mismatch_frac of the trainer's own
   routes against vLLM's, and the generator-vs-trainer logprob gap without and with vLLM's routes replayed.
   `push` (issue 12 item 3 on CUDA): a weight update of other weights (B: the same shapes, seed 1) written by the engine
   (in place where `weight_apply` says so, else vLLM's reload_weights), then A again: B's scored logprobs
   against the trainer's B, A's again bit for bit against the first score, and the seconds each apply took.
9. the collective weight path's device checksum (rl.generation.word_checksum, what an NCCL group's buckets are
   checked with): equal on the GPU and on the CPU for the same bytes (its sums wrap mod 2^64 on both), a flipped
   byte caught on the GPU, and its GB/s over a 1 GiB bucket of spans (XXH3 on one host core beside it);
10. a weight push on the device through a loopback wire (one GPU cannot hold an NCCL group): JAX arrays packed
   into CUDA buckets by DLPack, checksummed, received, verified and staged on the device and through the host
   ring, bit for bit against the source, with its seconds. Checks 9 and 10 are scripts/gpu_check_push.py.
11. the 32-node recipe's weight layouts compiled by the GPU compiler for 2 nodes x 8 GPUs (compile-only devices of
   `jax.experimental.topologies`; nothing runs): XLA's memory beside the planner's, and where the step's
   collectives run, with and without the step copy of the weights (`mesh.fsdp_step_axes`);
   scripts/gpu_check_mesh.py, last (minutes of compiling).
   `--only mesh` runs it alone.
12. the KL reference's weights brought from pinned host memory (`grpo.reference_memory: host`, rl.reference): the
   GB/s the planner assumes for PCIe (50), measured on a 4 GB bf16 tree, bit for bit; scripts/gpu_check_reference.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import flax
import numpy as np
from flax import nnx

from m3jax import M3Config, M3ForCausalLM
from m3jax.model.mlp import swiglu_oai
from m3jax.model.moe import grouped_experts, route
from sharding import optim_step
from sharding.expert import local_experts
from m3jax.plan.flops import step_flops
from sharding.train_step import init_state, make_train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_mesh import mesh_compile  # noqa: E402 - check 11
from gpu_check_push import device_checksum, weight_push_device  # noqa: E402 - checks 9 and 10
from gpu_check_reference import host_reference  # noqa: E402 - check 12
from gpu_check_vllm import vllm_long_context  # noqa: E402 - check 8, a module of its own beside this script


def emit(**kw):
    print(json.dumps(kw), flush=True)


def timed(fn, *args, iters=5):
    out = fn(*args)
    jax.block_until_ready(out)
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        t.append(time.perf_counter() - t0)
    return float(np.median(t)), out


def m3_shaped(small: bool, layers: int, experts: int) -> M3Config:
    if small:
        d, h, kv, hd, i, di, v = 128, 4, 2, 32, 64, 256, 512
    else:
        d, h, kv, hd, i, di, v = 6144, 64, 4, 128, 3072, 12288, 200064
    return M3Config(vocab_size=v, hidden_size=d, num_hidden_layers=layers, num_attention_heads=h,
                    num_key_value_heads=kv, head_dim=hd, intermediate_size=i, dense_intermediate_size=di,
                    shared_intermediate_size=i, num_local_experts=experts, num_experts_per_tok=4,
                    partial_rotary_factor=0.5, layer_types=("full_attention",) + ("minimax_m3_sparse",) * (layers - 1),
                    mlp_layer_types=("dense",) + ("sparse",) * (layers - 1), index_n_heads=kv,
                    index_head_dim=hd, index_block_size=128 if not small else 16, index_topk_blocks=16 if not small else 2)


def parity(small: bool):
    cfg = m3_shaped(True, 2, 8)
    model = M3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 128)), jnp.int32)
    acc = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = np.asarray(jax.jit(lambda m, x: m(x))(jax.device_put(model, cpu), jax.device_put(ids, cpu)))
    emit(check="parity_accelerator_vs_cpu", rel_err=float(np.abs(acc - ref).max() / np.abs(ref).max()))


RECIPE_OPTIONS = {"attention_impl": "flash", "sparse_attention": "gather", "moe_kernel": "tiled",
                  "remat_policy": "save_dots_experts"}  # configs/recipes/m3-32node.yaml's model options


def mfu(small: bool, layers: int, experts: int, seq: int, batch: int, peak: float, options: dict | None = None,
        steps: int = 3):
    """The train step's MFU with the model `options` (None: every option at its default, "auto")."""
    options = dict(options or {})
    cfg = m3_shaped(small, layers, experts)
    model = M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), remat=True, **options)
    opt = optim_step.adamw(1e-5, moment_dtype=jnp.bfloat16, master="compact")
    graphdef, state = init_state(model, opt)
    del model
    step = make_train_step(graphdef, opt)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, batch, seq + 1)).astype(np.int32)
    data = {"input_ids": jnp.asarray(ids[..., :-1]), "targets": jnp.asarray(ids[..., 1:]),
            "loss_mask": jnp.ones((1, batch, seq), jnp.float32)}
    t0 = time.perf_counter()
    state, m = step(state, data)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, data)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    f = step_flops(cfg, batch, seq, remat=True, attention=options.get("attention_impl", "auto"),
                   sparse_attention=options.get("sparse_attention", "gather"),
                   remat_policy=options.get("remat_policy", "full"),
                   expert_matmul="tiled" if options.get("moe_kernel") == "tiled" else "ragged_dot")
    t = float(np.median(times))
    emit(check="train_step_mfu", options=options or "auto", layers=layers, experts=experts, seq=seq, batch=batch,
         step_s=t, steps_s=times,
         compile_s=compile_s, model_tflops=f["model_total"] / 1e12, executed_tflops=f["executed_total"] / 1e12,
         mfu=f["model_total"] / t / peak, hfu=f["executed_total"] / t / peak, loss=float(m["loss"]),
         params=sum(x.size for x in jax.tree.leaves(state.params)))


def model_attention(small: bool, seq: int, impls=("dense", "flash", "cudnn"), paged: bool = True):
    """The model's full layer on cuDNN (`attention_impl: cudnn`, m3jax.model.fused_attention) against the same
    bf16 model on `dense` and `flash`: logits (right padding in one row) and the gradient of a loss, each timed.
    The cudnn model's fallback is poisoned (NaN), so finite numbers prove the fused branch ran. `impls` and
    `paged` narrow it (its test's fallback case needs only cudnn: each model's compile is ~5 s on CPU)."""
    from m3jax.model import attention, fused_attention
    if fused_attention.implementation() is None:
        return emit(check="model_attention", skipped=f"no GPU: backend {jax.default_backend()} has no cuDNN")
    cfg = m3_shaped(True, 2, 8)  # head_dim 32: within cuDNN's constraints; one full layer, one sparse
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, seq)), jnp.int32)
    mask = jnp.ones((2, seq), jnp.int32).at[1, seq * 3 // 4:].set(0)
    real = np.asarray(mask, bool)
    res, ref = {}, None
    poisoned = lambda q, *args: jnp.full_like(q, jnp.nan)  # noqa: E731
    for impl in impls:
        model = M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention_impl=impl)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, graphdef=graphdef, rest=rest):
            logits = nnx.merge(graphdef, params, rest)(ids, attention_mask=mask).astype(jnp.float32)
            return jnp.sum(jnp.where(real[..., None], jax.nn.log_softmax(logits), 0.0)) / real.sum(), logits

        real_unfused, attention._unfused = attention._unfused, (poisoned if impl == "cudnn" else attention._unfused)
        try:
            t, ((_, logits), grads) = timed(jax.jit(jax.value_and_grad(loss, has_aux=True)), params)
        except Exception as e:  # noqa: BLE001 (a kernel cuDNN refuses: say so, keep going)
            res[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        finally:
            attention._unfused = real_unfused
        logits = np.asarray(logits)[real]
        g = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(grads)])
        ref = (logits, g) if impl == "dense" else ref
        res[impl] = {"fwd_bwd_ms": t * 1e3, "finite": bool(np.isfinite(logits).all() and np.isfinite(g).all())}
        if impl != "dense" and ref is not None:
            # max and mean: in bf16 a router near-tie that flips between two kernels moves a few positions a lot
            res[impl]["logits_rel_err"] = float(np.abs(logits - ref[0]).max() / np.abs(ref[0]).max())
            res[impl]["logits_mean_rel_err"] = float(np.abs(logits - ref[0]).mean() / np.abs(ref[0]).mean())
            res[impl]["grad_rel_err"] = float(np.abs(g - ref[1]).max() / np.abs(ref[1]).max())
    if paged:
        res["paged"] = _paged_model_forward(cfg, ids, mask, real, poisoned)
    emit(check="model_attention", seq=seq, **res)


def _paged_model_forward(cfg, ids, mask, real, poisoned) -> dict:
    """The sparse layers' forward on the paged kernel (`sparse_attention: paged`; only passes without a gradient
    use it) against gather's, gather poisoned in the paged model so finite logits prove the kernel ran."""
    from m3jax.model import attention, paged_sparse
    out = {}
    for impl in ("gather", "paged"):
        model = M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention_impl="flash", sparse_attention=impl)
        real_paged = attention.paged_sparse_attention
        if impl == "paged":
            attention.paged_sparse_attention = lambda *a, gather: real_paged(*a, gather=poisoned)
        try:
            t, logits = timed(jax.jit(lambda m: m(ids, attention_mask=mask)), model)
            out[impl] = (t, np.asarray(logits.astype(jnp.float32))[real])
        except Exception as e:  # noqa: BLE001 (the kernel's first run on a GPU: say so, keep going)
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        finally:
            attention.paged_sparse_attention = real_paged
    (tg, want), (tp, got) = out["gather"], out["paged"]
    return {"fwd_ms": {"gather": tg * 1e3, "paged": tp * 1e3}, "finite": bool(np.isfinite(got).all()),
            # max and mean, as above: a router near-tie that flips in bf16 moves a few positions a lot
            "logits_rel_err_vs_gather": float(np.abs(got - want).max() / np.abs(want).max()),
            "logits_mean_rel_err_vs_gather": float(np.abs(got - want).mean() / np.abs(want).mean())}


LAYER_VARIANTS = (  # (name, attention kind, MLP kind, model options): one layer each, to split the step's time
    ("full+dense", "full_attention", "dense", {}),
    ("full_flash+dense", "full_attention", "dense", {"attention_impl": "flash"}),
    ("sparse+dense", "minimax_m3_sparse", "dense", {}),
    ("full+moe_ragged_dot", "full_attention", "sparse", {"moe_kernel": "ragged_dot"}),
    ("full+moe_tiled", "full_attention", "sparse", {"moe_kernel": "tiled"}),
)


def layer_costs(small: bool, seq: int, experts: int, variants=LAYER_VARIANTS):
    """Check 3b: one decoder layer of each kind at the MFU check's widths, forward and forward+backward of its
    hidden states (no LM head; bf16, no remat), so the train step's time can be split by layer kind: subtract
    full+dense from a variant for the cost of its sparse attention (indexer included) or its MoE (router, dispatch
    and the expert kernel named)."""
    import dataclasses
    res = {}
    for name, attn, mlp, options in variants:
        cfg = dataclasses.replace(m3_shaped(small, 1, experts), vocab_size=1024, layer_types=(attn,),
                                  mlp_layer_types=(mlp,))
        try:
            model = M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), remat=False, **options)
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            ids = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (1, seq)), jnp.int32)
            cot = jax.random.normal(jax.random.key(5), (1, seq, cfg.hidden_size), jnp.bfloat16)

            def hidden(params, graphdef=graphdef, rest=rest):
                return nnx.merge(graphdef, params, rest)(ids, hidden=True)

            tf, h = timed(jax.jit(hidden), params)
            tb, _ = timed(jax.jit(jax.grad(lambda p: jnp.sum((hidden(p) * cot).astype(jnp.float32)))), params)
            res[name] = {"fwd_ms": tf * 1e3, "fwd_bwd_ms": tb * 1e3, "finite": bool(jnp.isfinite(h).all())}
        except Exception as e:  # noqa: BLE001 - one variant's failure must not hide the others' figures
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    emit(check="layer_costs", seq=seq, experts=experts, **res)


def moe_cost(small: bool, experts: int, tokens: int):
    d, i = (128, 64) if small else (6144, 3072)
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (tokens, d), jnp.bfloat16)
    router = jax.random.normal(k[1], (experts, d), jnp.float32) / d ** 0.5
    gate_up = (jax.random.normal(k[2], (experts, 2, i, d), jnp.bfloat16) / d ** 0.5)
    down = (jax.random.normal(k[3], (experts, d, i), jnp.bfloat16) / i ** 0.5)
    w, idx = route(x, router, jnp.zeros(experts), top_k=4)
    # the weights are arguments: closed over, XLA would fold them into the program as constants (7.25 GB at 64
    # experts: minutes of compiling)
    grouped = jax.jit(lambda x, w, idx, gate_up, down: local_experts(
        x, w, idx, lambda rows, sizes: grouped_experts(rows, sizes, gate_up, down, alpha=1.702, limit=7.0), experts))

    @jax.jit
    def dense(x, w, idx, gate_up, down):
        gu = jnp.einsum("td,ecid->teci", x, gate_up)
        act = swiglu_oai(gu[:, :, 0], gu[:, :, 1], 1.702, 7.0)
        out = jnp.einsum("tei,edi->ted", act, down)
        weight = jnp.zeros((x.shape[0], experts), jnp.float32).at[jnp.arange(x.shape[0])[:, None], idx].set(w)
        return jnp.einsum("ted,te->td", out.astype(jnp.float32), weight).astype(x.dtype)

    tg, a = timed(grouped, x, w, idx, gate_up, down)
    td, b = timed(dense, x, w, idx, gate_up, down)
    err = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max() / jnp.abs(b.astype(jnp.float32)).max())
    emit(check="moe_grouped_vs_dense", experts=experts, tokens=tokens, grouped_ms=tg * 1e3, dense_ms=td * 1e3,
         dense_over_grouped=td / tg, rel_err=err)


def moe_kernels(small: bool, experts: int, pool: int, real_rows: int):
    d, i = (128, 64) if small else (6144, 3072)
    k = jax.random.split(jax.random.key(1), 4)
    n = pool * real_rows
    rows = jnp.zeros((n, d), jnp.bfloat16).at[:real_rows].set(jax.random.normal(k[0], (real_rows, d), jnp.bfloat16))
    sizes = jnp.full((experts,), real_rows // experts, jnp.int32).at[0].add(real_rows % experts)
    gate_up = jax.random.normal(k[1], (experts, 2, i, d), jnp.bfloat16) / d ** 0.5
    down = jax.random.normal(k[2], (experts, d, i), jnp.bfloat16) / i ** 0.5
    cot = jax.random.normal(k[3], (n, d), jnp.bfloat16)
    out, errors = {}, {}
    for kernel in ("ragged_dot", "tiled", "pallas"):
        f = lambda r, gu, dn, kernel=kernel: grouped_experts(r, sizes, gu, dn, alpha=1.702, limit=7.0,  # noqa: E731
                                                             kernel=kernel)
        fwd = jax.jit(f)
        bwd = jax.jit(jax.grad(lambda r, gu, dn: jnp.sum((f(r, gu, dn) * cot).astype(jnp.float32)), argnums=(0, 1, 2)))
        try:  # pallas: its first run on a GPU; a failure must not lose the other kernels' figures
            out[kernel] = (*timed(fwd, rows, gate_up, down), *timed(bwd, rows, gate_up, down))
        except Exception as e:  # noqa: BLE001
            errors[kernel] = f"{type(e).__name__}: {str(e)[:300]}"
    rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()  # noqa: E731
                             / jnp.abs(b.astype(jnp.float32)).max())
    _, y_r, _, g_r = out["ragged_dot"]
    emit(check="moe_kernels", experts=experts, pool_x=pool, real_rows=real_rows, rows=n,
         fwd_ms={k: v[0] * 1e3 for k, v in out.items()}, fwd_bwd_ms={k: v[2] * 1e3 for k, v in out.items()},
         value_rel_err={k: rel(v[1], y_r) for k, v in out.items() if k != "ragged_dot"},
         grad_rel_err={k: [rel(a, b) for a, b in zip(v[3], g_r)] for k, v in out.items() if k != "ragged_dot"},
         errors=errors)


def attention_kernels(small: bool, seq: int, skip: tuple = ()):
    from types import SimpleNamespace

    from m3jax.model.attention import _from_chunks, _to_chunks, causal_keep, gqa_attention
    from m3jax.model.flash import flash_attention
    from m3jax.model.indexer import block_ids_to_mask, block_mask_to_tokens
    from m3jax.model.paged_sparse import paged_sparse_attention
    from m3jax.model.sparse import head_units, sparse_layer_attention
    b, h, kv, hd, bs, topk = (1, 4, 2, 32, 16, 2) if small else (1, 64, 4, 128, 128, 16)
    k = jax.random.split(jax.random.key(2), 4)
    q, kk, v = (jax.random.normal(k[i], (b, seq, n, hd), jnp.bfloat16) for i, n in ((0, h), (1, kv), (2, kv)))
    do = jax.random.normal(k[3], (b, seq, h, hd), jnp.bfloat16)
    scale = hd ** -0.5
    pos = jnp.broadcast_to(jnp.arange(seq), (b, seq))
    nb = seq // bs  # the indexer's selection shape: each query block's own block + topk - 1 random earlier ones
    qb = jnp.arange(nb)
    noise = jax.random.uniform(jax.random.key(3), (b, kv, nb, nb))
    noise = jnp.where(qb[None, None, None, :] > qb[:, None], -jnp.inf, noise)
    noise = jnp.where(qb[None, None, None, :] == qb[:, None], jnp.inf, noise)
    top, ids = jax.lax.top_k(noise, topk)
    ids = jnp.repeat(jnp.where(top > -jnp.inf, ids, -1), bs, axis=2)  # [B, KV, S, topk], a row per query
    block_mask = block_ids_to_mask(ids, nb)  # [B, KV, S, nb]
    sparse_cfg = SimpleNamespace(index_block_size=bs, index_topk_blocks=topk, index_local_blocks=1, head_dim=hd)

    def sparse(path):
        return lambda q, k, v: sparse_layer_attention(
            q, k, v, pos, None, None, None, sparse_cfg, to_chunks=_to_chunks, from_chunks=_from_chunks,
            block_ids=jnp.moveaxis(ids, 1, 2), path=path)

    kernels = {
        "dense": lambda q, k, v: gqa_attention(q, k, v, causal_keep(pos, None, seq), scale),
        "flash": lambda q, k, v: flash_attention(q, k, v, scale=scale, positions=pos),
        "dense_sparse": lambda q, k, v: gqa_attention(
            q, k, v, causal_keep(pos, None, seq) & block_mask_to_tokens(block_mask, bs, seq, h), scale),
        "flash_sparse": lambda q, k, v: flash_attention(q, k, v, scale=scale, positions=pos, block_mask=block_mask,
                                                        block_size=bs, k_tile=bs),
        "gathered_sparse": sparse("tiles"),
        "grouped_sparse": sparse("grouped"),
        "slots_sparse": sparse("slots"),
        # the paged kernel's forward (`sparse_attention: paged`); its gradient is gather's by construction
        "paged_sparse": lambda q, k, v: paged_sparse_attention(
            q, k, v, pos, None, jnp.moveaxis(ids, 1, 2), sparse_cfg, *head_units(h, kv, kv),
            gather=lambda q, k, v, block_ids, positions, key_valid: sparse_layer_attention(
                q, k, v, positions, key_valid, None, None, sparse_cfg, to_chunks=_to_chunks, from_chunks=_from_chunks,
                block_ids=block_ids, path="tiles")),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                              implementation="cudnn"),
    }
    res, ref, ref_sparse = {}, None, None
    for name, f in kernels.items():
        if name in skip:
            res[name] = {"skipped": "left out at this length"}
            continue
        try:
            fwd = jax.jit(f)
            bwd = jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum((f(q, k, v) * do).astype(jnp.float32)), argnums=(0, 1, 2)))
            tf, out = timed(fwd, q, kk, v)
            tb, _ = timed(bwd, q, kk, v)
        except Exception as e:  # cuDNN off a GPU, or a shape its constraints refuse: say so, keep going
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        out = out.astype(jnp.float32)
        ref = out if name == "dense" else ref
        ref_sparse = out if name == "dense_sparse" else ref_sparse
        res[name] = {"fwd_ms": tf * 1e3, "fwd_bwd_ms": tb * 1e3}
        against = ref_sparse if "sparse" in name else ref
        if name not in ("dense", "dense_sparse") and against is not None:
            res[name]["rel_err_vs_dense"] = float(jnp.abs(out - against).max() / jnp.abs(against).max())
    emit(check="attention_kernels", seq=seq, heads=h, kv_heads=kv, head_dim=hd, block_size=bs, **res)


def logprob_head(small: bool, tokens: int, chunk: int):
    from rl.generation.base import token_logprobs
    from rl.logprobs import chunked_token_logprobs
    from m3jax.model.decoder import lm_head_logits
    d, vocab = (64, 4096) if small else (6144, 200064)
    k = jax.random.split(jax.random.key(4), 3)
    hidden = jax.random.normal(k[0], (1, tokens, d), jnp.bfloat16)
    head = (jax.random.normal(k[1], (vocab, d), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
    targets = jax.random.randint(k[2], (1, tokens), 0, vocab)
    full = lambda h, w: token_logprobs(lm_head_logits(h, w), targets, 1.0)  # noqa: E731
    chunked = lambda h, w: chunked_token_logprobs(h, w, targets, 1.0, chunk_tokens=chunk)  # noqa: E731
    out = {}
    for name, f in (("full", full), ("chunked", chunked)):
        tf, lp = timed(jax.jit(f), hidden, head)
        tb, _ = timed(jax.jit(jax.grad(lambda h, w, f=f: jnp.sum(f(h, w)), argnums=(0, 1))), hidden, head)
        out[name] = (tf, tb, lp)
    emit(check="logprob_head", tokens=tokens, vocab=vocab, chunk_tokens=chunk,
         fwd_ms={n: v[0] * 1e3 for n, v in out.items()}, fwd_bwd_ms={n: v[1] * 1e3 for n, v in out.items()},
         max_abs_diff=float(jnp.abs(out["full"][2] - out["chunked"][2]).max()))


def guarded(check: str, fn, *args, **kw):
    """Run one check; a failure (a kernel this jax or device refuses) is reported and the next check still runs:
    a lent GPU's minutes are too few to lose the other figures to one check's error."""
    try:
        out = fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        return emit(check=check, error=f"{type(e).__name__}: {str(e)[:800]}")
    if isinstance(out, dict):
        emit(**out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device (H100/H200)")
    ap.add_argument("--only", choices=("vllm", "mesh"), help="run only this check")
    ap.add_argument("--skip", choices=("mesh",), action="append", default=[],
                    help="leave this check out (e.g. to run `--only mesh` beside the rest in another process)")
    args = ap.parse_args()
    emit(check="devices", backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
         jax=jax.__version__, flax=flax.__version__)
    if args.only == "vllm":
        return guarded("vllm_long_context", vllm_long_context)
    if args.only == "mesh":
        return guarded("mesh_compile", mesh_compile, args.small)
    small = args.small
    peak = args.peak_tflops * 1e12
    guarded("parity_accelerator_vs_cpu", parity, small)
    # the order is the order of need: a lent GPU's minutes may end (or the machine be taken back) mid-run
    if small:
        checks = [("moe_kernels", moe_kernels, True, 1, 32, 256), ("layer_costs", layer_costs, True, 128, 8),
                  ("attention_kernels", attention_kernels, True, 256), ("logprob_head", logprob_head, True, 256, 64),
                  ("train_step_mfu", mfu, True, 2, 8, 64, 2, peak, RECIPE_OPTIONS),
                  ("model_attention", model_attention, True, 128), ("moe_grouped_vs_dense", moe_cost, True, 8, 256)]
    else:
        checks = [("moe_kernels", moe_kernels, False, 1, 32, 4096), ("moe_kernels", moe_kernels, False, 4, 16, 4096),
                  ("layer_costs", layer_costs, False, 4096, 16)]
        # 1024: near `attention_impl: auto`'s CPU-measured switch to flash (512 keys)
        # the grouped path only at 1,024: at 8,192 its walk is ~65,000 launch-bound loop steps a call (session 25)
        checks += [("attention_kernels", attention_kernels, False, 1024),
                   ("attention_kernels", attention_kernels, False, 8192, ("grouped_sparse",))]
        checks += [("logprob_head", logprob_head, False, 8192, 1024),
                   ("train_step_mfu", mfu, False, 4, 16, 4096, 1, peak, RECIPE_OPTIONS, 2)]
    checks += [("device_checksum", device_checksum, small), ("host_reference", host_reference, small),
               ("weight_push_device", weight_push_device, small), ("vllm_long_context", vllm_long_context)]
    if not small:  # measured in session 25 (BENCHMARKS.md): last, for a longer lease
        checks += [("train_step_mfu", mfu, False, 4, 16, 4096, 1, peak, None, 2),
                   ("model_attention", model_attention, False, 2048)]
        checks += [("moe_grouped_vs_dense", moe_cost, False, e, 8192) for e in (16, 64)]
    if "mesh" not in args.skip:
        checks += [("mesh_compile", mesh_compile, small) if small else ("mesh_compile", mesh_compile, False, 420)]
    for name, fn, *fn_args in checks:
        guarded(name, fn, *fn_args)


if __name__ == "__main__":
    main()
