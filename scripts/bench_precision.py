"""Persistent training-state bytes per parameter for each precision mode of `sharding.precision`.

A tiny random M3 (`m3jax.tiny.m3_model(m3_config(...), dtype=...)`: 1 full-attention dense layer, then
3 sparse-attention MoE layers) is split into a TrainState with `sharding.train_step.init_state` for each
mode below; the bytes are summed over the ACTUAL arrays of `state.params` + `state.opt_state` (nbytes of
every leaf), leaving out scalar counters (Adam's step count, and the TrainState's step / skipped), and
divided by the number of trainable parameters (elements of `state.params`). The non-trainable
`state.rest` (the router correction bias, fp32) is not optimizer state and is reported separately.

    (a) fp32 params, Adam fp32 moments, master "none"             reference 12 B/param (4 + 4 + 4)
    (b) bf16 params, fp32 master, fp32 moments ("fp32")                      14 (2 + 4 + 4 + 4)
    (c) bf16 params, fp32 master, bf16 moments ("fp32")  NeMo-RL M3 recipe   10 (2 + 4 + 2 + 2)
    (d) bf16 params, "compact" (int16 remainder), fp32 moments               12 (2 + 2 + 4 + 4)
    (e) bf16 params, "compact", bf16 moments             target               8 (2 + 2 + 2 + 2)
    (f) pure bf16 params, bf16 moments, master "none"                          6 (2 + 2 + 2)

The router weight [E, d] is kept fp32 even in bf16 models (ParamSpec fp32=True), and in the master
modes its "master" is a plain fp32 copy (an fp32 param has no 16-bit remainder), so the router costs
4 + 4 + moments bytes per element whatever the mode; the script prints its share and the figure with
the router left out (= the pure per-mode formula). It also runs one train step per mode
(donate=False) and checks that the state after the step has the same bytes (no dtype drift).

    .venv/bin/python scripts/bench_precision.py
    .venv/bin/python scripts/bench_precision.py --no-step      # bytes only, no compile
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from m3jax import M3Config  # noqa: E402
from m3jax.tiny import m3_config, m3_model  # noqa: E402
from sharding import optim_step, precision  # noqa: E402
from sharding.train_step import init_state, make_train_step  # noqa: E402

MODES = [  # name, param dtype, master, moment dtype, expected B/param, note
    ("a", jnp.float32, "none", jnp.float32, 12, "fp32 params + Adam fp32 (reference 12)"),
    ("b", jnp.bfloat16, "fp32", jnp.float32, 14, "bf16 + fp32 master + fp32 moments"),
    ("c", jnp.bfloat16, "fp32", jnp.bfloat16, 10, "bf16 + fp32 master + bf16 moments (NeMo-RL M3 recipe, 10)"),
    ("d", jnp.bfloat16, "compact", jnp.float32, 12, "bf16 + compact + fp32 moments"),
    ("e", jnp.bfloat16, "compact", jnp.bfloat16, 8, "bf16 + compact + bf16 moments (target 8)"),
    ("f", jnp.bfloat16, "none", jnp.bfloat16, 6, "pure bf16 params + bf16 moments"),
]


def tiny_cfg(hidden: int = 128, experts: int = 8) -> M3Config:
    return m3_config(hidden_size=hidden, num_local_experts=experts)  # 4 layers: full + dense, 3 x sparse + MoE


def leaves_with_path(tree):
    return [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(tree)]


def state_bytes(params, opt_state):
    """(total bytes, bytes of router-weight leaves, router elements, bytes by dtype, scalar bytes left out)."""
    total = router = scalars = 0
    by_dtype: dict[str, int] = {}
    for tree in (params, opt_state):
        for path, x in leaves_with_path(tree):
            if np.ndim(x) == 0:
                scalars += x.nbytes
                continue
            total += x.nbytes
            by_dtype[str(x.dtype)] = by_dtype.get(str(x.dtype), 0) + x.nbytes
            if "'router'" in path:
                router += x.nbytes
    return total, router, scalars, by_dtype


def make_batch(cfg, micro=2, per_micro=2, seq=64, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, cfg.vocab_size, size=(micro, per_micro, seq + 1)).astype(np.int32)
    return {"input_ids": jnp.asarray(ids[..., :-1]), "targets": jnp.asarray(ids[..., 1:]),
            "loss_mask": jnp.ones((micro, per_micro, seq), jnp.float32)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--no-step", action="store_true", help="skip the one-train-step dtype-drift check")
    args = ap.parse_args()
    cfg = tiny_cfg(args.hidden, args.experts)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}; tiny M3: hidden {cfg.hidden_size}, "
          f"{cfg.num_hidden_layers} layers {cfg.mlp_layer_types}, {cfg.num_local_experts} experts, vocab "
          f"{cfg.vocab_size}")
    rows = []
    for name, dtype, master, mom, expected, note in MODES:
        model = m3_model(cfg, seed=0, dtype=dtype)
        opt = optim_step.adamw(1e-3, weight_decay=0.1, moment_dtype=mom, master=master)
        graphdef, state = init_state(model, opt)
        n = sum(x.size for x in jax.tree.leaves(state.params))
        n_router = sum(x.size for p, x in leaves_with_path(state.params) if "'router'" in p)
        total, router, scalars, by_dtype = state_bytes(state.params, state.opt_state)
        rest = sum(x.nbytes for x in jax.tree.leaves(state.rest))
        scalars += state.step.nbytes + state.skipped.nbytes
        after = None
        if not args.no_step:
            step = make_train_step(graphdef, opt, donate=False)
            new, metrics = step(state, make_batch(cfg))
            jax.block_until_ready(new)
            assert not bool(metrics["skipped"]), name
            after = state_bytes(new.params, new.opt_state)[0] / n
        rows.append(dict(name=name, note=note, n=n, n_router=n_router, bpp=total / n, expected=expected,
                         bpp_no_router=(total - router) / (n - n_router), router_bpe=router / n_router,
                         by_dtype=by_dtype, scalars=scalars, rest=rest, after=after))

    n, nr = rows[0]["n"], rows[0]["n_router"]
    print(f"\ntrainable parameters: {n:,} (router weights {nr:,} = {100 * nr / n:.3f}%, kept fp32 in every mode); "
          f"router correction bias (non-trainable state.rest, fp32): {rows[0]['rest']} B, not counted\n")
    hdr = (f"{'mode':<4} {'B/param':>9} {'expected':>8} {'w/o router':>10} {'router B/el':>11} "
           f"{'after 1 step':>12}  description")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        after = "skipped" if r["after"] is None else f"{r['after']:.4f}"
        print(f"({r['name']})  {r['bpp']:>9.4f} {r['expected']:>8} {r['bpp_no_router']:>10.4f} "
              f"{r['router_bpe']:>11.0f} {after:>12}  {r['note']}")
    print("\nbytes by dtype (params + opt_state, non-scalar leaves):")
    for r in rows:
        print(f"  ({r['name']}) " + ", ".join(f"{k}: {v:,}" for k, v in sorted(r["by_dtype"].items()))
              + f"   [scalar counters left out: {r['scalars']} B]")
    print("\nreferences: 12 B/param fp32 + Adam; 10 B/param NeMo-RL M3 recipe (bf16 + fp32 master + bf16 "
          "moments); target 8 B/param (compact + bf16 moments).")
    print("The excess over the formula is the fp32 router: 4 B param + 4 B fp32 'master' copy (in master "
          "modes) + moments, i.e. 12 B/el in (a, c, e), 16 in (b, d), 8 in (f); for the full M3 the router "
          "is a far smaller share than in this tiny model.")


if __name__ == "__main__":
    main()
