"""Forward+backward wall time: m3jax (jit(value_and_grad)) vs the HF PyTorch model (eager), same weights.

The model is the tiny `release_like` reference config of m3jax.tiny (4 layers: 1 full-attention
dense layer, then 3 sparse-attention (indexer) MoE layers). The HF model is built with a fixed seed,
saved with transformers to a temporary directory and loaded with `m3jax.from_pretrained`
(`m3jax.tiny.m3_from_hf`), so both sides hold identical fp32 weights. The loss is the mean next-token cross entropy over B x (S-1) tokens.

Timing: each Flax variant is compiled first (compile time reported separately, never in the median);
then, after --warmup untimed rounds, --iters rounds run every contestant, in an order shuffled each round (so
that load from other processes hits all of them alike), --burst calls back to back of which the first is
untimed (torch's OpenMP workers spin for a while after HF's call: the step after it is not a fair sample),
each iteration timed to
`block_until_ready` (Flax) or the end of `loss.backward()` (HF). HF runs in eager mode with
`torch.set_num_threads(cpu count)` and grads zeroed (set to None) before every iteration. Reported:
median (and min) ms per iteration and HF/Flax of the medians (> 1 means Flax is faster); the loss of
both and the relative difference of the global gradient norms. Flax is timed as loaded by default
(remat=True: each layer's forward is recomputed in the backward pass; attention_impl="auto": the full layer
runs flash attention from 512 keys on, dense below), with remat=False (like HF eager, which keeps every
activation for its backward: the like-for-like row, and what `python -m m3jax.train` runs unless a config
sets `model.remat`: configs/base.yaml has remat false), with attention_impl="dense" (the masked [S, S]
scores path, the default before "auto"), and optionally with another `model.remat_policy`
(--remat-policy-row save_dots_experts: the recipes' choice), and with other expert kernels
(--moe-kernel-row tiled: the default before the bucketed kernel), with another attention_impl
(--attention-impl-row flash), and with the layers unrolled (--unrolled-rows: model.scan_layers=false, with and
without remat).
The 1-minute load average is printed: on a machine shared with other jobs, torch's intra-op thread
pool degrades far more than XLA's under contention, so only runs with a load average near or below
the core count are a fair comparison.

    .venv/bin/python scripts/bench_forward_backward.py                  # seq 64 and 256
    .venv/bin/python scripts/bench_forward_backward.py --seq 64 --iters 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from m3jax import tiny  # noqa: E402


def n_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------- Flax


def flax_step(model):
    """jit(value_and_grad) of the next-token CE over the model's nnx.Param leaves."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, ids):
        m = nnx.merge(graphdef, params, rest)
        logits = m(ids).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        return nll.mean()

    return jax.jit(jax.value_and_grad(loss_fn)), params


def prepare_flax(model, ids_np):
    """Compile (timed) and return (one step -> (loss, grads) blocked, compile seconds, XLA flops)."""
    step, params = flax_step(model)
    ids = jnp.asarray(ids_np)
    t0 = time.perf_counter()
    compiled = step.lower(params, ids).compile()
    compile_s = time.perf_counter() - t0
    flops = None
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = cost.get("flops") if cost else None
    except Exception:  # cost analysis is best-effort
        pass

    def one():
        return jax.block_until_ready(compiled(params, ids))

    return one, compile_s, flops


def flax_result(out):
    loss, grads = out
    return float(loss), float(jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))))


# ---------------------------------------------------------------- HF


def hf_loss(model, ids):
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def prepare_hf(model, ids_np):
    ids = torch.tensor(ids_np, dtype=torch.long)

    def one():
        model.zero_grad(set_to_none=True)
        loss = hf_loss(model, ids)
        loss.backward()
        return loss

    return one


def hf_result(model, loss):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(loss.detach()), float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))


def time_interleaved(steps: dict, iters: int, warmup: int, burst: int) -> tuple[dict, dict]:
    """Rounds in an order shuffled each round (seeded); in a round every contestant runs `burst` calls back to
    back and only the calls after its first are timed. Returns ({name: [seconds]}, {name: last output}).

    The untimed first call matters: after HF's call torch's OpenMP workers keep spinning on the cores for a
    while, and whichever step starts next runs on what is left. An order merely rotated by one each round does
    not spread that: HF's successor is the same contestant in all but one round of every cycle (in the
    earlier runs the full-remat row, 2-3 ms slower at S = 256 than the same program timed alone). An idle gap
    instead slows every call alike (threads asleep, caches cold), unlike a training loop's back-to-back steps.
    """
    import random

    out = {}
    for _ in range(warmup):
        for name, fn in steps.items():
            out[name] = fn()
    times = {name: [] for name in steps}
    order, rng = list(steps), random.Random(0)
    for _ in range(iters):
        rng.shuffle(order)
        for name in order:
            out[name] = steps[name]()  # absorbs the previous contestant's busy threads
            for _ in range(burst - 1):
                t0 = time.perf_counter()
                out[name] = steps[name]()
                times[name].append(time.perf_counter() - t0)
    return times, out


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[64, 256], help="sequence lengths (default 64 256)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30, help="rounds per measurement")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--burst", type=int, default=3,
                    help="calls per contestant per round, the first untimed (default 3: 2 timed per round)")
    ap.add_argument("--variant", default="release_like")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: cpu count)")
    ap.add_argument("--no-remat-row", action="store_true",
                    help="skip the extra Flax row loaded with remat=False")
    ap.add_argument("--no-dense-row", action="store_true",
                    help="skip the extra Flax row loaded with attention_impl=dense (masked [S, S] scores)")
    ap.add_argument("--remat-policy-row", default=None, metavar="POLICY",
                    help="an extra Flax row with remat=True and this model.remat_policy (the recipes select "
                         "save_dots_experts)")
    ap.add_argument("--moe-kernel-row", nargs="*", default=[], metavar="KERNEL",
                    help="extra Flax rows (remat=True) with these model.moe_kernel choices")
    ap.add_argument("--attention-impl-row", nargs="*", default=[], metavar="IMPL",
                    help="extra Flax rows (remat=True) with these model.attention_impl choices")
    ap.add_argument("--unrolled-rows", action="store_true",
                    help="two extra Flax rows, remat=True and remat=False, with model.scan_layers=false (each "
                         "stack's layers unrolled instead of one loop over the stacked weights)")
    args = ap.parse_args()

    threads = n_cpus()
    torch.set_num_threads(args.torch_threads or threads)
    cfg = tiny.hf_config(args.variant)
    hf = tiny.hf_model(cfg, seed=0)  # eval() mode: no dropout; grads still enabled
    flax_models = {"flax (remat=True, default)": tiny.m3_from_hf(hf)}
    if not args.no_remat_row:
        flax_models["flax (remat=False)"] = tiny.m3_from_hf(hf, remat=False)
    if not args.no_dense_row:
        flax_models["flax (remat=True, dense)"] = tiny.m3_from_hf(hf, attention_impl="dense")
    if args.remat_policy_row:
        flax_models[f"flax (remat {args.remat_policy_row})"] = tiny.m3_from_hf(hf, remat_policy=args.remat_policy_row)
    for kernel in args.moe_kernel_row:
        flax_models[f"flax (remat, moe {kernel})"] = tiny.m3_from_hf(hf, moe_kernel=kernel)
    for impl in args.attention_impl_row:
        flax_models[f"flax (remat, attention {impl})"] = tiny.m3_from_hf(hf, attention_impl=impl)
    if args.unrolled_rows:
        flax_models["flax (remat=True, unrolled)"] = tiny.m3_from_hf(hf, scan_layers=False)
        flax_models["flax (remat=False, unrolled)"] = tiny.m3_from_hf(hf, remat=False, scan_layers=False)

    n_params = sum(p.numel() for p in hf.parameters())
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
          f"(threads={torch.get_num_threads()}), cpus={threads}")
    print(f"config {args.variant}: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, "
          f"attn {list(cfg.layer_types)}, mlp {list(cfg.mlp_layer_types)}, "
          f"experts {cfg.num_local_experts} top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}, "
          f"{n_params / 1e6:.3f}M params")
    print(f"batch {args.batch}, iters {args.iters} (+{args.warmup} warm-up), attn_implementation "
          f"{hf.config._attn_implementation}\n")

    rows = []
    load0 = os.getloadavg()
    for seq in args.seq:
        ids = tiny.random_ids(cfg, args.batch, seq, seed=seq)
        steps, info = {}, {}
        for name, fm in flax_models.items():
            steps[name], comp, flops = prepare_flax(fm, ids)
            info[name] = (comp, flops)
        steps["hf"] = prepare_hf(hf, ids)
        times, out = time_interleaved(steps, args.iters, args.warmup, max(2, args.burst))
        hloss, hgn = hf_result(hf, out["hf"])
        hmed, hmin = statistics.median(times["hf"]) * 1e3, min(times["hf"]) * 1e3
        for name in flax_models:
            floss, fgn = flax_result(out[name])
            fmed, fmin = statistics.median(times[name]) * 1e3, min(times[name]) * 1e3
            rows.append((seq, name, fmed, fmin, hmed, hmin, floss, hloss, fgn, hgn, *info[name]))
    load1 = os.getloadavg()

    hdr = (f"{'seq':>4} | {'flax variant':<28} | {'flax ms':>8} | {'HF ms':>8} | {'HF/Flax':>7} | "
           f"{'flax min':>8} | {'HF min':>8} | "
           f"{'flax loss':>10} | {'HF loss':>10} | {'|dloss|':>8} | {'grad-norm rel diff':>18} | "
           f"{'compile s':>9} | {'XLA GFLOP':>9}")
    print(hdr)
    print("-" * len(hdr))
    for seq, name, fmed, fmin, hmed, hmin, floss, hloss, fgn, hgn, comp, flops in rows:
        gf = f"{flops / 1e9:9.3f}" if flops else f"{'n/a':>9}"
        print(f"{seq:>4} | {name:<28} | {fmed:8.2f} | {hmed:8.2f} | {hmed / fmed:7.2f} | {fmin:8.2f} | "
              f"{hmin:8.2f} | {floss:10.6f} | "
              f"{hloss:10.6f} | {abs(floss - hloss):8.1e} | {abs(fgn - hgn) / hgn:18.1e} | {comp:9.2f} | {gf}")
    print("\nmedian ms per forward+backward iteration; HF/Flax > 1 means Flax is faster. "
          "HF ms is the same measurement repeated on each row of a seq;\n"
          "Flax and HF iterations are interleaved (shuffled rounds of back-to-back calls, the first of each untimed); min = fastest single iteration.\n"
          f"load average (1 min) at start / end: {load0[0]:.2f} / {load1[0]:.2f} on {threads} cpus "
          "(> cpus means other processes competed for the cores)")


if __name__ == "__main__":
    main()
