"""MoE work vs top-k and number of experts: XLA cost analysis, program-level FLOPs and analytic FLOPs.

For a fixed token count T and hidden size d, `m3jax.model.moe.moe_block(p, x, cfg)` (no mesh: every
expert local, assignments sorted by expert, two `jax.lax.ragged_dot_general` grouped matmuls) is jitted
for E in (8, 32, 128) experts and top-k in (1, 2, 4). Reported per (E, k):

- XLA:      `jax.jit(moe_block).lower(...).compile().cost_analysis()["flops"]` on the current backend;
- program:  FLOPs read from the jaxpr's shapes, counting each `ragged_dot_general` as a grouped GEMM
            (2 x rows x in x out: every one of the T*k sorted rows meets exactly one expert) and each
            `dot_general` as usual (router logits, shared expert) -- what a grouped-GEMM kernel executes;
- analytic: routed 2*T*k*3*d*I (gate + up = 2*I*d, down = d*I per row) + shared 2*T*3*d*Is + router 2*T*E*d;
- dense:    every expert on every token, 2*T*E*3*d*I (+ the same shared and router terms);
- time:     median wall ms of the jitted block on this machine.

What XLA measures on CPU: jax lowers `ragged_dot_general` on CPU (no grouped-GEMM kernel) with its
reference rule `_ragged_dot_general_impl`: the [N, d] rows are expanded to a masked [E, N, d] tensor
(rows of other groups zeroed) and one dense `dot_general` contracts over (E, d). XLA's CPU cost
analysis therefore counts E x the useful work of each ragged dot, 2*E*(T*k)*3*d*I in total: k times
MORE than even the dense all-experts computation, growing with E*k; the CPU wall time follows it.
That is an artefact of the CPU lowering, not of the model: the program hands XLA T*k rows and
group sizes, and the useful work (the "program" column) is independent of E apart from the router.

On GPU / TPU the same jaxpr lowers to `chlo.ragged_dot` (XLA's ragged-dot instruction, a grouped GEMM);
`--show-lowering` prints the op the ragged dot becomes for cpu, cuda and tpu (cross-platform lowering,
no accelerator needed). To see it on a CUDA machine, run this script there (it reports
`compiled.cost_analysis()` of the CUDA backend), or take a profiler trace and look for one grouped GEMM
kernel per ragged dot, whose time grows with k and not with E:

    JAX_PLATFORMS=cuda python scripts/bench_moe_flops.py --trace /tmp/moe_trace   # then open in
    # TensorBoard / Perfetto (xprof): per (E, k) the kernels of the two ragged dots
    # (or with jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True): Pallas Triton kernels)

    .venv/bin/python scripts/bench_moe_flops.py
    .venv/bin/python scripts/bench_moe_flops.py --tokens 1024 --hidden 128 --inter 64 --show-lowering
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.extend.core  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from m3jax import M3Config  # noqa: E402
from m3jax.model.moe import moe_block  # noqa: E402
from m3jax.tiny import m3_config  # noqa: E402

# The ragged dot of m3jax.model.moe.grouped_experts: rows [N, in] against per-expert weights [E, out, in]
# (HF layout), contracting `in` with the last rhs axis.
ROWS_BY_EXPERT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def make_cfg(d, inter, shared, experts, k) -> M3Config:
    # one layer, MoE only (moe_block reads the MoE fields; the attention fields are unused here)
    return m3_config(layers=1, dense_layers=0, vocab_size=256, hidden_size=d, intermediate_size=inter,
                     dense_intermediate_size=inter, shared_intermediate_size=shared, num_local_experts=experts,
                     num_experts_per_tok=k)


def make_params(cfg, dtype, seed=0):
    e, d, i, s = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size
    ks = jax.random.split(jax.random.key(seed), 6)
    n = lambda k, shape, dt=dtype: (jax.random.normal(k, shape, jnp.float32) / math.sqrt(shape[-1])).astype(dt)  # noqa: E731
    return {"router": n(ks[0], (e, d), jnp.float32), "router_bias": 0.1 * jax.random.normal(ks[1], (e,)),
            "experts_gate_up": n(ks[2], (e, 2, i, d)), "experts_down": n(ks[3], (e, d, i)),
            "shared_gate_up": n(ks[4], (2, s, d)), "shared_down": n(ks[5], (d, s))}


def _dot_flops(eqn) -> float:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    if eqn.primitive.name == "ragged_dot_general":
        (lc, rc), (lb, rb) = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
        gdims = eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions
        rfree = [n for j, n in enumerate(rhs) if j not in rc and j not in rb and j not in gdims]
    else:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        rfree = [n for j, n in enumerate(rhs) if j not in rc and j not in rb]
    return 2.0 * math.prod(lhs) * math.prod(rfree)  # lhs = batch x free x contracted; times rhs free dims


def program_flops(jaxpr) -> dict:
    """{"ragged": ..., "dot": ...} FLOPs of the matmuls of a (closed) jaxpr, recursing into sub-jaxprs."""
    out = {"ragged": 0.0, "dot": 0.0}

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "ragged_dot_general":
                out["ragged"] += _dot_flops(eqn)
            elif eqn.primitive.name == "dot_general":
                out["dot"] += _dot_flops(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return out


def show_lowering():
    f = jax.jit(lambda a, b, g: jax.lax.ragged_dot_general(a, b, g, ROWS_BY_EXPERT))
    args = (jnp.ones((256, 64)), jnp.ones((8, 32, 64)), jnp.full((8,), 32, jnp.int32))
    print("What one ragged_dot_general (rows [256, 64], 8 experts [8, 32, 64]) lowers to, per platform:")
    for plat in ("cpu", "cuda", "tpu"):
        try:
            text = f.trace(*args).lower(lowering_platforms=(plat,)).as_text()
            ops = [ln.strip() for ln in text.splitlines() if "ragged_dot" in ln or "dot_general" in ln]
            print(f"  {plat:>4}: " + " | ".join(o.split("<{")[0].split(", contracting")[0][:160] for o in ops))
        except Exception as e:  # noqa: BLE001
            print(f"  {plat:>4}: cannot lower here ({type(e).__name__}: {str(e)[:120]})")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="T = batch x seq (batch 4)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--inter", type=int, default=64, help="routed expert intermediate size I")
    ap.add_argument("--shared", type=int, default=128, help="shared expert intermediate size Is")
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--topk", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--show-lowering", action="store_true")
    ap.add_argument("--trace", default=None, help="write a jax.profiler trace of the timed runs here")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    T, d, inter, sh = args.tokens, args.hidden, args.inter, args.shared
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}); "
          f"T={T} tokens, d={d}, I={inter}, Is={sh}, {args.dtype}")
    if args.show_lowering:
        show_lowering()
    x = (jax.random.normal(jax.random.key(1), (4, T // 4, d))).astype(dtype)
    rows = []
    if args.trace:
        jax.profiler.start_trace(args.trace)
    for e in args.experts:
        for k in args.topk:
            cfg = make_cfg(d, inter, sh, e, k)
            p = make_params(cfg, dtype)
            fn = jax.jit(lambda p, x, cfg=cfg: moe_block(p, x, cfg))
            compiled = fn.lower(p, x).compile()
            ca = compiled.cost_analysis()
            ca = ca[0] if isinstance(ca, (list, tuple)) else ca
            prog = program_flops(jax.make_jaxpr(lambda p, x, cfg=cfg: moe_block(p, x, cfg))(p, x))
            routed = 2.0 * T * k * 3 * d * inter
            other = 2.0 * T * 3 * d * sh + 2.0 * T * e * d
            dense = 2.0 * T * e * 3 * d * inter
            jax.block_until_ready(compiled(p, x))
            ts = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(p, x))
                ts.append(time.perf_counter() - t0)
            rows.append(dict(e=e, k=k, xla=ca.get("flops", float("nan")), prog=prog["ragged"] + prog["dot"],
                             prog_ragged=prog["ragged"], analytic=routed + other, routed=routed, dense=dense + other,
                             ms=1e3 * statistics.median(ts)))
    if args.trace:
        jax.profiler.stop_trace()
        print(f"profiler trace written to {args.trace}")

    g = lambda v: f"{v / 1e9:8.3f}"  # noqa: E731
    hdr = (f"{'E':>4} {'k':>2} | {'XLA GF':>8} {'program GF':>10} {'analytic GF':>11} {'dense-all GF':>12} | "
           f"{'routed GF':>9} {'XLA/analytic':>12} {'XLA/dense':>9} | {'ms':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['e']:>4} {r['k']:>2} | {g(r['xla'])} {g(r['prog']):>10} {g(r['analytic']):>11} "
              f"{g(r['dense']):>12} | {g(r['routed']):>9} {r['xla'] / r['analytic']:>12.2f} "
              f"{r['xla'] / r['dense']:>9.2f} | {r['ms']:>8.2f}")
    ok = all(abs(r["prog"] - r["analytic"]) <= 1e-9 * r["analytic"] for r in rows)
    print(f"\nprogram FLOPs (jaxpr, ragged dots as grouped GEMMs) == analytic for every (E, k): {ok}")
    print("(GF = 1e9 FLOPs, multiply-add = 2; XLA also counts elementwise ops, the others count matmuls only.)")
    print("Routed work depends on k only: the two ragged dots see T*k rows whatever E is; E enters only through "
          "the router (2*T*E*d).")
    if jax.default_backend() == "cpu":
        print("NOTE (CPU): jax lowers ragged_dot_general on CPU densely (rows expanded to a masked [E, T*k, d] "
              "tensor, one dot over (E, d)), so XLA's CPU cost analysis and the CPU time grow with E*k: it counts "
              "E x the useful routed work, k x the dense all-experts FLOPs. On GPU/TPU the ragged dot lowers to "
              "chlo.ragged_dot (grouped GEMM, see --show-lowering); check there with compiled.cost_analysis() on the "
              "CUDA backend or a profiler trace (--trace DIR).")


if __name__ == "__main__":
    main()
