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
5. MoE kernels: `model.moe_kernel` ragged_dot vs tiled (its default 128-row tile, and 512) vs bucketed vs pallas
   (sharding.pallas_grouped) vs mosaic (jax's Mosaic GPU kernels, sharding.mosaic_grouped: Hopper only) on an
   expert-parallel receive pool mostly padding
   (1 local expert with a 32x pool, M3's 32-node layout; 4 local experts with a 16x pool, a multinomial load around
   the balanced one), bf16, forward and
   forward+backward;
5b. the trainer's own timing of those kernels (`moe_kernel: auto` off a CPU, m3jax/model/expert_tuning.py) on the
   MFU slice's expert MLP (16 experts, 4,096 tokens x top-4 on one device): the kernel it picks, each kernel's
   time, and the seconds the timing adds to a run's start (compiles included);
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
13. the JAX engine's decode step (M3-width slice: 4 layers, 16 experts, batch 8, 4,096 cache slots, bf16) with the
   layer stacks scanned (the default) and unrolled, same weights: step times, temporaries, logits against each
   other. Compiled for an H200 without one, the scanned step copies every layer's weights out of the stacks each
   step (2.14 GB of temporaries against 0.055 GB unrolled, BENCHMARKS.md session 31); scripts/gpu_check_decode.py.
14. the HF checkpoint's load onto the device (`m3jax.from_pretrained`'s block reads, session 32): a bf16 model at
   M3 widths (2 layers, 16 experts: 7.3 GB) exported and read back from a warm page cache: seconds, GB/s, and the
   logits bit for bit against the exported model's.
Checks 3b to 7 (5b included) live in scripts/gpu_check_kernels.py (with the helpers every check shares), 2, 3 and the driver here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import flax
import numpy as np
from flax import nnx

from m3jax import M3ForCausalLM
from sharding import optim_step
from m3jax.plan.flops import step_flops
from sharding.train_step import init_state, make_train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_decode import decode_layers  # noqa: E402 - check 13
from gpu_check_mesh import mesh_compile  # noqa: E402 - check 11
from gpu_check_push import device_checksum, weight_push_device  # noqa: E402 - checks 9 and 10
from gpu_check_reference import host_reference  # noqa: E402 - check 12
from gpu_check_vllm import vllm_long_context  # noqa: E402 - check 8, a module of its own beside this script
from gpu_check_kernels import (LAYER_VARIANTS, attention_kernels, emit, layer_costs,  # noqa: E402,F401 - checks 3b-7
                               logprob_head, m3_shaped, moe_cost, moe_kernel_timing, moe_kernels, timed)



def parity(small: bool):
    cfg = m3_shaped(True, 2, 8)
    model = M3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 128)), jnp.int32)
    acc = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = np.asarray(jax.jit(lambda m, x: m(x))(jax.device_put(model, cpu), jax.device_put(ids, cpu)))
    emit(check="parity_accelerator_vs_cpu", rel_err=float(np.abs(acc - ref).max() / np.abs(ref).max()))


def load_round_trip(small: bool):
    """A bf16 model (M3 widths, 2 layers, 16 experts: 7.3 GB) exported (`save_pretrained`) and read back onto the
    device (`from_pretrained`: its block reads and device puts): the load's seconds and GB/s from a warm page
    cache, and whether the logits equal the exported model's."""
    import tempfile

    import m3jax
    model = M3ForCausalLM(m3_shaped(small, 2, 8 if small else 16), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (1, 128)), jnp.int32)
    logits = np.asarray(jax.jit(lambda m, x: m(x))(model, ids).astype(jnp.float32))
    with tempfile.TemporaryDirectory() as d:
        m3jax.save_pretrained(model, d, max_shard_size="1GB")
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
        for f in os.listdir(d):  # the page cache warm: the figure is the loader's, not the disk's
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 26):
                    pass
        t0 = time.perf_counter()
        del model  # the device holds one copy at a time
        loaded = m3jax.from_pretrained(d)
        jax.block_until_ready(nnx.state(loaded))
        seconds = time.perf_counter() - t0
    again = np.asarray(jax.jit(lambda m, x: m(x))(loaded, ids).astype(jnp.float32))
    emit(check="load_round_trip", bytes=nbytes, seconds=round(seconds, 3), gb_per_s=round(nbytes / seconds / 1e9, 2),
         logits_equal=bool(np.array_equal(again, logits)), device=str(jax.tree.leaves(nnx.state(loaded))[0].devices()))


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
    from m3jax.model import attention
    out = {}
    for impl in ("gather", "paged"):
        model = M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention_impl="flash", sparse_attention=impl)
        real_paged = attention.paged_sparse_attention
        if impl == "paged":
            attention.paged_sparse_attention = lambda *a, gather, **kw: real_paged(*a, gather=poisoned, **kw)
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
        checks = [("moe_kernels", moe_kernels, True, 1, 32, 256), ("moe_kernel_timing", moe_kernel_timing, True, 4, 64),
                  ("layer_costs", layer_costs, True, 128, 8),
                  ("attention_kernels", attention_kernels, True, 256), ("logprob_head", logprob_head, True, 256, 64),
                  ("train_step_mfu", mfu, True, 2, 8, 64, 2, peak, RECIPE_OPTIONS),
                  ("decode_layers", decode_layers, True, 4, 8, 4, 256),
                  ("model_attention", model_attention, True, 128), ("moe_grouped_vs_dense", moe_cost, True, 8, 256)]
    else:
        checks = [("moe_kernels", moe_kernels, False, 1, 32, 4096), ("moe_kernels", moe_kernels, False, 4, 16, 4096),
                  ("moe_kernel_timing", moe_kernel_timing, False, 16, 4096),
                  ("layer_costs", layer_costs, False, 4096, 16)]
        # 1024: near `attention_impl: auto`'s CPU-measured switch to flash (512 keys)
        # the grouped path only at 1,024: at 8,192 its walk is ~65,000 launch-bound loop steps a call (session 25)
        checks += [("attention_kernels", attention_kernels, False, 1024),
                   ("attention_kernels", attention_kernels, False, 8192, ("grouped_sparse",))]
        checks += [("logprob_head", logprob_head, False, 8192, 1024),
                   ("train_step_mfu", mfu, False, 4, 16, 4096, 1, peak, RECIPE_OPTIONS, 2),
                   ("decode_layers", decode_layers, False, 4, 16, 8, 4096)]
    checks += [("device_checksum", device_checksum, small), ("host_reference", host_reference, small),
               ("weight_push_device", weight_push_device, small), ("vllm_long_context", vllm_long_context),
               ("load_round_trip", load_round_trip, small)]
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
