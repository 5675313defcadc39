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
from m3jax.model.indexer import KEY_CHUNK_BLOCKS
from m3jax.model.sparse import INDEX_QUERY_TILE
from m3jax.model.sparse import QUERY_TILE as GATHER_TILE
from m3jax.model.specs import layer_param_specs, top_param_specs
from m3jax.plan.remat import trains_as
from sharding.expert import receive_rows
from sharding.bucketed_grouped import bucket_rows
from sharding.grouped_matmul import DEFAULT_TILE
from sharding.mesh import MeshConfig

_SIZES = ("data", "context", "expert", "tensor")


def query_rows(chunk: int, s_local: int) -> int:
    """Query rows per scores block: q = min(chunk, S_l), S_l when chunking is off (chunk = 0)."""
    return min(chunk, s_local) if chunk else s_local


FLASH_TILE = 128  # m3jax.model.flash's default query / key tile


def sparse_keys(cfg: M3Config, seq_len: int) -> int:
    """Keys a sparse layer keeps per query: min(S, index_topk_blocks * index_block_size). The local blocks are
    forced INTO the top-K (HF sets their block score to +inf before the top-k), so they add no keys."""
    return min(seq_len, cfg.index_topk_blocks * cfg.index_block_size)


def attention_terms(cfg: M3Config, mesh: MeshConfig, sparse: bool, b: int, s: int, a: int, chunk: int,
                    impl: str = "dense", sparse_impl: str = "gather") -> tuple[dict, dict]:
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
    A sparse layer with sparse_impl "gather" (model.sparse_attention, the default; whatever impl is) walks its
    local queries in tiles of tq = min(GATHER_TILE, S_l) (a rematerialised scan: each tile is recomputed in
    its backward), with kb = min(S, K * bs) kept keys per query (`sparse_keys`):
        attention_scores  b * H_l * tq * kb * (12 + 2a)   one tile's scores over its gathered keys, the same
                          pieces as a dense block (fp32 scores, probabilities, dprobs, fp32 copy, dlogits)
        gathered_blocks   2 * 2 * b * U_l * tq * kb * D * a   the tile's K and V gathered per (query, head unit:
                          U = lcm(KV, Hi) units share a kv head and an index head, U_l = max(U / n_t, 1))
                          and their cotangents before the scatter-add into dK, dV
        indexer_scores    b * Hi * ti * (c * bs + S / bs) * 4   the indexer's tile of ti = INDEX_QUERY_TILE queries:
                          fp32 scores over one chunk of c = KEY_CHUNK_BLOCKS key blocks at a time and the
                          block maxima of every block (m3jax.model.indexer.key_block_scores)
        attention_qkv, gathered_kv as chunked (fp32 dK, dV accumulated over the tiles)
    and the residual kept through the MLP phase is q, k, v only (the scan saves its inputs).
    sparse_impl "masked": the sparse layer follows impl with a block mask, as the full layers do.
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
    if sparse and sparse_impl == "gather":
        tq, kb = min(GATHER_TILE, s_l), sparse_keys(cfg, s)
        phase["attention_scores"] = b * h_l * tq * kb * (12 + 2 * a)
        units = max(math.lcm(cfg.num_key_value_heads, cfg.index_n_heads) / nt, 1)
        phase["gathered_blocks"] = 2 * 2 * b * units * tq * kb * hd * a
        bs = cfg.index_block_size
        ti = min(INDEX_QUERY_TILE, s_l)
        phase["indexer_scores"] = b * cfg.index_n_heads * ti * (min(KEY_CHUNK_BLOCKS * bs, s) + s / bs) * 4
        phase["gathered_kv"] = 2 * 2 * b * s * kv_l * hd * (a + 4)
        return phase, {"attention_residuals": (phase["attention_qkv"] + phase["gathered_kv"]) / 2}
    if sparse_impl not in ("gather", "masked"):
        raise ValueError(f"sparse_impl={sparse_impl!r}: expected 'gather' or 'masked'")
    if impl in ("flash", "cudnn"):  # cuDNN's fused attention: per-query statistics and tiles, as flash
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
                          2 * G * C * 3 * I / n_t * a with the bucketed kernel (its buckets' hidden, C =
                          `sharding.bucketed_grouped.bucket_rows` of the balanced T_l * k / G rows)
        expert_grad_fp32  G * 3 * I / n_t * d * 4   with the tiled kernel (and the bucketed one's overflow walk):
                          its fp32 accumulators of the local experts' weight gradients (cast to the param dtype
                          when its backward ends)
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
    hidden_rows = {"tiled": min(tile, w), "bucketed": g * bucket_rows(t_l * k / g)}.get(ragged_dot, w)
    return {"moe_dispatch": 2 * n_buf * w * d * a,
            "expert_hidden": 2 * hidden_rows * 3 * i_l * a,
            "expert_grad_fp32": g * 3 * i_l * d * 4 if ragged_dot in ("tiled", "bucketed") else 0.0,
            "ragged_dot_expansion": g * w * (d + 2 * i_l) * a if g > 1 and ragged_dot == "dense" else 0.0,
            "token_rows": 2 * t_l * k * d * (2 * a + 4),
            "mlp_hidden": 2 * t_l * 3 * cfg.shared_intermediate_size / nt * a}


def gathered_weights(cfg: M3Config, mesh: MeshConfig, attn: str, mlp: str, a: int, shard_dims) -> float:
    """2 * (this layer's non-expert weights with the FSDP shard (`mesh.fsdp_axes`) undone) * p: the weights gathered
    for the layer and their gradient before the reduce-scatter. shard_dims(param) -> mesh axes per dim."""
    sz = dict(zip(_SIZES, mesh.shape))
    total = 0.0
    for name, spec in layer_param_specs(cfg, attn, mlp).items():
        if name.startswith("experts_"):
            continue
        dims = shard_dims(name, spec)
        n = math.prod(-(-dim // math.prod(sz[x] for x in axes if x not in mesh.fsdp_axes))
                      for dim, axes in zip(spec.shape, dims))
        total += n * (4 if spec.fp32 else a)
    return 2 * total


def layer_phases(cfg: M3Config, mesh: MeshConfig, attn: str, mlp: str, batch, a: int, exchange: str,
                 shard_dims) -> dict[str, dict]:
    """{"mlp": terms, "attention": terms} of one layer of the given kinds (see the module docstring)."""
    sz = dict(zip(_SIZES, mesh.shape))
    b, s = batch.micro_batch, batch.seq_len
    t_l = b * (s // sz["context"])
    from m3jax.model.attention import sees_every_block
    selects = attn == SPARSE_ATTENTION and not sees_every_block(s, cfg)  # else the model runs it as a full layer
    att, residual = attention_terms(cfg, mesh, selects, b, s, a, batch.attention_query_chunk,
                                    batch.attention, trains_as(batch.sparse_attention))
    if mlp == MOE_MLP:
        part = moe_terms(cfg, mesh, t_l, a, batch.moe_capacity_factor, exchange, batch.expert_matmul)
    else:
        part = {"mlp_hidden": 2 * t_l * 3 * cfg.dense_intermediate_size / sz["tensor"] * a}
    weights = {"gathered_weights": gathered_weights(cfg, mesh, attn, mlp, a, shard_dims)}
    return {"mlp": {**weights, **residual, **part}, "attention": {**weights, **att}}


def logprob_blocks(s: int, chunk_tokens: int) -> int:
    """Blocks of `rl.logprobs.chunked_token_logprobs` over a row of S positions: n = ceil(S / chunk); 1 when
    chunking is off (chunk_tokens = 0)."""
    return -(-s // chunk_tokens) if chunk_tokens else 1


def logprob_block_rows(s: int, chunk_tokens: int) -> int:
    """Positions of a row in one block of `rl.logprobs.chunked_token_logprobs`: ceil(S / n) strided positions of
    n = `logprob_blocks`; S when chunking is off (chunk_tokens = 0)."""
    return -(-s // logprob_blocks(s, chunk_tokens))


def head_terms(cfg: M3Config, mesh: MeshConfig, b: int, s: int, a: int, shard_dims, chunk_tokens: int = 0,
               entropy: bool = False) -> dict:
    """The head's backward, bytes per device (c_l = ceil(c / n_c) local positions of a logits block of c =
    `logprob_block_rows(S, chunk_tokens)` positions per row; c = S, so b * c_l = T_l, unchunked):

        head_logits       b * c_l * V / n_t * (a + 8)   one block's logits, fp32 log-softmax and its gradient;
                          + 4 with `entropy` (the loss's entropy, `grpo.entropy_coef` / `logging.entropy`: one
                          more fp32 buffer of the block, measured on XLA:CPU's one-block path)
        gathered_head     2 * V / n_t * d * p           lm_head gathered over data for the matmul (FSDP shards its
                          embed dim) and its full gradient before the reduce-scatter; 0 without FSDP
    With chunk_tokens (`model.logprob_chunk_tokens`: `rl.logprobs.chunked_token_logprobs`, a custom VJP whose
    backward scans the blocks and sums the head's gradient in fp32):
        gathered_head     V / n_t * d * (p [the gathered weight, FSDP only] + 4 [one block's fp32 gradient
                          of the whole local head, before it is reduced into the sum])
        head_grad_fp32    V / n_t * d / n_c * 4   the fp32 partial sum of the head gradient that each batch shard
                          keeps over the blocks, cut over the sequence's devices, when the batch is cut (n_b > 1:
                          reduced over the batch shards once after the scan, `rl.logprobs.HEAD_PARTIALS`); else the
                          head's local elements * 4 (the sum placed as the head is)
    (one block only when S <= chunk_tokens: then the full-logits program, as unchunked).
    """
    sz = dict(zip(_SIZES, mesh.shape))
    spec = top_param_specs(cfg)["lm_head"]
    dims = shard_dims("lm_head", spec)
    fsdp = any(x in axes for axes in dims for x in mesh.fsdp_axes)
    c = logprob_block_rows(s, chunk_tokens)
    rows = b * -(-c // sz["context"])
    head = cfg.vocab_size / sz["tensor"] * cfg.hidden_size
    out = {"head_logits": rows * cfg.vocab_size / sz["tensor"] * (a + 8 + (4 if entropy else 0)),
           "gathered_head": 2 * head * a if fsdp else 0.0}
    if c < s:
        local = math.prod(-(-dim // math.prod(sz[x] for x in axes)) for dim, axes in zip(spec.shape, dims))
        out["gathered_head"] = head * ((a if fsdp else 0) + 4)
        per_batch_shard = sz["data"] * sz["expert"] > 1
        out["head_grad_fp32"] = (head / sz["context"] if per_batch_shard else local) * 4
    return out
