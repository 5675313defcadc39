"""Analytic FLOPs, communication volume and step time of one training step (pure Python).

Per optimizer step: G sequences (the global batch of one update; GRPO's sequences_per_step /
updates_per_step, times updates_per_step for the whole step), S tokens each, N = G * S tokens.
Notation as in `m3jax.plan.memory`.
"""

from __future__ import annotations

import dataclasses
import math

from m3jax.config import FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION, M3Config
# the model's own FLOPs (what the maths needs) live with the model, which the trainer's perf metrics read too
from m3jax.flops import active_matmul_params, causal_pairs, model_flops  # noqa: F401  (re-exported)
from sharding.mesh import MeshConfig
from m3jax.plan.activations import sparse_keys  # noqa: F401  (re-exported: the FLOPs model's name for it)
from m3jax.plan.memory import local_elems, mesh_sizes, param_table, shard_axes, step_copy_rules
from m3jax.plan.remat import exchange_recompute_trips, recomputed_params, trains_as
from sharding.rules import MESH_AXES

LOOKUP_ROWS = "table_vocab"  # the logical axis of the embedding table's rows (`m3jax.model.specs`): read by a lookup


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Device and links (defaults: H100/H200 SXM): dense bf16 FLOP/s, the MFU assumed for compute,
    NVLink bandwidth per GPU inside a node, InfiniBand bandwidth per GPU between nodes, and each GPU's PCIe link
    to pinned host memory (Gen5 x16: 64 GB/s a direction, ~50 reached; bytes/s)."""
    peak_flops: float = 989e12
    mfu: float = 0.4
    nvlink_bw: float = 450e9
    ib_bw: float = 50e9
    pcie_bw: float = 50e9
    gpus_per_node: int = 8


def expert_rows_factor(cfg: M3Config, mesh: MeshConfig, batch, ragged_dot: str | None = None) -> float:
    """Rows the grouped expert matmuls execute per routed (token, expert) row, per device
    (`sharding.grouped_matmul.executed_rows` over F = T_l * k routed rows in the receive buffer):

        dense lowering    G * W / (T_l * k)   every local expert multiplies every row of the receive buffer
                          (zero-padded per group: XLA's GPU default and the CPU reference rule)
        tiled kernel      tile * (ceil(T_l * k / tile) + G - 1) / (T_l * k)   the filled rows rounded up to
                          row tiles, plus a partial last tile per group (`batch.expert_matmul` = "tiled")
        bucketed kernel   G * C / (T_l * k)   balanced buckets of C = T_l * k / G rows rounded up to 8 (the
                          overflow walk adds nothing under the balanced load planned; `batch.expert_matmul`
                          = "bucketed")
        pallas, mosaic    as tiled at their row block (64, 128): a partial tile per group costs a tile
        grouped kernel    1                   only the real rows (ragged_dot lowered to a grouped GEMM)
    with W = `sharding.expert.receive_rows` for the batch's exchange and capacity, G = E / n_ep local experts.
    ragged_dot overrides the batch's way ("dense" | "grouped" | "tiled").
    """
    from sharding.expert import receive_rows
    from sharding.grouped_matmul import executed_rows
    mode = ragged_dot or batch.expert_matmul
    if mode == "grouped" and batch.expert_kernel in ("pallas", "mosaic"):
        mode = batch.expert_kernel
    elif mode == "grouped":
        return 1.0
    sz = mesh_sizes(mesh)
    t_l, k, n_ep = batch.micro_batch * batch.seq_len // sz["context"], cfg.num_experts_per_tok, mesh.expert_parallel
    g = cfg.num_local_experts // n_ep
    w = receive_rows(t_l, k, n_ep, g, batch.moe_capacity_factor, batch.exchange)
    return executed_rows(min(t_l * k, w), g, mode, w) / (t_l * k)


def expert_recompute(batch) -> float:
    """Extra forward work of the routed experts' matmuls, as a fraction of their forward: the tiled
    kernel's fused MLP recomputes rows @ W_gate_up^T (2 of the 3 I x d matrices) in its backward: 2/3. The
    bucketed kernel's buckets keep their hidden for the backward (its overflow walk, empty under the balanced
    load planned, would recompute): 0."""
    return 2 / 3 if batch.expert_matmul == "tiled" else 0.0


SPARSE_ATTENTION_IMPLS = ("gather", "masked", "paged")  # model.sparse_attention (rl/config/schema.py)


def flash_pairs(cfg: M3Config, seq_len: int, tile: int = 128, sparse_layers: bool = True) -> int:
    """(query, key) pairs the flash kernel multiplies over all layers: on full layers the causal pairs plus
    the masked half of the diagonal tiles (S * t / 2); on sparse layers (unless sparse_layers is False: then
    they are left out) each query's selected blocks, whole: S * `sparse_keys` = S * min(S, K * bs). On sparse
    layers this is a lower bound: the kernel visits, per query tile, the union of the tile's queries' selected
    key tiles, up to the causal tiles when the queries of a tile select different blocks."""
    keep = sparse_keys(cfg, seq_len)
    return sum(causal_pairs(seq_len) + seq_len * min(tile, seq_len) // 2 if t != SPARSE_ATTENTION
               else (seq_len * keep if sparse_layers else 0) for t in cfg.layer_types)


def gather_pairs(cfg: M3Config, seq_len: int) -> int:
    """(query, key) pairs the gather path (`model.sparse_attention: gather`) multiplies over the sparse layers:
    every query multiplies its K gathered blocks whole, S * min(S, K * bs) per layer (the causal pairs of a
    window, causal_pairs(S, K * bs), are what the maths needs; the rest are the masked future slots of the
    query's own block and of the early queries' padding blocks)."""
    return sum(t == SPARSE_ATTENTION for t in cfg.layer_types) * seq_len * sparse_keys(cfg, seq_len)


def step_flops(cfg: M3Config, seqs: int, seq_len: int, remat: bool = True, *, query_chunked: bool = False,
               expert_rows: float = 1.0, expert_recompute: float = 0.0, attention: str = "dense",
               sparse_attention: str = "gather", remat_policy: str = "full",
               expert_matmul: str = "ragged_dot") -> dict[str, float]:
    """FLOPs of one step over `seqs` sequences of `seq_len` tokens (N = seqs * seq_len tokens).

    model FLOPs (what the maths needs): `model_flops`' matmul, indexer_proj, attention, indexer_scores,
        model_total (and forward_total, a forward pass's).
    forward_executed: the executed FLOPs of a forward pass alone over the same tokens (the logprob pass):
        2 * (layer + head params, the routed experts x expert_rows) * N + indexer projections + the attention's and
        indexer's forward.
    executed FLOPs (what m3jax runs): the routed experts' matmuls times `expert_rows` (`expert_rows_factor`:
        padding rows the grouped matmul multiplies too); with remat the projections the backward reads again,
        by `remat_policy` (`m3jax.plan.remat.recomputed_params`: 2 * those params * N, the routed ones x
        expert_rows; full: every projection but the dense / shared down (and the indexer's on the gather path,
        whose block ids are kept), save_dots: the routed experts only,
        save_dots_experts: their gate/up under ragged_dot, nothing under the tiled kernel (`expert_matmul`))
        + the forward attention/indexer scores again; the routed experts' forward again x
        `expert_recompute` (`expert_recompute(batch)`: the tiled kernel's backward recomputes the gate/up
        projection): 2 * routed params * expert_rows * expert_recompute * N. Attention, by layer:
      full layers (and sparse ones with sparse_attention "masked"), by `attention` ("auto" as the model resolves
      it over seq_len keys, `m3jax.model.attention.resolve_impl`):
        dense   the full [S, S] block (the model masks, it does not skip): 12 * H*D * S^2 per layer, + 4 * H*D * S^2
                with remat, + 4 * H*D * S^2 with query-chunked attention (each block is recomputed in its
                backward); the indexer of a masked sparse layer scores every [S, S] pair (2 * Hi*Di * S^2 per
                forward): once, + once with remat, + once with query chunking
        flash   `flash_pairs` only, 14 * H*D per pair (its backward recomputes the scores: FlashAttention-2's
                5 matmuls instead of 4), + 4 * H*D per pair with remat; the query chunking no longer
                recomputes the attention (the masked sparse layers' indexer as under dense)
      sparse layers with sparse_attention "gather" (the default; whatever `attention` is): the local queries
        in tiles of 64, a rematerialised scan, each gathering the top-K blocks of keys and values the indexer
        chose before the scan: `gather_pairs` = S * min(S, K * bs) pairs per layer at 4 * H*D (forward)
        + 8 * H*D (backward) + 4 * H*D (the backward's tile recompute) [+ 4 * H*D with remat] = 16 (20) * H*D
        per pair; the indexer 2 * Hi*Di * S^2, once: it runs before the attention's scan, and every remat policy
        keeps its block ids (`m3jax.model.sparse.INDEX_BLOCK_IDS`), so neither the backward nor the remat
        scores the keys again; query chunking does not apply.
      over at most K bs keys (`m3jax.model.attention.sees_every_block`) the sparse layers run as full layers and
        the indexer not at all: executed as a model of full layers, without the indexer's projections or scores
        (the model FLOPs, what the maths needs, stay the sparse model's).
    """
    if sparse_attention not in SPARSE_ATTENTION_IMPLS:
        raise ValueError(f"sparse_attention={sparse_attention!r}: expected one of {SPARSE_ATTENTION_IMPLS}")
    sparse_attention = trains_as(sparse_attention)
    from m3jax.model.attention import resolve_impl
    attention = resolve_impl(attention, seq_len)  # "auto" -> what runs over seq_len keys
    if attention == "cudnn":  # cuDNN's fused attention skips masked tiles and recomputes in its backward, as flash
        attention = "flash"
    act = active_matmul_params(cfg)
    n = seqs * seq_len
    h, dd = cfg.num_attention_heads, cfg.head_dim
    n_sparse = sum(t == SPARSE_ATTENTION for t in cfg.layer_types)
    layer_params = act["attention"] + act["dense_mlp"] + act["moe"]
    out = model_flops(cfg, seqs, seq_len)
    routed = sum(m == MOE_MLP for m in cfg.mlp_layer_types) * cfg.num_experts_per_tok * 3 * cfg.intermediate_size \
        * cfg.hidden_size
    layer_exec = layer_params + routed * (expert_rows - 1)
    from m3jax.model.attention import sees_every_block
    selects = not sees_every_block(seq_len, cfg)
    if not selects:  # executed as the model runs it: every layer a full one, the indexer never
        cfg = dataclasses.replace(cfg, layer_types=(FULL_ATTENTION,) * cfg.num_hidden_layers)
        n_sparse = 0
    idx_proj = out["indexer_proj"] if selects else 0.0
    gather = sparse_attention == "gather"
    n_other = cfg.num_hidden_layers - (n_sparse if gather else 0)  # layers that follow `attention`
    idx_fwd = 2 * cfg.index_n_heads * cfg.index_head_dim * seq_len * seq_len * n_sparse * seqs
    if attention == "flash":
        fp = flash_pairs(cfg, seq_len, sparse_layers=not gather) * seqs
        attn_exec, attn_again, attn_remat = 14 * h * dd * fp, 0.0, 4 * h * dd * fp
    else:
        full_attn = 12 * h * dd * seq_len * seq_len * n_other * seqs
        attn_exec, attn_again, attn_remat = full_attn, full_attn / 3, full_attn / 3
    idx_exec, idx_again, idx_remat = idx_fwd, (0.0 if gather else idx_fwd), (0.0 if gather else idx_fwd)
    if gather:
        gp = gather_pairs(cfg, seq_len) * seqs
        attn_exec += 16 * h * dd * gp  # forward 4, backward 8, the backward's tile recompute 4
        attn_remat += 4 * h * dd * gp
    out["attention_executed"] = attn_exec + (attn_remat if remat else 0.0) + (attn_again if query_chunked else 0.0)
    # full layers' flash alone (forward, and forward + backward [+ remat]): the work that grows with a query's
    # position, which contiguous context shards split unevenly (`context_imbalance`)
    full_pairs = flash_pairs(cfg, seq_len, sparse_layers=False) * seqs if attention == "flash" else 0
    out["full_flash_forward"] = 4 * h * dd * full_pairs
    out["full_flash_executed"] = (14 + (4 if remat else 0)) * h * dd * full_pairs
    out["indexer_executed"] = idx_exec + (idx_remat if remat else 0.0) + (idx_again if query_chunked else 0.0)
    attn_forward = (4 * h * dd * fp if attention == "flash" else full_attn / 3) \
        + (4 * h * dd * gp if gather else 0.0)
    # the logprob pass (logp_old, logp_ref): the forward alone, no remat, no backward recompute
    out["forward_executed"] = 2 * (layer_exec + act["head"]) * n + idx_proj + attn_forward + idx_fwd
    executed = 6 * (layer_exec + act["head"]) * n + idx_proj + attn_exec + idx_exec
    executed += 2 * routed * expert_rows * expert_recompute * n
    again = recomputed_params(cfg, remat_policy, expert_matmul, sparse_attention)
    if remat:
        executed += 2 * (again["layer"] + again["routed"] * expert_rows + again["indexer"]) * n + attn_remat \
            + idx_remat
    if query_chunked:
        executed += attn_again + idx_again
    out["indexer_proj_executed"] = idx_proj + (2 * again["indexer"] * n if remat else 0.0)
    out["matmul_executed"] = executed - out["attention_executed"] - out["indexer_executed"] \
        - out["indexer_proj_executed"]
    out["executed_total"] = executed
    return out


def context_imbalance(mesh: MeshConfig) -> float:
    """How many times the average share of the full layers' causal flash work the busiest context shard does:
    (2n - 1) / n for n contiguous shards (shard c's queries see (c + 1/2) shards of keys), 1 with
    `mesh.context_balance` (mirror shards swap their second halves, `sharding.context`) or one shard."""
    n = mesh.context
    return 1.0 if n == 1 or mesh.context_balance else (2 * n - 1) / n


def axis_link(mesh: MeshConfig, axes: tuple[str, ...], hw: Hardware) -> float:
    """Bandwidth of a collective over `axes`: NVLink when the group fits in one node, else IB.
    Devices are laid out row-major over (data, context, expert, tensor) (jax.make_mesh), so an axis'
    group stays inside a node iff its size times the sizes of every axis after it is <= gpus_per_node."""
    sz = mesh_sizes(mesh)
    used = [a for a in axes if sz[a] > 1]
    if not used:
        return hw.nvlink_bw
    first = min(MESH_AXES.index(a) for a in used)
    span = math.prod(sz[a] for a in MESH_AXES[first:])
    return hw.nvlink_bw if span <= hw.gpus_per_node else hw.ib_bw


def comm_bytes(cfg: M3Config, mesh: MeshConfig, micro_batch: int, seq_len: int, num_micro: int,
               master: str = "fp32", remat: bool = True, rules=None, sent_rows: float | None = None,
               backward: bool = True, head_blocks: int = 1, remat_policy: str = "full"
               ) -> dict[str, tuple[float, tuple]]:
    """Bytes one device sends per step, by collective -> (bytes, mesh axes it runs over).

    Per micro-batch (x num_micro), p = param bytes, a = activation bytes, f(n) = (n-1)/n; W = the full bytes of the
    weights a token axis shards on a non-expert dimension (FSDP), g = those token axes, of which s =
    `mesh.fsdp_step_axes` are gathered once per step into a copy cut over r = g - s only (the FSDP row's weights,
    `m3jax.plan.memory.step_copy_rules`; s = () for the others, e.g. the embedding table's rows):
      fsdp_all_gather     (1 + 1) * f(n_r) * W (forward, and again in the backward / remat recompute), over r
                          ("[axes]" is appended when tables shard weights over several different groups)
      fsdp_reduce_scatter f(n_r) * W (gradients, param dtype), over r
      fsdp_step_reduce_scatter  f(n_s) * W / n_r: the copy's gradient onto the state's shards, over s
      fsdp_step_all_gather      f(n_s) * W / n_r, once per step (not x num_micro), over s
      embedding_lookup    (2 + 1) * f(n) * n * T_l * d * a over the n devices that cut the table's rows, where the
                          n devices' tokens are fewer bytes than the table (n * T_l * a < V * p; else the table is
                          gathered as FSDP weights are): each device looks its rows up for the tokens of all n, summed
                          by an all-reduce (forward), and the backward all-gathers their cotangents for its rows'
                          scatter-add. XLA's partitioner picks between the two so (tests/test_plan.py)
      grad_all_reduce     2 f(n) * local gradient bytes, over the token axes (data, context, expert) a
                          weight is replicated on (its gradient sums over the tokens those devices hold)
      expert_all_to_all   L_moe * (2 fwd + 2 bwd [+ 2 remat]) * f(n_ep) * R * d * a, R = sent_rows: T_l * k for
                          the ragged exchange (the rows really routed), W (`receive_rows`) for the padded one;
                          the remat's trips by policy (`m3jax.plan.remat.exchange_recompute_trips`: 1 under
                          save_dots_experts, which keeps the rows that came back)
      context_all_gather  L * (1 fwd [+ 1 remat] + 1 bwd reduce-scatter) * f(n_c) * b * S *
                          (2 * KV/n_t * D + Di [sparse]) * a        (keys, values and indexer keys)
      tensor_all_reduce   L * 4 * 2 f(n_t) * T_l * d * a           (attention and MLP outputs, fwd + bwd)
      head_grad_reduce_scatter  (head_blocks > 1: the loss's logits in blocks, `model.logprob_chunk_tokens`)
                          head_blocks * f(n_c) * V / n_t * d * 4 per micro-batch, over context: each block's fp32 head
                          gradient summed over the sequence's devices (`rl.logprobs.HEAD_PARTIALS`)
    backward=False: a forward-only pass (the logprob pass): one gather per micro-batch, no gradient terms, the
    experts' and context's forward trips only, tensor all-reduces halved.
    """
    sz = mesh_sizes(mesh)
    f = lambda n: (n - 1) / n if n > 1 else 0.0  # noqa: E731
    a = 4 if master == "none" else 2
    nc, nt = sz["context"], sz["tensor"]
    t_l = micro_batch * seq_len // nc
    copy_rules = step_copy_rules(mesh, rules)
    fsdp: dict[tuple, float] = {}  # (axes gathered, of them those gathered once per step) -> bytes W
    allreduce: dict[tuple, float] = {}

    def gathered_over(p, dims):
        # FSDP = a token axis shards a weight dimension other than the experts one (tokens travel to experts,
        # but every device needs the whole of any other weight)
        return tuple(x for x in ("data", "context", "expert") if sz[x] > 1
                     and any(x in axes for name, axes in zip(p.axes, dims) if name != "experts"))

    lookup: tuple[str, ...] = ()  # the token axes that cut the embedding table's rows
    for p in param_table(cfg):
        if p.buffer:
            continue
        dims = shard_axes(p, mesh, rules)
        pb = 4 if (master == "none" or p.fp32) else 2
        used = {x for axes in dims for x in axes}
        gathered = gathered_over(p, dims)
        if gathered and LOOKUP_ROWS in p.axes and (math.prod(sz[x] for x in gathered) * t_l * a
                                                   < p.shape[p.axes.index(LOOKUP_ROWS)] * pb):
            lookup, gathered = gathered, ()  # the tokens' rows are fewer bytes than the table's: exchange those
        if gathered:
            per_micro = gathered if copy_rules is None else gathered_over(p, shard_axes(p, mesh, copy_rules))
            key = (gathered, tuple(x for x in gathered if x not in per_micro))
            fsdp[key] = fsdp.get(key, 0.0) + local_elems(p, mesh, rules) * math.prod(sz[x] for x in gathered) * pb
        red = tuple(x for x in ("data", "context", "expert") if sz[x] > 1 and x not in used)
        if red:
            allreduce[red] = allreduce.get(red, 0.0) + local_elems(p, mesh, rules) * pb
    out = {}
    passes = 2 if backward else 1
    for (g, s), v in (fsdp or {(("data",), ()): 0.0}).items():
        r = tuple(x for x in g if x not in s)
        n_r, n_s = math.prod(sz[x] for x in r), math.prod(sz[x] for x in s)
        key = "" if len(fsdp) <= 1 else f"[{','.join(g)}]"
        out["fsdp_all_gather" + key] = (passes * f(n_r) * v * num_micro, r)
        if s:
            out["fsdp_step_all_gather" + key] = (f(n_s) * v / n_r, s)
        if backward:
            out["fsdp_reduce_scatter" + key] = (f(n_r) * v * num_micro, r)
            if s:
                out["fsdp_step_reduce_scatter" + key] = (f(n_s) * v / n_r * num_micro, s)
    if backward:
        for red, v in allreduce.items():
            n = math.prod(sz[x] for x in red)
            key = "grad_all_reduce" + ("" if len(allreduce) == 1 else f"[{','.join(red)}]")
            out[key] = (2 * f(n) * v * num_micro, red)
    if lookup:
        n = math.prod(sz[x] for x in lookup)
        rows = n * t_l * cfg.hidden_size * a  # the tokens of the devices that hold the other rows
        out["embedding_lookup"] = (((2 + 1) if backward else 2) * f(n) * rows * num_micro, lookup)
    n_moe = sum(m == MOE_MLP for m in cfg.mlp_layer_types)
    n_ep = mesh.expert_parallel
    trips = 4 + (exchange_recompute_trips(remat_policy) if remat else 0) if backward else 2
    ep_axes = tuple(x for x in mesh.expert_axes if sz[x] > 1)
    rows = t_l * cfg.num_experts_per_tok if sent_rows is None else sent_rows
    out["expert_all_to_all"] = (n_moe * trips * f(n_ep) * rows * cfg.hidden_size * a * num_micro, ep_axes)
    kvw = 0.0
    for t in cfg.layer_types:
        kvw += 2 * cfg.num_key_value_heads / nt * cfg.head_dim + (cfg.index_head_dim if t == SPARSE_ATTENTION else 0)
    context_trips = (3 if remat else 2) if backward else 1
    out["context_all_gather"] = (context_trips * f(nc) * micro_batch * seq_len * kvw * a * num_micro, ("context",))
    out["tensor_all_reduce"] = (cfg.num_hidden_layers * 4 * passes * f(nt) * t_l * cfg.hidden_size * a * num_micro,
                                ("tensor",))
    if backward and head_blocks > 1:
        out["head_grad_reduce_scatter"] = (head_blocks * f(nc) * cfg.vocab_size / nt * cfg.hidden_size * 4 * num_micro,
                                           ("context",))
    return {k: v for k, v in out.items() if v[0] > 0}


def step_time(executed_flops_per_device: float, comm: dict[str, tuple[float, tuple]], mesh: MeshConfig,
              hw: Hardware = Hardware()) -> dict[str, float]:
    """compute = FLOPs per device / (peak_flops * mfu); each collective = bytes / bandwidth of its axes
    (`axis_link`); total = compute + communication (no overlap assumed: an upper estimate);
    comm_share = communication / total."""
    compute = executed_flops_per_device / (hw.peak_flops * hw.mfu)
    out = {"compute_s": compute}
    comm_total = 0.0
    for name, (b, axes) in comm.items():
        t = b / axis_link(mesh, axes, hw)
        out[f"{name}_s"] = t
        comm_total += t
    out["comm_s"] = comm_total
    out["total_s"] = compute + comm_total
    out["comm_share"] = comm_total / out["total_s"] if out["total_s"] else 0.0
    return out
