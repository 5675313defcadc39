"""Remat policies in the plan (`model.remat_policy`): what a rematerialised layer's backward multiplies again,
and what it keeps from its forward besides the layer's input.

    python -m m3jax.plan.remat     XLA:CPU's compiled FLOPs and temporaries of a small model's gradient, per
                                   policy, next to this module's figures (a minute on a shared 2-core CPU)

Under remat the backward of a layer re-runs only the forward ops whose values some backward op reads (jax
drops the rest), so even "full" does not recompute everything:

    full       every projection whose output a backward reads: q/k/v/o (the o output makes the residual sum
               the MLP part normalises), the indexer's q/k, the router, the dense MLP's and shared expert's
               gate/up, and the routed experts whole (the router weights' gradient reads each expert's
               output). Not the dense MLP's and shared expert's down projections: their outputs only join
               the residual stream, which the layer scan saves as the next layer's input (XLA:CPU: the
               gradient of a dense-MLP layer under full remat re-runs its gate/up, not its down).
    save_dots  keeps the outputs of the matmuls without batch dimensions (`dots_with_no_batch_dims_saveable`):
               all of the above but the routed experts, whose grouped matmuls run in the tiled kernel's loop
               (or as ragged_dot, not a dot_general), so their forward runs again. The attention core's and
               the indexer's scores are batched matmuls: recomputed under both policies.
    Every policy keeps the gather sparse layers' block ids (`m3jax.model.sparse.INDEX_BLOCK_IDS`, [T, Hi, K]
    int32): nothing of the indexer (q/k projections, scores, top-k) runs again, under any policy. The masked
    sparse path (the oracle) keeps no ids: its indexer runs again as written below.
    save_dots_experts  save_dots and the routed experts' output rows (`sharding.expert.MOE_EXPERT_OUT`, named
               in `combine`: T * k rows of d per MoE layer), the values the router weights' gradient reads. The
               experts' forward then runs again only for what their own backward needs: nothing under the tiled
               kernel (a custom VJP whose residuals are its inputs; its backward recomputes gate/up itself,
               `m3jax.plan.flops.expert_recompute`), the gate/up projections under ragged_dot (the activation's
               and the down projection's gradients read them; the down projection is not re-run).
"""

from __future__ import annotations

from m3jax.config import MOE_MLP, SPARSE_ATTENTION, M3Config

# m3jax.model.remat.REMAT_POLICIES (tests check they agree)
REMAT_POLICIES = ("full", "save_dots", "save_dots_experts")


def trains_as(sparse_attention: str) -> str:
    """The sparse layers' path in a training step: "paged" runs its forward-only passes on the paged kernel
    (`m3jax.model.paged_sparse`) and everything differentiated through "gather", so it plans as gather."""
    return "gather" if sparse_attention == "paged" else sparse_attention


def _check(policy: str) -> None:
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={policy!r}: expected one of {REMAT_POLICIES}")


def recomputed_params(cfg: M3Config, policy: str = "full", expert_matmul: str = "ragged_dot",
                      sparse_attention: str = "gather") -> dict[str, int]:
    """Weights one token multiplies through again in the remat forward, summed over layers (2 FLOPs each):

        full       "layer": L * (2 H D d + 2 KV D d) + L_dense * 2 Id d + L_moe * (E d + 2 Is d)
                   "indexer": L_sparse * (Hi + 1) Di d under sparse_attention "masked" (gather keeps the
                   block ids: 0)                          "routed": L_moe * k * 3 I d
        save_dots  "routed" only
        save_dots_experts  "routed": L_moe * k * 2 I d under ragged_dot (gate/up) and the bucketed kernel (its
                   buckets' einsums are dots like ragged_dot's: small_config, seq 64, XLA saves 2.46e6 FLOPs against
                   this count's 2.10e6 plus one 8-row trip of its overflow walk, 0.39e6; XLA also keeps the buckets'
                   activation, G C I per MoE layer, which `saved_bytes_per_token` does not count), 0 under the
                   tiled kernel
    (expert_matmul: `Batch.expert_matmul`, "tiled", "bucketed" or "ragged_dot"; "routed" is scaled by the
    kernel's executed rows in `m3jax.plan.flops.step_flops`.)"""
    _check(policy)
    d = cfg.hidden_size
    routed_mats = 3 if policy != "save_dots_experts" else (0 if expert_matmul == "tiled" else 2)
    out = dict.fromkeys(("layer", "indexer", "routed"), 0)
    for attn, mlp in zip(cfg.layer_types, cfg.mlp_layer_types):
        out["routed"] += cfg.num_experts_per_tok * routed_mats * cfg.intermediate_size * d if mlp == MOE_MLP else 0
        if policy != "full":
            continue
        out["layer"] += (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * d
        out["layer"] += (cfg.num_local_experts + 2 * cfg.shared_intermediate_size) * d if mlp == MOE_MLP \
            else 2 * cfg.dense_intermediate_size * d
        if attn == SPARSE_ATTENTION and trains_as(sparse_attention) != "gather":
            out["indexer"] += (cfg.index_n_heads + 1) * cfg.index_head_dim * d
    return out


def exchange_recompute_trips(policy: str = "full") -> int:
    """Expert all-to-all trips a rematerialised MoE layer's backward makes again, per micro-batch: 2 (the rows out to
    the experts and back) under full and save_dots; 1 under save_dots_experts, which keeps the rows that came back
    and sends the rows out again only for the experts' own backward (the compiled step: 5 trips to full's 6,
    tests/test_plan.py)."""
    _check(policy)
    return 1 if policy == "save_dots_experts" else 2


def saved_bytes_per_token(cfg: M3Config, attn: str, mlp: str, tensor: int = 1, a: int = 2,
                          policy: str = "full", sparse_attention: str = "gather") -> float:
    """Bytes one layer keeps per local token for its backward beyond its input. Every policy, sparse layers
    on the gather path: 4 Hi K [the indexer's block ids, int32]. save_dots adds

        a * (H_l D [q] + 2 KV_l D [k, v] + d [o projection])  + masked sparse layers a * (Hi Di + Di) [indexer
        q, k: the gather path's backward never reads them] + MoE layers 4 E [router logits, fp32]
        + a * 2 Is / n_t [shared gate/up];  dense layers a * 2 Id / n_t
    save_dots_experts: + MoE layers a * k * d [the experts' output rows, whole d on every tensor rank]
    (H_l = H / n_t, KV_l = max(KV / n_t, 1); XLA:CPU kept 0.95x this on the small model of `main`)."""
    _check(policy)
    ids = attn == SPARSE_ATTENTION and trains_as(sparse_attention) == "gather"
    out = 4.0 * cfg.index_n_heads * cfg.index_topk_blocks if ids else 0.0
    if policy == "full":
        return out
    kv_l = max(cfg.num_key_value_heads / tensor, 1)
    out += a * ((cfg.num_attention_heads / tensor + 2 * kv_l) * cfg.head_dim + cfg.hidden_size)
    if attn == SPARSE_ATTENTION and not ids:
        out += a * (cfg.index_n_heads + 1) * cfg.index_head_dim
    if mlp == MOE_MLP:
        out += 4 * cfg.num_local_experts + a * 2 * cfg.shared_intermediate_size / tensor
        if policy == "save_dots_experts":
            out += a * cfg.num_experts_per_tok * cfg.hidden_size
    else:
        out += a * 2 * cfg.dense_intermediate_size / tensor
    return out


def saved_residuals(cfg: M3Config, tokens_local: int, tensor: int = 1, a: int = 2, policy: str = "full",
                    sparse_attention: str = "gather") -> float:
    """Bytes every layer's kept values hold per device, live from the forward until that layer's backward (so
    all of them at the head's backward): tokens_local * sum over layers of `saved_bytes_per_token`."""
    return tokens_local * sum(saved_bytes_per_token(cfg, t, m, tensor, a, policy, sparse_attention)
                              for t, m in zip(cfg.layer_types, cfg.mlp_layer_types))


# ----------------------------------------------------------------------------------------- XLA's view

def small_config(moe_layers: int = 2) -> M3Config:
    """A full-attention dense layer, then `moe_layers` sparse MoE layers (one scan): the check's model."""
    return M3Config(vocab_size=512, hidden_size=128, num_hidden_layers=1 + moe_layers, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, intermediate_size=64, dense_intermediate_size=256,
                    shared_intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                    layer_types=["full_attention"] + ["minimax_m3_sparse"] * moe_layers,
                    mlp_layer_types=["dense"] + ["sparse"] * moe_layers, partial_rotary_factor=0.5,
                    index_n_heads=2, index_head_dim=32, index_block_size=16, index_topk_blocks=2)


def compiled_cost(cfg: M3Config, seq: int, remat: bool, policy: str, **options) -> dict[str, float]:
    """XLA's 'flops' and temp bytes of jit(grad) of a loss on the logits of one fp32 sequence. XLA counts a
    loop body once (not x its trips), so compare policies on the same model, not models of other depths."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from m3jax.model.decoder import M3ForCausalLM
    model = M3ForCausalLM(cfg, rngs=nnx.Rngs(0), remat=remat, remat_policy=policy, **options)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.arange(seq, dtype=jnp.int32)[None] % cfg.vocab_size
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(ids).astype(jnp.float32) ** 2)  # noqa: E731
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"flops": float(cost["flops"]), "temp": float(compiled.memory_analysis().temp_size_in_bytes)}


def check(seq: int = 64, options: dict | None = None) -> dict[str, float]:
    """full vs save_dots on `small_config`, both sides: XLA's FLOPs saved by save_dots against
    2 * seq * (the recomputed weights save_dots drops), and XLA's extra temporaries per MoE layer (from 2 to 4
    MoE layers: the scan's per-layer slope) against `saved_bytes_per_token` * seq at fp32."""
    opts = options or {}
    cost = {(n, p): compiled_cost(small_config(n), seq, True, p, **opts) for n in (2, 4)
            for p in ("full", "save_dots")}
    cfg = small_config(1)  # XLA counts the MoE scan's body once: one MoE layer's weights
    dropped = {k: v - recomputed_params(cfg, "save_dots")[k] for k, v in recomputed_params(cfg, "full").items()}
    slope = ((cost[4, "save_dots"]["temp"] - cost[2, "save_dots"]["temp"])
             - (cost[4, "full"]["temp"] - cost[2, "full"]["temp"])) / 2
    return {"xla_flops_saved": cost[2, "full"]["flops"] - cost[2, "save_dots"]["flops"],
            "plan_flops_saved": 2 * seq * sum(dropped.values()),
            "xla_saved_bytes_per_moe_layer": slope,
            "plan_saved_bytes_per_moe_layer": seq * (saved_bytes_per_token(cfg, SPARSE_ATTENTION, MOE_MLP, 1, 4,
                                                                           "save_dots")
                                                     - saved_bytes_per_token(cfg, SPARSE_ATTENTION, MOE_MLP, 1, 4)),
            **{f"xla_flops_{p}": cost[2, p]["flops"] for p in ("full", "save_dots")}}


def while_loops(cfg: M3Config, seq: int, policy: str, **options) -> int:
    """While loops in XLA:CPU's compiled jit(grad) of `compiled_cost`'s loss (the layer scans, the tiled
    kernel's walks: one per tiled forward or backward a layer body runs)."""
    import re

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from m3jax.model.decoder import M3ForCausalLM
    model = M3ForCausalLM(cfg, rngs=nnx.Rngs(0), remat=True, remat_policy=policy, **options)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.arange(seq, dtype=jnp.int32)[None] % cfg.vocab_size
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(ids).astype(jnp.float32) ** 2)  # noqa: E731
    return len(re.findall(r"\bwhile\(", jax.jit(jax.grad(loss)).lower(params).compile().as_text()))


def check_experts(seq: int = 64, kernel: str = "ragged_dot", options: dict | None = None) -> dict[str, float]:
    """save_dots vs save_dots_experts on `small_config` with the routed experts on `kernel`: XLA's FLOPs saved
    against the plan's, and XLA's extra temporaries per MoE layer (the 2 -> 4 MoE layers slope) against
    seq * a * k * d at fp32 (the kept expert output rows).
        ragged_dot  plan: 2 * seq * (routed weights save_dots re-runs minus those save_dots_experts re-runs),
                    one MoE layer (XLA counts the scan's body once): the down projection, k * I * d, times
                    XLA:CPU's dense lowering of ragged_dot (every expert multiplies every row: E, `expert_rows_factor`)
        tiled       XLA counts a while loop's body once, so dropping the remat forward's tiled walk saves one
                    trip of it: 2 * tile * 3 I d (tile = min(DEFAULT_TILE, seq * k) rows); the compiled
                    program also has one while loop fewer per MoE layer body ("xla_while_*")."""
    from sharding.grouped_matmul import DEFAULT_TILE
    opts = {**(options or {}), "moe_kernel": kernel}
    pols = ("save_dots", "save_dots_experts")
    cost = {(n, p): compiled_cost(small_config(n), seq, True, p, **opts) for n in (2, 4) for p in pols}
    cfg = small_config(1)
    if kernel == "tiled":
        tile = min(DEFAULT_TILE, seq * cfg.num_experts_per_tok)
        plan = 2 * tile * 3 * cfg.intermediate_size * cfg.hidden_size
    else:
        rows = cfg.num_local_experts  # `m3jax.plan.flops.expert_rows_factor`, dense lowering, one device
        plan = 2 * seq * rows * (recomputed_params(cfg, "save_dots", kernel)["routed"]
                                 - recomputed_params(cfg, "save_dots_experts", kernel)["routed"])
    slope = ((cost[4, pols[1]]["temp"] - cost[2, pols[1]]["temp"])
             - (cost[4, pols[0]]["temp"] - cost[2, pols[0]]["temp"])) / 2
    kept = seq * (saved_bytes_per_token(cfg, SPARSE_ATTENTION, MOE_MLP, 1, 4, pols[1])
                  - saved_bytes_per_token(cfg, SPARSE_ATTENTION, MOE_MLP, 1, 4, pols[0]))
    out = {"xla_flops_saved": cost[2, pols[0]]["flops"] - cost[2, pols[1]]["flops"], "plan_flops_saved": plan,
           "xla_saved_bytes_per_moe_layer": slope, "plan_saved_bytes_per_moe_layer": kept}
    out.update({f"xla_while_{p}": while_loops(small_config(2), seq, p, **opts) for p in pols})
    return out


def check_full(seq: int = 64) -> dict[str, float]:
    """full remat vs none on one full-attention dense-MLP layer with a wide MLP (Id 2048, so the down
    projection would show): XLA's extra FLOPs against the plan's 2 * seq * `recomputed_params` + the dense
    attention's scores again (4 H D S^2), and against the same with the down projection counted too."""
    import dataclasses
    cfg = dataclasses.replace(small_config(0), vocab_size=64, dense_intermediate_size=2048)
    xla = {r: compiled_cost(cfg, seq, r, "full")["flops"] for r in (False, True)}
    again = recomputed_params(cfg, "full")
    plan = 2 * seq * sum(again.values()) + 4 * cfg.num_attention_heads * cfg.head_dim * seq * seq
    return {"xla_remat_flops": xla[True] - xla[False], "plan_remat_flops": plan,
            "plan_with_down": plan + 2 * seq * cfg.dense_intermediate_size * cfg.hidden_size}


def main(argv=None) -> int:
    import argparse
    argparse.ArgumentParser(prog="python -m m3jax.plan.remat",
                            description="XLA:CPU's compiled FLOPs and temporaries of a small model's gradient under "
                                        "each model.remat_policy, next to the planner's figures (no options; a "
                                        "minute on a 2-core CPU)").parse_args(argv)
    r = check_full()
    print(f"full remat, one dense layer (Id 2048): extra FLOPs XLA {r['xla_remat_flops']:.4e} vs plan "
          f"{r['plan_remat_flops']:.4e} ({r['plan_remat_flops'] / r['xla_remat_flops']:.2f}); counting the down "
          f"projection too would be {r['plan_with_down']:.4e} ({r['plan_with_down'] / r['xla_remat_flops']:.2f})")
    for name, opts in (("dense attention, ragged_dot experts", {"moe_kernel": "ragged_dot"}),
                       ("flash attention, tiled experts (the recipes')", {"attention_impl": "flash",
                                                                          "moe_kernel": "tiled"})):
        r = check(options=opts)
        print(f"{name}: FLOPs saved by save_dots XLA {r['xla_flops_saved']:.4e} vs plan "
              f"{r['plan_flops_saved']:.4e} ({r['plan_flops_saved'] / r['xla_flops_saved']:.2f}); kept bytes per "
              f"MoE layer XLA {r['xla_saved_bytes_per_moe_layer']:.0f} vs plan "
              f"{r['plan_saved_bytes_per_moe_layer']:.0f} "
              f"({r['plan_saved_bytes_per_moe_layer'] / max(r['xla_saved_bytes_per_moe_layer'], 1):.2f})")
    for name, kernel, opts in (("dense attention, ragged_dot experts", "ragged_dot", {}),
                               ("flash attention, tiled experts (the recipes')", "tiled", {"attention_impl": "flash"})):
        r = check_experts(kernel=kernel, options=opts)
        print(f"{name}: FLOPs saved by save_dots_experts over save_dots XLA {r['xla_flops_saved']:.4e} vs plan "
              f"{r['plan_flops_saved']:.4e} ({r['plan_flops_saved'] / r['xla_flops_saved']:.2f}); kept bytes per MoE "
              f"layer XLA {r['xla_saved_bytes_per_moe_layer']:.0f} vs plan {r['plan_saved_bytes_per_moe_layer']:.0f} "
              f"({r['plan_saved_bytes_per_moe_layer'] / max(r['xla_saved_bytes_per_moe_layer'], 1):.2f}); while "
              f"loops {r['xla_while_save_dots']} -> {r['xla_while_save_dots_experts']}")
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
