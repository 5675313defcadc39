"""Decode throughput: the embedded JAX engine (rl.generation.jax_engine) vs HF PyTorch `generate`, same weights.

The model is the tiny `release_like` reference config of m3jax.tiny (4 layers: 1 full-attention
dense layer, then 3 sparse-attention (lightning indexer) MoE layers, 8 experts top-2). The HF model is
built with a fixed seed, saved with transformers to a temporary directory and loaded with
`m3jax.from_pretrained`, so both sides hold identical fp32 weights.

Both sides decode the same batch of random prompts (all --prompt-len tokens, so no padding), greedily,
exactly --new tokens each:
  * JAX: `JaxEngine.generate(prompts, SamplingParams(max_new_tokens=new, temperature=0), key)`, no stop
    tokens (one jitted program: prefill + a `lax.while_loop` of single-token decode steps).
  * HF: `model.generate(ids, do_sample=False, use_cache=True, max_new_tokens=new, min_new_tokens=new,
    eos_token_id=None)`, attn_implementation="eager" (the reference's default), torch.no_grad, timed with
    `torch.set_num_threads(1)` and with the cpu count (on a shared machine torch's thread pool degrades
    badly under contention; the faster is the baseline). eos_token_id=None: with an eos id, min_new_tokens
    would mask the eos logit (HF's MinNewTokensLogitsProcessor) and greedy HF would differ from greedy JAX
    wherever eos is the argmax; without one neither side can stop early, so both generate exactly `new` tokens.
With prompt + new > index_topk_blocks x index_block_size (16 for release_like), the sparse layers
really drop key blocks, so the comparison covers the indexer's block selection during decode.

Timing: the JAX program's first call (trace + compile + run) is timed and reported separately; the
compile estimate is that minus the median run. After --warmup untimed calls of each, --iters rounds run
JAX then each HF thread count (round-robin, so load from other processes hits both alike); each call is timed to
host-visible tokens (`generate` returns numpy arrays; HF returns a tensor). Reported per batch size:
median (min) seconds per generate call, generated tokens/s = batch x new / median, JAX/HF ratio (> 1 =
JAX faster), and greedy agreement: fraction of rows whose whole sequence is identical, fraction of
token positions equal, and the mean first position of divergence among rows that differ.

--profile traces JAX generate with jax.profiler and lists XLA CPU op time per HLO instruction (with the
jax op it came from and whether it only moves the KV cache). --ablate times one decode step with the MoE
layers made dense and/or the sparse layers made full attention (same active MLP width).
--breakdown adds measurements that explain the JAX figure (all jitted, compile excluded): the same
generate call with 1 new token (prefill + program overhead), the decode loop's cost per token measured
directly (`scripts/bench_decode_step.py`'s loop of --new decode steps that carries the cache, at the cache
length of the generate call and at 4x it), and one jitted decode step of the model alone with XLA's
cost_analysis FLOPs. (Before session 30 the per-token figure was the difference of two generate calls,
whose prefills differ in shape: 26 ms per token at a 1,000-token prompt where the loop took about 2.3.)

    .venv/bin/python scripts/bench_generate.py                      # batch 64 and 256
    .venv/bin/python scripts/bench_generate.py --batch 64 --iters 3 --breakdown
    .venv/bin/python scripts/bench_generate.py --breakdown --ablate --profile   # everything
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from bench_decode_step import decode_loop  # noqa: E402
from m3jax import tiny  # noqa: E402
from rl.generation.base import SamplingParams  # noqa: E402
from rl.generation.jax_engine import JaxEngine, generate_program  # noqa: E402

XLA_COMPILES = [0]  # XLA compilations of the engine's program (`generate_program`) so far


def count_compiles(event: str, _seconds: float, fun_name: str = "", **_kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration" and fun_name == f"jit({generate_program.__name__})":
        XLA_COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(count_compiles)


def n_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float | None]:
    """(rows identical, token positions equal, mean first divergence position among differing rows)."""
    eq = a == b
    rows = eq.all(-1)
    first = [int(np.argmin(r)) for r in eq[~rows]]
    return float(rows.mean()), float(eq.mean()), (float(np.mean(first)) if first else None)


def time_call(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_batch(engine, hf, cfg, batch, prompt_len, new, iters, warmup, seed, torch_threads):
    ids = tiny.random_ids(cfg, batch, prompt_len, seed=seed)
    prompts = [list(map(int, r)) for r in ids]
    sp = SamplingParams(max_new_tokens=new, temperature=0.0)
    key = jax.random.key(0)
    compiles_before = XLA_COMPILES[0]

    def run_jax():
        return engine.generate(prompts, sp, key).tokens

    ids_t = torch.tensor(ids, dtype=torch.long)
    mask_t = torch.ones_like(ids_t)

    def hf_runner(threads):
        def run_hf():
            torch.set_num_threads(threads)
            with torch.no_grad():
                out = hf.generate(ids_t, attention_mask=mask_t, do_sample=False, use_cache=True,
                                  max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0)
            return out[:, prompt_len:].numpy()
        return run_hf

    steps = {"jax": run_jax, **{f"hf t={t}": hf_runner(t) for t in torch_threads}}
    first_s, _ = time_call(run_jax)
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    times, out = {k: [] for k in steps}, {}
    for _ in range(iters):  # round-robin: load from other processes hits every contestant alike
        for name, fn in steps.items():
            s, out[name] = time_call(fn)
            times[name].append(s)
    compiles = XLA_COMPILES[0] - compiles_before
    jtok = out["jax"]
    hf_names = [k for k in steps if k != "jax"]
    for k in hf_names:
        assert out[k].shape == jtok.shape == (batch, new), (out[k].shape, jtok.shape)
        assert np.array_equal(out[k], out[hf_names[0]]), "HF output depends on its thread count"
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(hf_names, key=med.get)
    return dict(batch=batch, med=med, mins={k: min(v) for k, v in times.items()}, best_hf=best, first=first_s,
                compiles=compiles, agree=agreement(jtok, out[best]))


def breakdown(model, engine, cfg, batch, prompt_len, new, iters):
    """Where the JAX generate time goes: prefill/overhead vs per-token decode vs the model's decode step."""
    ids = tiny.random_ids(cfg, batch, prompt_len, seed=batch)
    prompts = [list(map(int, r)) for r in ids]
    key = jax.random.key(0)
    res = {}
    for n in (1, new):
        sp = SamplingParams(max_new_tokens=n, temperature=0.0)
        engine.generate(prompts, sp, key)  # compile
        res[n] = statistics.median(time_call(lambda: engine.generate(prompts, sp, key))[0] for _ in range(iters))
    # the decode loop alone, per token: at the generate call's cache length, and at a 4x longer cache
    for name, slots in (("per_token", prompt_len + new), ("per_token_wide", 4 * (prompt_len + new))):
        compiled, call_args = decode_loop(model, batch, slots, new)
        jax.block_until_ready(compiled(*call_args))
        res[name] = statistics.median(time_call(lambda: jax.block_until_ready(compiled(*call_args)))[0]
                                      for _ in range(iters)) / new

    # one decode step of the model alone (what the while-loop body runs), at the middle of the sequence
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    max_len = prompt_len + new

    @jax.jit
    def step(params, rest, tok, pos, cache):
        m = nnx.merge(graphdef, params, rest)
        logits, cache = m(tok, positions=pos, cache=cache)
        return logits, cache

    m = nnx.merge(graphdef, params, rest)
    cache = m.init_cache(batch, max_len)
    tok = jnp.asarray(ids[:, :1])
    pos = jnp.full((batch, 1), prompt_len + new // 2, jnp.int32)
    compiled = step.lower(params, rest, tok, pos, cache).compile()
    flops = None
    try:
        c = compiled.cost_analysis()
        c = c[0] if isinstance(c, (list, tuple)) else c
        flops = c.get("flops") if c else None
    except Exception:
        pass
    jax.block_until_ready(compiled(params, rest, tok, pos, cache))
    ts = []
    for _ in range(max(iters * 10, 20)):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, rest, tok, pos, cache))
        ts.append(time.perf_counter() - t0)
    res["step"] = statistics.median(ts)
    res["step_flops"] = flops
    return res


ABLATIONS = {  # same active MLP width: dense 96 = 2 routed x 32 + shared 32
    "as is (sparse attn + MoE)": {},
    "MoE -> dense MLP": dict(moe_layer_freq=None),
    "sparse -> full attention": dict(sparse_attention_freq=None),
    "dense MLP + full attention": dict(moe_layer_freq=None, sparse_attention_freq=None),
}


def ablation_configs(variant):
    base = tiny.hf_config(variant)
    n = base.num_hidden_layers
    out = {}
    for name, ov in ABLATIONS.items():
        kw = {}
        if "moe_layer_freq" in ov:
            kw["moe_layer_freq"] = [0] * n
        if "sparse_attention_freq" in ov:
            sac = dict(tiny.HF_VARIANTS[variant].get("sparse_attention_config",
                                                     tiny.HF_TINY["sparse_attention_config"]))
            kw["sparse_attention_config"] = {**sac, "sparse_attention_freq": [0] * n}
        out[name] = tiny.hf_config(variant, **kw)
    return out


def ablate(variant, batches, prompt_len, new, iters):
    """One jitted single-token decode step (cache of prompt+new slots, at position prompt+new/2) for the model
    as is and with its MoE layers made dense and/or its sparse layers made full attention; round-robin."""
    steps = {}
    for name, cfg in ablation_configs(variant).items():
        model = tiny.m3_from_hf(tiny.hf_model(cfg, seed=0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def f(params, rest, tok, pos, cache, graphdef=graphdef):
            return nnx.merge(graphdef, params, rest)(tok, positions=pos, cache=cache)

        for b in batches:
            cache = nnx.merge(graphdef, params, rest).init_cache(b, prompt_len + new)
            args = (params, rest, jnp.ones((b, 1), jnp.int32), jnp.full((b, 1), prompt_len + new // 2, jnp.int32),
                    cache)
            compiled = jax.jit(f).lower(*args).compile()
            c = compiled.cost_analysis()
            c = c[0] if isinstance(c, (list, tuple)) else c
            steps[(name, b)] = (functools.partial(lambda c, a: jax.block_until_ready(c(*a)), compiled, args),
                                c.get("flops") if c else None)
    for fn, _ in steps.values():
        fn()
    times = {k: [] for k in steps}
    for _ in range(max(iters * 6, 30)):
        for k, (fn, _) in steps.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v), steps[k][1]) for k, v in times.items()}


def profile_generate(engine, cfg, batch, prompt_len, new, calls=3, top=25):
    """jax.profiler trace of `calls` generate calls (cfg: the m3jax M3Config); XLA CPU op time by HLO
    instruction, named by the jax op (HLO metadata op_name) it came from. "KV-cache movement" = non-matmul
    ops whose output has at least batch x slots x min(index_head_dim, kv_heads x head_dim) elements
    (slicing a layer's cache out of the stacked cache, the scatter of the new token's keys, writing it back, copies and zero fills)."""
    import collections
    import glob
    import re

    ids = tiny.random_ids(cfg, batch, prompt_len, seed=batch)
    prompts = [list(map(int, r)) for r in ids]
    sp = SamplingParams(max_new_tokens=new, temperature=0.0)
    key = jax.random.key(0)
    engine.generate(prompts, sp, key)
    hlo = generate_program.lower(engine.graphdef, engine.params, engine.rest, jnp.asarray(ids),
                                     jnp.full((batch,), prompt_len, jnp.int32), key, sp, engine.pad_id)
    text = hlo.compile().as_text()
    meta, shape = {}, {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+?\[[\d,]*\])", line)
        if m:
            shape[m.group(1)] = m.group(2)
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{op_name=\"([^\"]+)\"", line)
        if m:
            meta[m.group(1)] = m.group(2)
    with tempfile.TemporaryDirectory(prefix="m3bench_prof_") as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                engine.generate(prompts, sp, key)
        pd = jax.profiler.ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
        ns, count = collections.Counter(), collections.Counter()
        for plane in pd.planes:
            for line in plane.lines:
                if "XLAEigen" not in line.name:  # XLA's intra-op threads: one event per HLO instruction run
                    continue
                for ev in line.events:
                    if "::" in ev.name or ev.name.startswith("while"):  # runtime / thread-pool waits, loops
                        continue
                    ns[ev.name] += ev.duration_ns
                    count[ev.name] += 1
    slots = prompt_len + new
    kv = cfg.num_key_value_heads * cfg.head_dim
    thresh = batch * slots * min(kv, cfg.index_head_dim)

    def numel(name):
        m = re.search(r"\[([\d,]*)\]", shape.get(name, "[]"))
        return int(np.prod([int(x) for x in m.group(1).split(",") if x])) if m and m.group(1) else 1

    def is_cache_move(name):
        return not name.startswith(("ynn_fusion", "dot", "custom-call")) and numel(name) >= thresh

    total = sum(ns.values())
    cache_ns = sum(v for k, v in ns.items() if is_cache_move(k))
    mm_ns = sum(v for k, v in ns.items() if k.startswith(("ynn_fusion", "dot")))
    print(f"\nJAX generate profile, batch {batch}: XLA op time {total / 1e6 / calls:.1f} ms per call (summed over "
          f"XLA threads; wall median above). KV-cache movement: {cache_ns / total:.1%}; matmul-like fusions "
          f"(ynn/dot, incl. attention einsums and the MoE's dense-per-expert ragged dots): {mm_ns / total:.1%}")
    print(f"{'share':>6} | {'ms/call':>7} | {'runs/call':>9} | {'cache':>5} | {'HLO instruction':<40} | "
          f"{'output':<24} | jax op")
    for k, v in ns.most_common(top):
        op = meta.get(k, "(no metadata: copy / fill)").replace("jit(_generate)/", "")
        flag = "yes" if is_cache_move(k) else ""
        print(f"{v / total:6.1%} | {v / 1e6 / calls:7.2f} | {count[k] / calls:9.0f} | {flag:>5} | "
              f"{k:<40} | {shape.get(k, '?'):<24} | {op[-70:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="batch sizes (default 64 256)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=64, help="new tokens per row")
    ap.add_argument("--iters", type=int, default=5, help="timed rounds per batch size")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variant", default="release_like")
    ap.add_argument("--torch-threads", type=int, nargs="+", default=None,
                    help="torch intra-op thread counts to time HF with (default: 1 and the cpu count)")
    ap.add_argument("--breakdown", action="store_true", help="also time prefill vs decode and one decode step")
    ap.add_argument("--ablate", action="store_true",
                    help="also time one decode step with MoE -> dense MLP and/or sparse -> full attention")
    ap.add_argument("--unrolled", action="store_true",
                    help="the JAX model with model.scan_layers=false (each stack's layers unrolled)")
    ap.add_argument("--skip-compare", action="store_true", help="skip the JAX vs HF table")
    ap.add_argument("--profile", action="store_true",
                    help="also trace JAX generate with jax.profiler and list XLA op time by instruction")
    args = ap.parse_args()

    threads = n_cpus()
    cfg = tiny.hf_config(args.variant)
    hf = tiny.hf_model(cfg, seed=0, attn="eager")
    model = tiny.m3_from_hf(hf, scan_layers=not args.unrolled)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    engine = JaxEngine(graphdef, params, rest, pad_id=0)

    mc = model.cfg
    sel = mc.index_topk_blocks * mc.index_block_size
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, cpus={threads}, "
          f"scan_layers={not args.unrolled}")
    print(f"config {args.variant}: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, "
          f"attn {list(cfg.layer_types)}, mlp {list(cfg.mlp_layer_types)}, "
          f"experts {cfg.num_local_experts} top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}, "
          f"{n_params / 1e6:.3f}M params, fp32")
    print(f"prompt {args.prompt_len} + new {args.new} = {args.prompt_len + args.new} tokens; sparse layers keep "
          f"{mc.index_topk_blocks} x {mc.index_block_size} = {sel} keys per query"
          f"{' (they really select)' if args.prompt_len + args.new > sel else ' (they keep everything)'}")
    print(f"greedy, HF attn_implementation={hf.config._attn_implementation}, {args.iters} timed rounds "
          f"(+{args.warmup} warm-up)\n")

    torch_threads = args.torch_threads or sorted({1, threads})
    if args.skip_compare:
        args.batch_compare = []
    else:
        args.batch_compare = args.batch
    load0 = os.getloadavg()
    rows = [bench_batch(engine, hf, cfg, b, args.prompt_len, args.new, args.iters, args.warmup, seed=b,
                        torch_threads=torch_threads) for b in args.batch_compare]
    load1 = os.getloadavg()

    if rows:
        hf_names = [f"hf t={t}" for t in torch_threads]
        hdr = (f"{'batch':>5} | {'contestant':<10} | {'median s':>8} | {'min s':>7} | {'tok/s':>7} | {'JAX/this':>8}")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            ntok = r["batch"] * args.new
            for k in ["jax", *hf_names]:
                ratio = r["med"][k] / r["med"]["jax"]
                star = " *" if k == r["best_hf"] else ""
                print(f"{r['batch']:>5} | {k:<10} | {r['med'][k]:8.3f} | {r['mins'][k]:7.3f} | "
                      f"{ntok / r['med'][k]:7.0f} | {ratio:8.2f}{star}")
        print("\nseconds = median (min) wall time of one generate call (batch x new tokens); tok/s = generated "
              "tokens/s at the median;\nJAX/this = JAX throughput / this contestant's (> 1: JAX faster); "
              "hf t=N: torch with N intra-op threads; * = faster HF.\n")
        hdr = (f"{'batch':>5} | {'JAX/best HF':>11} | {'1st call s':>10} | {'compile s':>9} | {'#compiles':>9} | "
               f"{'rows same':>9} | {'tokens same':>11} | {'1st diff':>8}")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            rs, ts, fd = r["agree"]
            fd = f"{fd:8.1f}" if fd is not None else f"{'-':>8}"
            print(f"{r['batch']:>5} | {r['med'][r['best_hf']] / r['med']['jax']:11.2f} | {r['first']:10.2f} | "
                  f"{r['first'] - r['med']['jax']:9.2f} | {r['compiles']:>9} | {rs:9.3f} | {ts:11.4f} | {fd}")
        print("\n1st call = JAX trace + compile + run; compile = 1st call - median; #compiles = XLA compilations "
              "of the engine's program\nduring the batch (1 = no recompiles); rows same / tokens same = greedy "
              "agreement JAX vs HF; 1st diff = mean first\ndiffering position among differing rows.\n"
              f"load average (1 min) at start / end: {load0[0]:.2f} / {load1[0]:.2f} on {threads} cpus")

    if args.breakdown:
        print("\nJAX breakdown (median s):")
        wide_slots = 4 * (args.prompt_len + args.new)
        print(f"{'batch':>5} | {'gen new=1':>9} | {f'gen new={args.new}':>10} | {'per token':>9} | "
              f"{f'per token, {wide_slots} slots':>21} | {'1 decode step':>13} | {'step GFLOP (XLA)':>16}")
        for b in args.batch:
            r = breakdown(model, engine, cfg, b, args.prompt_len, args.new, args.iters)
            gf = f"{r['step_flops'] / 1e9:16.4f}" if r["step_flops"] else f"{'n/a':>16}"
            print(f"{b:>5} | {r[1]:9.4f} | {r[args.new]:10.4f} | {r['per_token']:9.5f} | "
                  f"{r['per_token_wide']:21.5f} | {r['step']:13.5f} | {gf}")
        print(f"per token = one of {args.new} decode steps in a loop that carries a cache of "
              f"{args.prompt_len + args.new} slots (scripts/bench_decode_step.py's loop);\nper token, {wide_slots} "
              "slots = the same with a 4x longer cache;\n1 decode step = the model's single-token forward with the "
              "cache, jitted alone.")

    if args.profile:
        for b in args.batch:
            profile_generate(engine, mc, b, args.prompt_len, args.new)

    if args.ablate:
        res = ablate(args.variant, args.batch, args.prompt_len, args.new, args.iters)
        print("\nJAX decode step ablation (one jitted single-token step with the cache; round-robin):")
        print(f"{'model':<27} | {'batch':>5} | {'median ms':>9} | {'min ms':>7} | {'XLA GFLOP':>9}")
        for (name, b), (med, mn, fl) in res.items():
            gf = f"{fl / 1e9:9.4f}" if fl else f"{'n/a':>9}"
            print(f"{name:<27} | {b:>5} | {med * 1e3:9.2f} | {mn * 1e3:7.2f} | {gf}")
        print(f"load average (1 min) now: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
