"""The model FLOPs of MiniMax-M3 (what the maths needs, pure Python): per token's matmuls, per (query, key) pair of
attention, the indexer's forward. The planner (`m3jax.plan.flops`) adds what m3jax executes beyond them; the
trainer's perf metrics (`rl.perf`) divide them by the time its passes took."""

from __future__ import annotations

from m3jax.config import MOE_MLP, SPARSE_ATTENTION, M3Config


def active_matmul_params(cfg: M3Config) -> dict[str, int]:
    """Weights one token multiplies through (2 FLOPs each per forward):

        attention  L * (H*D*d [q] + 2*KV*D*d [k, v] + d*H*D [o])
        indexer    L_sparse * (Hi*Di*d + Di*d)            (forward only: it gets no gradient)
        dense MLP  L_dense * 3*Id*d
        MoE        L_moe * (k * 3*I*d [routed] + 3*Is*d [shared] + E*d [router])
        head       V*d                                     (the embedding is a lookup, not a matmul)
    """
    d, h, kv, dd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = dict.fromkeys(("attention", "indexer", "dense_mlp", "moe", "head"), 0)
    for attn, mlp in zip(cfg.layer_types, cfg.mlp_layer_types):
        out["attention"] += 2 * h * dd * d + 2 * kv * dd * d
        if attn == SPARSE_ATTENTION:
            out["indexer"] += (cfg.index_n_heads + 1) * cfg.index_head_dim * d
        if mlp == MOE_MLP:
            out["moe"] += (cfg.num_experts_per_tok * 3 * cfg.intermediate_size * d
                           + 3 * cfg.shared_intermediate_size * d + cfg.num_local_experts * d)
        else:
            out["dense_mlp"] += 3 * cfg.dense_intermediate_size * d
    out["head"] = cfg.vocab_size * d
    return out


def causal_pairs(s: int, window: int | None = None) -> int:
    """(query, key) pairs with key <= query, each query seeing at most `window` keys:
    sum_{i=0}^{S-1} min(i + 1, W) = S(S+1)/2 if S <= W else W(W+1)/2 + (S - W) * W."""
    w = s if window is None else min(window, s)
    return w * (w + 1) // 2 + (s - w) * w


def model_flops(cfg: M3Config, seqs: int, seq_len: int) -> dict[str, float]:
    """The model FLOPs (what the maths needs) of training on `seqs` sequences of `seq_len` real tokens, N = seqs *
    seq_len: forward and backward of every matmul and attention pair, the indexer forward only (it gets no gradient).

        matmul         = 6 * (attention + dense_mlp + moe + head active params) * N     (fwd 2 + bwd 4)
        indexer_proj   = 2 * indexer params * N
        attention      = 12 * H*D * pairs per layer * seqs   (fwd QK^T and PV: 2 * 2*H*D a pair; bwd twice that);
                         pairs = causal_pairs(S) on full layers, causal_pairs(S, index_topk_blocks * index_block_size)
                         on sparse layers
        indexer_scores = 2 * Hi*Di * causal_pairs(S) * seqs per sparse layer
        model_total    = their sum
        forward_total  = (matmul + attention) / 3 + indexer_proj + indexer_scores   (a forward alone: a logprob pass)
    """
    act = active_matmul_params(cfg)
    n = seqs * seq_len
    window = cfg.index_topk_blocks * cfg.index_block_size
    pairs = sum(causal_pairs(seq_len, window if t == SPARSE_ATTENTION else None) for t in cfg.layer_types)
    n_sparse = sum(t == SPARSE_ATTENTION for t in cfg.layer_types)
    out = {
        "matmul": 6 * (act["attention"] + act["dense_mlp"] + act["moe"] + act["head"]) * n,
        "indexer_proj": 2 * act["indexer"] * n,
        "attention": 12 * cfg.num_attention_heads * cfg.head_dim * pairs * seqs,
        "indexer_scores": 2 * cfg.index_n_heads * cfg.index_head_dim * causal_pairs(seq_len) * n_sparse * seqs,
    }
    out["model_total"] = sum(out.values())
    out["forward_total"] = (out["matmul"] + out["attention"]) / 3 + out["indexer_proj"] + out["indexer_scores"]
    return out
