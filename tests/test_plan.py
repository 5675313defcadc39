"""The mesh planner's models: analytic FLOPs vs a hand count, analytic memory vs XLA, the recipe, the abstract-mesh
sharding check (the command's sweep and verdicts: tests/test_plan_command.py)."""

import dataclasses

import jax
import pytest

from m3jax.config import M3Config
from sharding.mesh import MeshConfig
from m3jax.plan.job import invalid_reason, load_job, plan
from m3jax.plan.__main__ import verdict
from m3jax.plan.flops import Hardware, causal_pairs, step_flops
from m3jax.plan.memory import GB, Batch, memory_plan, param_counts
from m3jax.plan.models import m3_release

TINY = M3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=32, dense_intermediate_size=128, shared_intermediate_size=32,
                num_local_experts=8, num_experts_per_tok=2, layer_types=["full_attention", "minimax_m3_sparse"],
                mlp_layer_types=["dense", "sparse"], partial_rotary_factor=0.5, index_n_heads=2, index_head_dim=16,
                index_block_size=8, index_topk_blocks=2)


def test_flops_hand_count():
    seqs, s = 3, 32
    n = seqs * s
    d = 64
    attn_params = 4 * 16 * d + 2 * 16 * d + 2 * 16 * d + d * 4 * 16      # q 4096 + k 2048 + v 2048 + o 4096 = 12288 per layer
    dense = 3 * 128 * d                                                  # 24576
    moe = 2 * 3 * 32 * d + 3 * 32 * d + 8 * d                            # top-2 routed + shared + router = 18944
    head = 256 * d                                                       # 16384
    matmul = 6 * (2 * attn_params + dense + moe + head) * n
    indexer_proj = 2 * (2 * 16 + 16) * d * n                             # forward only
    full_pairs = 32 * 33 // 2                                            # 528 causal pairs
    sparse_pairs = 16 * 17 // 2 + (32 - 16) * 16                         # window 2 blocks x 8 = 16 keys: 136 + 256
    attention = 12 * 4 * 16 * (full_pairs + sparse_pairs) * seqs
    indexer_scores = 2 * 2 * 16 * full_pairs * seqs
    f = step_flops(TINY, seqs, s, remat=False, sparse_attention="masked")
    assert causal_pairs(32, 16) == 392
    assert f["matmul"] == matmul == 6 * 84480 * 96
    assert f["indexer_proj"] == indexer_proj
    assert f["attention"] == attention
    assert f["indexer_scores"] == indexer_scores
    assert f["model_total"] == matmul + indexer_proj + attention + indexer_scores
    masked = dict(sparse_attention="masked")
    assert step_flops(TINY, seqs, s, remat=True, **masked)["executed_total"] > f["executed_total"] > f["model_total"]
    remat = step_flops(TINY, seqs, s, remat=True, **masked)["executed_total"]
    full_fwd = 4 * 4 * 16 * s * s * 2 * seqs                             # QK^T and PV over the [S, S] block, 2 layers
    idx_fwd = 2 * 2 * 16 * s * s * seqs                                  # one sparse layer
    chunked = step_flops(TINY, seqs, s, remat=True, query_chunked=True, **masked)["executed_total"]
    assert chunked == remat + full_fwd + idx_fwd
    routed = 2 * 3 * 32 * d                                              # top-2 experts of width 32, one MoE layer
    padded = step_flops(TINY, seqs, s, remat=True, expert_rows=3.0, **masked)["executed_total"]
    assert padded == remat + (6 + 2) * routed * 2 * n                    # fwd + bwd + remat over 2 extra rows per row
    parts = step_flops(TINY, seqs, s, remat=True, **masked)
    assert parts["matmul_executed"] + parts["attention_executed"] + parts["indexer_executed"] \
        + 2 * parts["indexer_proj"] == parts["executed_total"]


def test_gather_sparse_layers_flops_hand_count():
    """sparse_attention gather (the default): a sparse layer multiplies each query's K gathered blocks whole
    (S * min(S, K * bs) pairs) at 4 (fwd) + 8 (bwd) + 4 (tile recompute) [+ 4 remat] H*D per pair, its indexer
    scores every key once (its block ids are kept, with remat too); the full layer follows `attention`;
    query chunking touches only the full layer; the model FLOPs do not change."""
    from m3jax.plan.flops import gather_pairs, sparse_keys
    seqs, s, hd = 3, 32, 4 * 16
    assert sparse_keys(TINY, s) == 16 and sparse_keys(TINY, 8) == 8  # 2 blocks x 8: the local block is among them
    assert gather_pairs(TINY, s) == 32 * 16
    masked = step_flops(TINY, seqs, s, remat=False, sparse_attention="masked")
    gather = step_flops(TINY, seqs, s, remat=False)
    assert gather["model_total"] == masked["model_total"]
    full_layer, idx = 12 * hd * s * s * seqs, 2 * 2 * 16 * s * s * seqs
    assert gather["attention_executed"] == full_layer + 16 * hd * 32 * 16 * seqs
    assert gather["indexer_executed"] == idx
    assert gather["executed_total"] == masked["executed_total"] - full_layer + 16 * hd * 512 * seqs
    remat = step_flops(TINY, seqs, s, remat=True)
    assert remat["attention_executed"] == full_layer * 4 / 3 + 20 * hd * 512 * seqs
    assert remat["indexer_executed"] == idx
    chunked = step_flops(TINY, seqs, s, remat=True, query_chunked=True)
    assert chunked["executed_total"] == remat["executed_total"] + full_layer / 3  # the full layer's block again
    flash = step_flops(TINY, seqs, s, remat=True, attention="flash")
    from m3jax.plan.flops import flash_pairs
    assert flash["attention_executed"] == 18 * hd * flash_pairs(TINY, s, sparse_layers=False) * seqs \
        + 20 * hd * 512 * seqs
    with pytest.raises(ValueError, match="sparse_attention"):
        step_flops(TINY, seqs, s, sparse_attention="dense")


# The memory comparison needs activations to dominate XLA's fixed overheads: a wider 3-layer model, seq 256.
MEM = M3Config(vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, intermediate_size=64, dense_intermediate_size=256, shared_intermediate_size=64,
               num_local_experts=8, num_experts_per_tok=2,
               layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
               mlp_layer_types=["dense", "sparse", "sparse"], partial_rotary_factor=0.5, index_n_heads=2,
               index_head_dim=32, index_block_size=16, index_topk_blocks=2)


# Each mesh with one precision / chunking (every term of the plan is met; a 15-20 s compile per case). The
# other six pairs agreed too when last run (docs/planner.md: 0.90-1.21 on all nine). The default run keeps the
# mesh with every kind of axis; the data-only and context meshes are extended.
@pytest.mark.slow  # compiles a train step per case (the planner's analytic side has the fast tests here)
@pytest.mark.parametrize("shape, master, chunk", [pytest.param((8, 1, 1, 1), "fp32", 0, marks=pytest.mark.extended),
                                                  ((2, 2, 1, 2), "fp32", 32),
                                                  pytest.param((2, 4, 1, 1), "none", 32, marks=pytest.mark.extended)],
                         ids=["8x1x1x1-bf16-unchunked", "2x2x1x2-bf16-chunk32", "2x4x1x1-fp32-chunk32"])
def test_memory_matches_xla(shape, master, chunk):
    """XLA:CPU computes bf16 arithmetic in fp32, so its activations are fp32-sized whatever the param
    dtype: the analytic side counts activations at 4 bytes here (a GPU plan counts 2 for bf16)."""
    from m3jax.plan.compile import compile_step
    assert len(jax.devices()) >= 8
    mesh, batch = MeshConfig(*shape), Batch(1, 256, 1, True, attention_query_chunk=chunk)
    xla = compile_step(MEM, mesh, batch, master, "float32", batch.model_options())
    analytic = memory_plan(MEM, mesh, batch, master, "float32", act_bytes=4)
    state = sum(analytic[k] for k in ("params", "master", "moments", "buffers"))
    assert abs(state - xla["argument"]) / xla["argument"] < 0.05  # the train state is exact up to the batch
    assert abs(analytic["total"] - xla["peak"]) / xla["peak"] < 0.30, (analytic["total"], xla)


def test_flash_attention_plans_linear_memory_and_visited_pairs_only():
    """attention_impl flash: the attention terms grow linearly in S (no [q, S] block), and the executed
    attention FLOPs follow the pairs the kernel visits (causal tiles; a sparse layer's selected blocks)."""
    from m3jax.plan.activations import attention_terms
    from m3jax.plan.flops import flash_pairs
    mesh = MeshConfig(2, 2, 2, 1)
    dense = [attention_terms(MEM, mesh, True, 1, s, 2, 0, "dense", "masked")[0]["attention_scores"] for s in (1024, 4096)]
    flash = [attention_terms(MEM, mesh, True, 1, s, 2, 0, "flash", "masked")[0]["attention_scores"]
             for s in (1024, 4096)]
    assert dense[1] == 16 * dense[0] and flash[1] < 4 * flash[0] and flash[1] < dense[1] / 50
    s, keep = 4096, MEM.index_topk_blocks * MEM.index_block_size  # the local block is one of the top-K
    assert flash_pairs(MEM, s) == causal_pairs(s) + s * 128 // 2 + 2 * s * keep  # 1 full + 2 sparse layers
    f_dense, f_flash = (step_flops(MEM, 4, s, attention=a, sparse_attention="masked") for a in ("dense", "flash"))
    assert f_flash["model_total"] == f_dense["model_total"] and f_flash["executed_total"] < f_dense["executed_total"]
    job = load_job("configs/recipes/m3-32node.yaml", ["model.attention_impl=flash", "model.moe_kernel=tiled"], "release")
    p = plan(job, Hardware())
    assert p["flops"]["executed_total"] / p["flops"]["model_total"] < 1.5  # 21.9x with the dense defaults


def test_chunking_and_capacity_shrink_what_they_should():
    """Query chunking scales the scores block by chunk / S_l; a capacity factor bounds the receive pool."""
    from m3jax.plan.activations import attention_terms, moe_terms
    mesh = MeshConfig(2, 2, 2, 1)
    full, kept = attention_terms(MEM, mesh, True, 1, 256, 2, 0, "dense", "masked")
    half, kept_half = attention_terms(MEM, mesh, True, 1, 256, 2, 64, "dense", "masked")  # S_l = 128
    assert half["attention_scores"] == full["attention_scores"] / 2
    assert kept["attention_residuals"] > full["attention_scores"] > kept_half["attention_residuals"]
    dropless = moe_terms(MEM, mesh, 128, 2, None, "ragged", "dense")
    capped = moe_terms(MEM, mesh, 128, 2, 2.0, "ragged", "dense")
    # EP 8 with 1 expert each: dropless pool 8 * 128 rows, capacity 2 * 128 * 2 = 512 rows; 2 [W, d] buffers
    assert dropless["moe_dispatch"] == 2 * 2 * 1024 * MEM.hidden_size * 2
    assert capped["moe_dispatch"] == dropless["moe_dispatch"] / 2 and dropless["ragged_dot_expansion"] == 0
    assert moe_terms(MEM, mesh, 128, 2, None, "padded", "dense")["moe_dispatch"] == 3 * dropless["moe_dispatch"]


def test_fsdp_traffic_follows_the_axes_that_shard_the_weights():
    """A rules table that shards the non-expert weights over context (not data) moves their gathers to the
    context axis: the same bytes as the default's over data when both axes have the same size, and none over data."""
    from m3jax.plan.flops import comm_bytes
    from sharding.rules import RULES
    mesh = MeshConfig(2, 2, 2, 1)
    default = comm_bytes(TINY, mesh, 1, 64, 4)
    on_context = comm_bytes(TINY, mesh, 1, 64, 4, rules=tuple((k, "context" if k == "embed" else v) for k, v in RULES))
    assert default["fsdp_all_gather"][1] == ("data",) and default["fsdp_all_gather"][0] > 0
    assert on_context["fsdp_all_gather"] == (default["fsdp_all_gather"][0], ("context",))
    # the embedding table stays cut over data x tensor, and is looked up there (its rows outweigh the tokens')
    assert on_context["embedding_lookup"] == default["embedding_lookup"] and default["embedding_lookup"][1] == ("data",)
    # with more tokens per device than the table has rows (4 x 128 / context 2), the table is gathered: two groups,
    # named by their axes
    rules = tuple((k, "context" if k == "embed" else v) for k, v in RULES)
    long = comm_bytes(TINY, mesh, 4, 128, 4, rules=rules)
    assert "embedding_lookup" not in long and long["fsdp_all_gather[data]"][1] == ("data",)
    assert long["fsdp_all_gather[context]"] == (on_context["fsdp_all_gather"][0], ("context",))


def test_a_step_copy_moves_the_per_micro_batch_gathers_off_its_axes():
    """mesh.fsdp_step_axes [data] on fsdp_axes [context, data]: each micro-batch gathers the FSDP row's weights over
    context only; data carries one gather per step and the copy's gradient per micro-batch, cut by the context size.
    The reduce-scatters add up to the plain mesh's: f(n_r) W + f(n_s) W / n_r = f(n_r n_s) W."""
    from m3jax.plan.flops import comm_bytes
    from m3jax.plan.memory import memory_phases
    plain = MeshConfig(4, 2, 1, 1, expert_axes=("data", "context"), fsdp_axes=("context", "data"))
    hpz = dataclasses.replace(plain, fsdp_step_axes=("data",))
    micro = 8
    a, b = comm_bytes(TINY, plain, 1, 64, micro), comm_bytes(TINY, hpz, 1, 64, micro)
    group = ""  # the FSDP row's group alone: the embedding table's rows are looked up where they lie
    assert a["fsdp_all_gather" + group][1] == ("data", "context") and b["fsdp_all_gather" + group][1] == ("context",)
    assert b["fsdp_step_all_gather" + group][1] == b["fsdp_step_reduce_scatter" + group][1] == ("data",)
    w = a["fsdp_reduce_scatter" + group][0] / (7 / 8) / micro  # the weights' full bytes
    assert b["fsdp_all_gather" + group][0] == pytest.approx(2 * 0.5 * w * micro)
    assert b["fsdp_step_all_gather" + group][0] == pytest.approx(0.75 * w / 2)  # once, not per micro-batch
    assert b["fsdp_reduce_scatter" + group][0] + b["fsdp_step_reduce_scatter" + group][0] == \
        pytest.approx(a["fsdp_reduce_scatter" + group][0])
    assert a["embedding_lookup"] == b["embedding_lookup"]
    # forward only (the logprob pass): one gather per micro-batch, no gradients
    fwd = comm_bytes(TINY, hpz, 1, 64, micro, backward=False)
    assert fwd["fsdp_all_gather" + group][0] == pytest.approx(b["fsdp_all_gather" + group][0] / 2)
    assert not [k for k in fwd if "reduce" in k]
    # memory: the copy beside the state's shards, and the micro-batch gradient on the copy's shards
    pa, pb = (memory_phases(TINY, m, Batch(1, 64, micro)) for m in (plain, hpz))
    assert "step_copy" not in pa["backward"] and pb["backward"]["step_copy"] > 0
    assert pb["backward"]["micro_gradient"] - pa["backward"]["micro_gradient"] == pytest.approx(
        pb["backward"]["step_copy"])
    assert pb["update"]["total"] == pytest.approx(pa["update"]["total"])  # freed before the update


def test_the_loss_head_gradient_crosses_context_at_every_logits_block():
    from m3jax.plan.flops import comm_bytes
    mesh = MeshConfig(2, 4, 1, 1)
    blocks = comm_bytes(TINY, mesh, 1, 64, 3, head_blocks=8)["head_grad_reduce_scatter"]
    assert blocks == (pytest.approx(8 * 0.75 * 256 * 64 * 4 * 3), ("context",))  # fp32 [V, d], 3 micro-batches
    assert "head_grad_reduce_scatter" not in comm_bytes(TINY, mesh, 1, 64, 3)  # one block: the full-logits program
    assert "head_grad_reduce_scatter" not in comm_bytes(TINY, mesh, 1, 64, 3, head_blocks=8, backward=False)


@pytest.mark.slow  # compiles two train steps
def test_the_expert_exchange_trips_follow_the_remat_policy_as_compiled():
    """The compiled step's expert all-to-alls (EP 8 on data): forward out and back, their two transposes, and the
    remat recompute's trips. save_dots_experts keeps the rows that came back, so its recompute only sends them out
    again: 5 trips to full's 6, as the plan counts them."""
    from m3jax.plan.compile import compile_step
    from m3jax.plan.flops import comm_bytes
    mesh = MeshConfig(8, 1, 1, 1, expert_axes=("data",))
    compiled, planned = {}, {}
    for policy in ("full", "save_dots_experts"):
        batch = Batch(1, 64, 2, True, remat_policy=policy)
        got = compile_step(TINY, mesh, batch, collectives=True, model_options={"remat_policy": policy})
        compiled[policy] = got["collectives"]["all-to-all over data in a loop"]
        planned[policy] = comm_bytes(TINY, mesh, 1, 64, 2, remat_policy=policy)["expert_all_to_all"][0]
    assert planned["save_dots_experts"] / planned["full"] == pytest.approx(5 / 6)
    # the counts' all-to-all (a few int32 per expert) rides along: within 1 %
    assert compiled["save_dots_experts"] / compiled["full"] == pytest.approx(5 / 6, rel=0.01)


@pytest.mark.slow  # compiles a train step per case
@pytest.mark.parametrize("vocab", [256, 4096])
def test_the_embedding_lookup_moves_the_table_or_the_tokens_whichever_is_smaller(vocab):
    """The table's rows are cut over data (8). Its 256 rows are fewer bytes than the 8 devices' 64 tokens each, and the
    compiled step gathers the table for the lookup; 4096 rows are more, and it never gathers them: the lookup
    exchanges the tokens' activations instead (an all-reduce of [n, T_l, d] forward, an all-gather of their
    cotangents backward). The plan prices the same choice: an FSDP gather of the table, or embedding_lookup."""
    from m3jax.plan.check import abstract_batch, abstract_train_state
    from m3jax.plan.flops import comm_bytes
    from sharding.hlo_collectives import collectives
    from sharding.mesh import build_mesh
    from sharding.train_step import make_train_step, state_shardings
    cfg = dataclasses.replace(TINY, vocab_size=vocab)
    mesh_cfg, t_l, micro = MeshConfig(8, 1, 1, 1), 64, 2
    layout = build_mesh(mesh_cfg, cfg, seq_len=t_l, devices=jax.devices()[:8])
    graphdef, opt, state = abstract_train_state(cfg, "fp32", "float32", True, {}, layout)
    step = make_train_step(graphdef, opt, mesh=layout, shardings=state_shardings(layout, state))
    with jax.set_mesh(layout.mesh):
        text = step.jitted.lower(state, abstract_batch(layout, mesh_cfg, Batch(1, t_l, micro, True))).compile().as_text()
    lookup = {(c.op, c.axes, c.bytes) for c in collectives(text, layout.mesh)
              if "_take" in c.source or "embed_tokens_grad" in c.source}  # the lookup and its bf16 table's backward
    table, rows = vocab * cfg.hidden_size * 4, 8 * t_l * cfg.hidden_size * 4  # fp32 on XLA:CPU
    planned = comm_bytes(cfg, mesh_cfg, 1, t_l, micro, master="none")  # master none: fp32 activations, as here
    if vocab == 256:
        assert ("all-gather", ("data",), table) in lookup and rows not in {b for _, _, b in lookup}
        assert "embedding_lookup" not in planned
    else:
        assert {("all-gather", ("data",), rows), ("all-reduce", ("data",), rows)} <= lookup
        assert table not in {b for _, _, b in lookup}
        assert planned["embedding_lookup"] == (pytest.approx(3 * 7 / 8 * rows * micro), ("data",))
        # the FSDP gathers are the head's and the layers' alone: the table's vocabulary does not reach them
        assert planned["fsdp_all_gather"][0] == pytest.approx(comm_bytes(
            dataclasses.replace(cfg, vocab_size=2 * vocab), mesh_cfg, 1, t_l, micro, master="none")
            ["fsdp_all_gather"][0] - 2 * 7 / 8 * table * micro)


def test_a_kl_reference_is_planned_as_a_second_copy_of_the_params_and_a_second_logprob_pass():
    """grpo.kl keeps the reference policy (rl.reference: a copy of the params, placed as they are) and scores every
    step under it too: on the devices both peaks hold the copy, and the logprob pass runs twice."""
    base = plan(load_job("configs/recipes/m3-32node.yaml", ["grpo.old_logprobs=pass"], "release"), Hardware())
    job = load_job("configs/recipes/m3-32node.yaml", ["grpo.old_logprobs=pass", "grpo.kl=k3", "grpo.kl_coef=0.001",
                                                      "grpo.reference_memory=device"], "release")
    kl = plan(job, Hardware())
    assert job.logprob_passes == 2 and "reference_params" not in base["memory"]
    for phase in ("backward", "update"):
        assert kl["phases"][phase]["reference_params"] == kl["phases"][phase]["params"] > 0
        assert kl["phases"][phase]["total"] == pytest.approx(base["phases"][phase]["total"]
                                                           + base["phases"][phase]["params"])
    assert kl["logprob_pass"]["time"]["total_s"] == pytest.approx(2 * base["logprob_pass"]["time"]["total_s"])


def test_a_kl_reference_is_planned_without_a_logp_old_pass_too():
    """With grpo.old_logprobs: update the reference's pass is the only one, and the copy still takes its memory
    (the planner once read "a second pass" as "a reference" and planned this run 6.8 GB short)."""
    kl = ["grpo.kl=k3", "grpo.kl_coef=0.001"]
    base = plan(load_job("configs/recipes/m3-32node.yaml", ["grpo.reference_memory=device"], "release"), Hardware())
    job = load_job("configs/recipes/m3-32node.yaml", [*kl, "grpo.reference_memory=device"], "release")
    assert job.logprob_passes == 1 and job.reference == "device"
    got = plan(job, Hardware())
    assert got["memory"]["reference_params"] == got["memory"]["params"] > 0
    assert got["memory"]["total"] == pytest.approx(base["memory"]["total"] + base["memory"]["params"])


def test_a_reference_in_host_memory_leaves_the_step_peaks_and_pays_its_transfer_once_per_step():
    """grpo.reference_memory: host (rl.reference): the copy is in neither step peak; a third peak, the reference
    pass's, holds it with the state (no gradients) and the pass's activations; the pass pays bytes / PCIe."""
    kl = ["grpo.kl=k3", "grpo.kl_coef=0.001"]
    on_device = plan(load_job("configs/recipes/m3-32node.yaml", [*kl, "grpo.reference_memory=device"], "release"),
                     Hardware())
    hw = Hardware(pcie_bw=25e9)
    job = load_job("configs/recipes/m3-32node.yaml", [*kl, "grpo.reference_memory=host"], "release")
    host = plan(job, hw)
    for phase in ("backward", "update"):
        assert "reference_params" not in host["phases"][phase]
        assert host["phases"][phase]["total"] == pytest.approx(on_device["phases"][phase]["total"]
                                                             - on_device["phases"][phase]["params"])
    ref_pass = host["phases"]["reference_pass"]
    assert ref_pass["reference_params"] == ref_pass["params"]
    assert "grad_accumulator" not in ref_pass and "micro_gradient" not in ref_pass
    assert ref_pass["total"] < host["phases"]["backward"]["total"]
    to_device = ref_pass["reference_params"] / 25e9
    assert host["logprob_pass"]["time"]["reference_to_device_s"] == pytest.approx(to_device)
    assert host["logprob_pass"]["time"]["total_s"] == pytest.approx(on_device["logprob_pass"]["time"]["total_s"]
                                                                    + to_device)


def test_rules_table_drives_the_plan():
    from sharding.rules import RULES
    mesh, batch = MeshConfig(4, 1, 2, 1), Batch(1, 64)
    base = memory_plan(TINY, mesh, batch)["params"]
    no_fsdp = tuple((k, None if k == "embed" else v) for k, v in RULES)
    assert memory_plan(TINY, mesh, batch, rules=no_fsdp)["params"] > base


def test_real_m3_on_recipe_mesh():
    cfg = m3_release()
    counts = param_counts(cfg)
    assert 425e9 < counts["total"] < 427e9
    job = load_job("configs/recipes/m3-32node.yaml", [], "release")
    assert job.mesh.shape == (16, 8, 1, 1) and job.mesh.expert_parallel == 128 and job.seq_len == 8192
    assert invalid_reason(job) is None
    assert job.master == "compact" and job.model_options["attention_query_chunk"] == 512
    assert job.model_options["attention_impl"] == "flash" and job.model_options["moe_kernel"] == "tiled"
    assert job.batch.sparse_attention == "gather" and job.batch.logprob_chunk_tokens == 8192  # one block
    assert job.batch.remat_policy == "save_dots_experts"
    p = plan(job, Hardware())
    mem, total = p["memory"], p["memory"]["total"] / GB
    # Recorded in the recipe, docs/planner.md and BENCHMARKS.md: 67.43 GB with the step copy (an MoE layer's phase
    # binds; 64.56 GB with save_dots, 61.78 GB with remat_policy full), 1.17x the model FLOPs (1.33x save_dots, 1.45x
    # full, 21.9x before issue 11), 31.4 s per train step and no logprob pass (grpo.old_logprobs: update; 10.0 s with
    # one). Without the copy (fsdp_axes [data]) and with the pass: 70.93 GB, 68.0 s + 22.7 s. The loss's logits in
    # blocks of 1024 positions (session 20's recipe): 67.80 GB, 33.8 s.
    assert abs(total - 67.43) < 0.01 and verdict(mem, 80).startswith("FITS") and mem["step_copy"] > 0
    assert "act:moe_dispatch" in mem and "head_grad_reduce_scatter" not in p["comm"]
    assert abs(mem["act:saved_residuals"] / GB - 5.67) < 0.01
    assert p["phases"]["update"]["total"] < p["phases"]["backward"]["total"]
    assert mem["master"] == mem["params"]  # the compact remainder: 2 B per bf16 param
    fl = p["flops"]
    assert 1.165 < fl["executed_total"] / fl["model_total"] < 1.175
    assert 30.9 < p["time"]["total_s"] < 31.9
    assert job.logprob_passes == 0 and p["logprob_pass"]["time"]["total_s"] == 0  # grpo.old_logprobs: update
    with_pass = plan(load_job("configs/recipes/m3-32node.yaml", ["grpo.old_logprobs=pass"], "release"), Hardware())
    assert 9.5 < with_pass["logprob_pass"]["time"]["total_s"] < 10.5
    dots = plan(dataclasses.replace(job, model_options={**job.model_options, "remat_policy": "save_dots"}),
                Hardware())
    assert abs(dots["memory"]["total"] / GB - 64.56) < 0.01 and abs(dots["memory"]["act:saved_residuals"] / GB
                                                                     - 2.80) < 0.01
    plain = plan(load_job("configs/recipes/m3-32node.yaml", ["mesh.fsdp_axes=[data]", "mesh.fsdp_step_axes=[]",
                                                             "grpo.old_logprobs=pass"], "release"), Hardware())
    assert abs(plain["memory"]["total"] / GB - 70.93) < 0.01
    assert 67.5 < plain["time"]["total_s"] < 68.5 and 22.2 < plain["logprob_pass"]["time"]["total_s"] < 23.2
    blocks = plan(load_job("configs/recipes/m3-32node.yaml", ["model.logprob_chunk_tokens=1024"], "release"),
                  Hardware())
    assert abs(blocks["memory"]["total"] / GB - 67.80) < 0.01  # the head's phase binds
    assert abs(blocks["memory"]["act:head_grad_fp32"] / GB - 0.615) < 0.001  # 200064 x 6144 x fp32 / context 8
    assert 33.3 < blocks["time"]["total_s"] < 34.3 and 2.4 < blocks["time"]["head_grad_reduce_scatter_s"] < 2.5


def test_the_losss_entropy_adds_one_fp32_logits_block_to_the_heads_phase():
    """grpo.entropy_coef (or logging.entropy, or grpo.high_entropy_fraction) makes the loss hold one more fp32 buffer of its logits block
    (XLA:CPU, one block: 1,024 -> 1,536 MiB of temp for 512 MiB of fp32 logits, BENCHMARKS.md session 22)."""
    from m3jax.plan.activations import head_terms
    from m3jax.plan.memory import _shard_dims
    job = load_job("configs/recipes/m3-32node.yaml", ["grpo.entropy_coef=0.001"], "release")
    assert job.entropy and job.batch.logprob_entropy
    assert load_job("configs/recipes/m3-32node.yaml", ["logging.entropy=true"], "release").entropy
    assert load_job("configs/recipes/m3-32node.yaml", ["grpo.high_entropy_fraction=0.2"], "release").entropy
    assert not load_job("configs/recipes/m3-32node.yaml", [], "release").entropy
    dims = _shard_dims(job.mesh, None)
    with_h, without = (head_terms(job.model, job.mesh, 1, 8192, 2, dims, 8192, entropy=e) for e in (True, False))
    positions = 8192 // job.mesh.context  # one block per row, cut over context
    assert with_h["head_logits"] - without["head_logits"] == positions * job.model.vocab_size * 4
    assert plan(job, Hardware())["memory"]["total"] / GB == pytest.approx(67.43, abs=0.01)  # an MoE layer still binds


def test_a_draw_ahead_on_the_jax_engine_plans_its_copy_of_the_params():
    """The JAX engine copies the params for a draw that decodes beside the train step (max_trajectory_age_steps 1):
    the plan left it out (6.68 GB a GPU on the one-node H200 recipe)."""
    hw = Hardware(1e15, 0.4, 4.5e11, 5e10)
    base = plan(load_job("configs/recipes/m3-1node-h200.yaml", [], None), hw)
    ahead = plan(load_job("configs/recipes/m3-1node-h200.yaml", ["grpo.max_trajectory_age_steps=1"], None), hw)
    for name, phase in ahead["phases"].items():
        assert phase["generator_params"] == phase["params"] > 0
        assert phase["total"] == pytest.approx(base["phases"][name]["total"] + phase["params"])
    vllm = load_job("configs/tiny-vllm.yaml", ["grpo.max_trajectory_age_steps=1"], None)
    assert not vllm.generator_copy  # vLLM engines hold their weights elsewhere
