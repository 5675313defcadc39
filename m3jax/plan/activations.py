"""Analytic activation memory of one micro-batch's forward + backward, per device, by phase.

Notation as in `m3jax.plan.memory`; a = activation bytes, p = param bytes, b = micro-batch,
S / S_l = sequence / local sequence, T_l = b * S_l, H_l = H / n_t, KV_l = KV / n_t, q = the query rows of
one attention-scores block (min(attention_query_chunk, S_l), or S_l unchunked), W = receive rows of the
expert exchange (`sharding.expert.receive_rows`), G = local experts (E / n_ep).

With remat the backward of layer l recomputes its forward, keeps the values its backward needs
(residuals) and then runs the backward of the MLP part before that of the attention part. So a layer's
peak is the larger of two phases, both on top of the layer's gathered weights:
    MLP phase        attention residuals + the MLP part's residuals and cotangents
    attention phase  the attention part's residuals and cotangents
and the micro-batch's peak is checkpoints + inputs + max(layer peak, head phase) (the head's backward
runs before any layer's).
"""

from __future__ import annotations

import math

from m3jax.config import MOE_MLP, SPARSE_ATTENTION, M3Config
from m3jax.model.specs import layer_param_specs, top_param_specs
from sharding.expert import receive_rows
from sharding.grouped_matmul import DEFAULT_TILE
from sharding.mesh import MeshConfig

_SIZES = ("data", "context", "expert", "tensor")


def query_rows(chunk: int, s_local: int) -> int:
    """Query rows per scores block: q = min(chunk, S_l), S_l when chunking is off (chunk = 0)."""
    return min(chunk, s_local) if chunk else s_local


FLASH_TILE = 128  # m3jax.model.flash's default query / key tile


def attention_terms(cfg: M3Config, mesh: MeshConfig, sparse: bool, b: int, s: int, a: int, chunk: int,
                    impl: str = "dense") -> tuple[dict, dict]:
    """(attention phase terms, attention residuals kept through the MLP phase), bytes per device:

        attention_scores  b * H_l * q * S * (12 + 2a + m): the block's softmax output (fp32) and probabilities
                          (a) and its token mask (m = 1 byte per head on sparse layers), then in the backward
                          dprobs (a), their fp32 copy and dlogits (fp32). Unchunked, XLA keeps all of it
                          through the MLP phase as well (XLA:CPU at S = 1024 held the sum of both phases);
                          chunked, each block is recomputed in its own backward
        indexer_scores    b * Hi * q * S * 8            fp32 scores and their block-padded copy (sparse layers)
        attention_qkv     2 * T_l * (2 H_l + 2 KV_l) * D * a   q, o, local k, v and their cotangents
        gathered_kv       2 * 2 * b * S * KV_l * D * (a + 4 if chunked)   keys and values gathered over
                          context (+ the fp32 copies the chunk scan accumulates dK, dV in) and cotangents
    With impl "flash" (m3jax.model.flash: online softmax over key tiles, custom VJP) no [q, S] block exists:
        attention_scores  b * H_l * (S_l * (8 + 4 D) + t^2 * (12 + 2a))   running max / sum and the fp32
                          output accumulator per query, one t x t tile's scores (t = FLASH_TILE)
        gathered_kv       as chunked (fp32 dK, dV accumulators)
    and the residual kept through the MLP phase is the output's logsumexp (b * H_l * S_l * 4) besides q, k, v.
    The indexer's scores are unchanged (issue 11 item 3).
    """
    sz = dict(zip(_SIZES, mesh.shape))
    nt, s_l = sz["tensor"], s // sz["context"]
    t_l, q = b * s_l, query_rows(chunk, s_l)
    h_l, kv_l, hd = cfg.num_attention_heads / nt, max(cfg.num_key_value_heads / nt, 1), cfg.head_dim
    m = 1 if sparse else 0
    blk = b * h_l * q * s
    chunked = q < s_l
    phase = {"attention_scores": blk * (12 + 2 * a + m),
             "indexer_scores": b * cfg.index_n_heads * q * s * 8 if sparse else 0.0,
             "attention_qkv": 2 * t_l * (2 * h_l + 2 * kv_l) * hd * a,
             "gathered_kv": 2 * 2 * b * s * kv_l * hd * (a + (4 if chunked else 0))}
    if impl == "flash":
        t = FLASH_TILE
        phase["attention_scores"] = b * h_l * (s_l * (8 + 4 * hd) + t * t * (12 + 2 * a + m))
        phase["gathered_kv"] = 2 * 2 * b * s * kv_l * hd * (a + 4)
        residual = b * h_l * s_l * 4 + (phase["attention_qkv"] + phase["gathered_kv"]) / 2
        return phase, {"attention_residuals": residual}
    residual = (0.0 if chunked else phase["attention_scores"]) + (phase["attention_qkv"] + phase["gathered_kv"]) / 2
    return phase, {"attention_residuals": residual}


def moe_terms(cfg: M3Config, mesh: MeshConfig, t_l: int, a: int, capacity_factor: float | None, exchange: str,
              ragged_dot: str, tile: int = DEFAULT_TILE) -> dict:
    """MoE part of the MLP phase (residuals and cotangents), bytes per device:

        moe_dispatch      2 * n_buf * W * d * a     the exchange's [W, d] buffers and cotangents: padded
                          n_buf = 6 (send, receive, regrouped, expert output, return send, return receive);
                          ragged 2 (receive, expert output) + 2 (regrouped, scattered back) when G > 1
        expert_hidden     2 * W * 3 * I / n_t * a   gate_up output and activation of the received rows;
                          2 * tile * 3 * I / n_t * a with the tiled kernel (ragged_dot = "tiled": its fused
                          MLP holds one tile's hidden at a time and recomputes it in the backward)
        expert_grad_fp32  G * 3 * I / n_t * d * 4   with the tiled kernel: its fp32 accumulators of the local
                          experts' weight gradients (cast to the param dtype when its backward ends)
        ragged_dot_expansion  G * W * (d + 2 I / n_t) * a   when G > 1 and the grouped matmul is lowered
                          densely (XLA's GPU default and the CPU): rows zero-padded per group, [G, W, in] and
                          [G, W, out] (the transient of one matmul)
        token_rows        2 * T_l * k * d * (2a + 4)   routed copies of the tokens, their outputs, fp32 weighted
        mlp_hidden        2 * T_l * 3 * Is / n_t * a   the shared expert
    """
    sz = dict(zip(_SIZES, mesh.shape))
    nt, d, k = sz["tensor"], cfg.hidden_size, cfg.num_experts_per_tok
    n_ep = mesh.expert_parallel
    g = cfg.num_local_experts // n_ep
    w = receive_rows(t_l, k, n_ep, g, capacity_factor, exchange)
    n_buf = 6 if exchange == "padded" or n_ep == 1 else 2 + (2 if g > 1 else 0)
    i_l = cfg.intermediate_size / nt
    return {"moe_dispatch": 2 * n_buf * w * d * a,
            "expert_hidden": 2 * (min(tile, w) if ragged_dot == "tiled" else w) * 3 * i_l * a,
            "expert_grad_fp32": g * 3 * i_l * d * 4 if ragged_dot == "tiled" else 0.0,
            "ragged_dot_expansion": g * w * (d + 2 * i_l) * a if g > 1 and ragged_dot == "dense" else 0.0,
            "token_rows": 2 * t_l * k * d * (2 * a + 4),
            "mlp_hidden": 2 * t_l * 3 * cfg.shared_intermediate_size / nt * a}


def gathered_weights(cfg: M3Config, mesh: MeshConfig, attn: str, mlp: str, a: int, shard_dims) -> float:
    """2 * (this layer's non-expert weights with the data (FSDP) shard undone) * p: the weights gathered
    for the layer and their gradient before the reduce-scatter. shard_dims(param) -> mesh axes per dim."""
    sz = dict(zip(_SIZES, mesh.shape))
    total = 0.0
    for name, spec in layer_param_specs(cfg, attn, mlp).items():
        if name.startswith("experts_"):
            continue
        dims = shard_dims(name, spec)
        n = math.prod(-(-dim // math.prod(sz[x] for x in axes if x != "data")) for dim, axes in zip(spec.shape, dims))
        total += n * (4 if spec.fp32 else a)
    return 2 * total


def layer_phases(cfg: M3Config, mesh: MeshConfig, attn: str, mlp: str, batch, a: int, exchange: str,
                 shard_dims) -> dict[str, dict]:
    """{"mlp": terms, "attention": terms} of one layer of the given kinds (see the module docstring)."""
    sz = dict(zip(_SIZES, mesh.shape))
    b, s = batch.micro_batch, batch.seq_len
    t_l = b * (s // sz["context"])
    att, residual = attention_terms(cfg, mesh, attn == SPARSE_ATTENTION, b, s, a, batch.attention_query_chunk,
                                    batch.attention_impl)
    if mlp == MOE_MLP:
        part = moe_terms(cfg, mesh, t_l, a, batch.moe_capacity_factor, exchange, batch.expert_matmul)
    else:
        part = {"mlp_hidden": 2 * t_l * 3 * cfg.dense_intermediate_size / sz["tensor"] * a}
    weights = {"gathered_weights": gathered_weights(cfg, mesh, attn, mlp, a, shard_dims)}
    return {"mlp": {**weights, **residual, **part}, "attention": {**weights, **att}}


def head_terms(cfg: M3Config, mesh: MeshConfig, t_l: int, a: int, shard_dims) -> dict:
    """The head's backward, bytes per device:

        head_logits       T_l * V / n_t * (a + 8)      logits, fp32 log-softmax and its gradient
        gathered_head     2 * V / n_t * d * p           lm_head gathered over data for the matmul (FSDP shards its
                          embed dim) and its full gradient before the reduce-scatter; 0 without FSDP
    """
    sz = dict(zip(_SIZES, mesh.shape))
    spec = top_param_specs(cfg)["lm_head"]
    fsdp = any("data" in axes for axes in shard_dims("lm_head", spec))
    return {"head_logits": t_l * cfg.vocab_size / sz["tensor"] * (a + 8),
            "gathered_head": 2 * cfg.vocab_size / sz["tensor"] * cfg.hidden_size * a if fsdp else 0.0}
