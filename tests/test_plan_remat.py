"""The planner's model of model.remat_policy (m3jax.plan.remat): hand counts, and XLA:CPU's compiled figures."""

import pytest

from m3jax.config import MOE_MLP, SPARSE_ATTENTION
from m3jax.model.decoder import REMAT_POLICIES as MODEL_POLICIES
from m3jax.plan.flops import step_flops
from m3jax.plan.memory import Batch, activation_bytes
from m3jax.plan.remat import REMAT_POLICIES, recomputed_params, saved_bytes_per_token, small_config
from sharding.mesh import MeshConfig

CFG = small_config(2)  # d 128, H 4 x 32, KV 2, Id 256, Is 64, I 64, E 8, k 2, indexer 2 x 32


def test_policies_mirror_the_model():
    assert REMAT_POLICIES == MODEL_POLICIES


def test_recomputed_params_hand_count():
    d = 128
    attn = (2 * 4 + 2 * 2) * 32 * d                      # q, o (4 heads) and k, v (2 kv heads) of 32
    full = recomputed_params(CFG, "full")
    assert full["layer"] == 3 * attn + 2 * 256 * d + 2 * (8 * d + 2 * 64 * d)  # dense and shared: gate/up only
    assert full["indexer"] == 0  # the gather path keeps the block ids: its indexer never runs again
    assert recomputed_params(CFG, "full", sparse_attention="masked")["indexer"] == 2 * (2 + 1) * 32 * d
    assert full["routed"] == 2 * 2 * 3 * 64 * d
    assert recomputed_params(CFG, "save_dots") == {"layer": 0, "indexer": 0, "routed": full["routed"]}
    # save_dots_experts: the kept expert rows spare the down projection (ragged_dot: gate/up run again for the
    # experts' own backward) or the whole walk (tiled: its custom VJP saves only its inputs)
    assert recomputed_params(CFG, "save_dots_experts", "ragged_dot") == {"layer": 0, "indexer": 0,
                                                                         "routed": 2 * 2 * 2 * 64 * d}
    assert recomputed_params(CFG, "save_dots_experts", "tiled") == {"layer": 0, "indexer": 0, "routed": 0}
    assert recomputed_params(CFG, "save_dots", "tiled") == recomputed_params(CFG, "save_dots")
    with pytest.raises(ValueError, match="remat_policy"):
        recomputed_params(CFG, "dots")


def test_step_flops_follow_the_policy():
    seqs, s = 3, 64
    n = seqs * s
    full = step_flops(CFG, seqs, s, True, remat_policy="full")
    dots = step_flops(CFG, seqs, s, True, remat_policy="save_dots")
    again = recomputed_params(CFG, "full")
    assert dots["model_total"] == full["model_total"]
    assert full["executed_total"] - dots["executed_total"] == 2 * n * (again["layer"] + again["indexer"])
    assert dots["attention_executed"] == full["attention_executed"]  # the attention core is recomputed under both
    assert dots["indexer_proj_executed"] == dots["indexer_proj"] == full["indexer_proj_executed"]
    masked = step_flops(CFG, seqs, s, True, remat_policy="full", sparse_attention="masked")
    assert masked["indexer_proj_executed"] == 2 * masked["indexer_proj"]  # no kept ids: the projections again
    for f in (full, dots):
        assert f["matmul_executed"] + f["attention_executed"] + f["indexer_executed"] \
            + f["indexer_proj_executed"] == f["executed_total"]
    for kernel, rows in (("tiled", 1.25), ("ragged_dot", 1.0)):
        dots_k = step_flops(CFG, seqs, s, True, remat_policy="save_dots", expert_matmul=kernel, expert_rows=rows)
        experts = step_flops(CFG, seqs, s, True, remat_policy="save_dots_experts", expert_matmul=kernel,
                             expert_rows=rows)
        routed = recomputed_params(CFG, "save_dots")["routed"] \
            - recomputed_params(CFG, "save_dots_experts", kernel)["routed"]
        assert dots_k["executed_total"] - experts["executed_total"] == pytest.approx(2 * n * routed * rows)
        assert experts["attention_executed"] == dots_k["attention_executed"]
    no_remat = step_flops(CFG, seqs, s, False, remat_policy="save_dots")
    assert no_remat == step_flops(CFG, seqs, s, False)  # the policy means nothing without remat


def test_saved_residuals_term():
    mesh = MeshConfig(2, 1, 1, 1)
    batch = Batch(2, 64, remat=True, remat_policy="save_dots")
    t_l = 2 * 64
    ids = 4 * 2 * 2  # every policy: the block ids, int32 [Hi 2, K 2] per token of a gather sparse layer
    per_moe = 2 * ((4 + 2 * 2) * 32 + 128) + 4 * 8 + 2 * 2 * 64 + ids  # q, k, v, o, router, shared, ids
    assert saved_bytes_per_token(CFG, SPARSE_ATTENTION, MOE_MLP, 1, 2, "save_dots") == per_moe
    # the masked path keeps the indexer's q, k under save_dots instead (its backward runs the indexer again)
    assert saved_bytes_per_token(CFG, SPARSE_ATTENTION, MOE_MLP, 1, 2, "save_dots", "masked") \
        == per_moe - ids + 2 * 3 * 32
    per_dense = 2 * ((4 + 2 * 2) * 32 + 128) + 2 * 2 * 256
    got = activation_bytes(CFG, mesh, batch, 2)["saved_residuals"]
    assert got == t_l * (per_dense + 2 * per_moe)
    assert activation_bytes(CFG, mesh, Batch(2, 64, remat=True), 2)["saved_residuals"] == t_l * 2 * ids  # full
    assert activation_bytes(CFG, mesh, Batch(2, 64, remat=True, sparse_attention="masked"), 2
                            )["saved_residuals"] == 0
    assert Batch(2, 64, remat_policy="save_dots").model_options()["remat_policy"] == "save_dots"
    per_moe_experts = per_moe + 2 * 2 * 128  # + the experts' output rows: k rows of d per token
    assert saved_bytes_per_token(CFG, SPARSE_ATTENTION, MOE_MLP, 1, 2, "save_dots_experts") == per_moe_experts
    assert saved_bytes_per_token(CFG, SPARSE_ATTENTION, MOE_MLP, 2, 2, "save_dots_experts") \
        - saved_bytes_per_token(CFG, SPARSE_ATTENTION, MOE_MLP, 2, 2, "save_dots") == 2 * 2 * 128  # whole d per rank
    experts = activation_bytes(CFG, mesh, Batch(2, 64, remat=True, remat_policy="save_dots_experts"), 2)
    assert experts["saved_residuals"] == t_l * (per_dense + 2 * per_moe_experts)


@pytest.mark.extended  # ~45 s idle; `python -m m3jax.plan.remat` prints the same comparison
@pytest.mark.slow  # eight gradient compiles of the small model (~100 s on the shared 2-core CPU)
@pytest.mark.xla_defaults  # what XLA keeps is what a user's run keeps: the suite's faster-compiling emitters-off
# codegen keeps 20 bytes a token fewer on the flash + tiled path since sparse attention re-gathers its keys in the
# backward (eee4b07), 0.744 of the plan there (found by a helper running the extended tests, session 36)
def test_plan_matches_xla_on_the_small_model():
    """XLA:CPU's FLOPs saved by save_dots within 3 % of the plan's (BENCHMARKS.md: 1.01 on both paths); the
    bytes it keeps per MoE layer within the plan's bound (1.00 on the ragged_dot path; 0.754 of it on the
    recipes' flash + tiled path, where XLA keeps one 128-wide fp32 value fewer per token than the plan's 2,080
    bytes: (2080 - 512) / 2080, since every remat policy keeps the indexer's block ids, 3b095de)."""
    from m3jax.plan.remat import check
    for options, low in (({"moe_kernel": "ragged_dot"}, 0.97), ({"attention_impl": "flash", "moe_kernel": "tiled"},
                                                                  0.75)):
        r = check(options=options)
        assert 0.97 < r["plan_flops_saved"] / r["xla_flops_saved"] < 1.03
        assert low <= r["xla_saved_bytes_per_moe_layer"] / r["plan_saved_bytes_per_moe_layer"] <= 1.03
        assert r["xla_flops_save_dots"] < r["xla_flops_full"]


@pytest.mark.slow  # two gradient compiles (~20 s)
def test_full_remat_does_not_recompute_the_down_projection():
    from m3jax.plan.remat import check_full
    r = check_full()
    assert 0.95 < r["plan_remat_flops"] / r["xla_remat_flops"] < 1.03
    assert r["plan_with_down"] / r["xla_remat_flops"] > 1.3


@pytest.mark.extended  # ~55 s idle; `python -m m3jax.plan.remat` prints the same comparison
@pytest.mark.slow  # eight gradient compiles and four while-loop counts of the small model (~6 min on the shared CPU)
def test_save_dots_experts_matches_xla_on_the_small_model():
    """XLA:CPU's FLOPs saved by save_dots_experts over save_dots match the plan's (ragged_dot: the down projection;
    tiled: one trip of the remat forward's walk, which XLA counts once); the compiled tiled program has one while
    loop fewer per MoE layer body; the kept bytes per MoE layer at least the plan's T * k * d."""
    from m3jax.plan.remat import check_experts
    for kernel, opts in (("ragged_dot", {}), ("tiled", {"attention_impl": "flash"})):
        r = check_experts(kernel=kernel, options=opts)
        assert 0.97 < r["plan_flops_saved"] / r["xla_flops_saved"] < 1.03, (kernel, r)
        assert r["xla_saved_bytes_per_moe_layer"] >= 0.97 * r["plan_saved_bytes_per_moe_layer"], (kernel, r)
        if kernel == "tiled":
            assert r["xla_while_save_dots_experts"] < r["xla_while_save_dots"], r
