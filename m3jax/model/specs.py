"""The layer kinds of an M3 config and the parameters each kind holds: shape and logical axes by name.

One table for the model (which creates them), the HF name map, the planner and the mesh checks
(`M3Config.param_specs`). It reads a config only through its fields, so the config module can
import it without a cycle.
"""

from __future__ import annotations

import dataclasses

FULL_ATTENTION = "full_attention"
SPARSE_ATTENTION = "minimax_m3_sparse"
DENSE_MLP = "dense"
MOE_MLP = "sparse"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # "normal" (std 0.02, as HF) or "zeros" (norms, bias)
    fp32: bool = False  # kept in fp32 whatever the model dtype (router)
    buffer: bool = False
    # False for a parameter the LM loss gives no gradient: the indexer, whose only output is a discrete
    # top-k choice of key blocks. Weight decay must leave it alone (`weight_decay_mask`).
    lm_gradient: bool = True


def layer_param_specs(cfg, attn_kind: str, mlp_kind: str) -> dict[str, ParamSpec]:
    """Per-layer parameter shapes (without the leading layer axis), in HF [out, in] orientation."""
    d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    specs = {
        "input_norm": ParamSpec((d,), ("norm",), "zeros"),
        "post_norm": ParamSpec((d,), ("norm",), "zeros"),
        "q_proj": ParamSpec((h, hd, d), ("q_heads", "head_dim", "embed")),
        "k_proj": ParamSpec((kv, hd, d), ("kv_heads", "head_dim", "embed")),
        "v_proj": ParamSpec((kv, hd, d), ("kv_heads", "head_dim", "embed")),
        "o_proj": ParamSpec((d, h, hd), ("embed", "q_heads", "head_dim")),
        "q_norm": ParamSpec((hd,), ("head_dim",), "zeros"),
        "k_norm": ParamSpec((hd,), ("head_dim",), "zeros"),
    }
    if attn_kind == SPARSE_ATTENTION:
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        specs.update({
            "index_q_proj": ParamSpec((hi, di, d), ("index_heads", "index_head_dim", "embed"), lm_gradient=False),
            "index_k_proj": ParamSpec((di, d), ("index_head_dim", "embed"), lm_gradient=False),
            "index_q_norm": ParamSpec((di,), ("index_head_dim",), "zeros", lm_gradient=False),
            "index_k_norm": ParamSpec((di,), ("index_head_dim",), "zeros", lm_gradient=False),
        })
    if mlp_kind == MOE_MLP:
        e, i, si = cfg.num_local_experts, cfg.intermediate_size, cfg.shared_intermediate_size
        specs.update({
            "router": ParamSpec((e, d), (None, "embed"), fp32=True),
            "router_bias": ParamSpec((e,), (None,), "zeros", fp32=True, buffer=True),
            "experts_gate_up": ParamSpec((e, 2, i, d), ("experts", None, "expert_mlp", "embed")),
            "experts_down": ParamSpec((e, d, i), ("experts", "embed", "expert_mlp")),
            "shared_gate_up": ParamSpec((2, si, d), (None, "mlp", "embed")),
            "shared_down": ParamSpec((d, si), ("embed", "mlp")),
        })
    else:
        i = cfg.dense_intermediate_size
        specs.update({
            "mlp_gate_up": ParamSpec((2, i, d), (None, "mlp", "embed")),
            "mlp_down": ParamSpec((d, i), ("embed", "mlp")),
        })
    return specs


def top_param_specs(cfg) -> dict[str, ParamSpec]:
    v, d = cfg.vocab_size, cfg.hidden_size
    return {
        "embed": ParamSpec((v, d), ("table_vocab", None)),
        "final_norm": ParamSpec((d,), ("norm",), "zeros"),
        "lm_head": ParamSpec((v, d), ("vocab", "embed")),
    }


def weight_decay_mask(cfg, params):
    """A pytree like `params` (the model's nnx.Param state) with True where AdamW may decay the parameter
    and False for the parameters without an LM gradient (`ParamSpec.lm_gradient`): with no gradient to
    balance it, decoupled decay alone would shrink the indexer by lr * weight_decay every step and so move
    its block choices. For `sharding.optim_step.adamw(..., decay_mask=...)`."""
    import jax  # here, so that the config module can import this table without jax

    frozen = {name.rsplit("/", 1)[-1] for name, spec in cfg.param_specs().items() if not spec.lm_gradient}

    def names(path):
        return {getattr(k, "key", getattr(k, "name", None)) for k in path}

    return jax.tree_util.tree_map_with_path(lambda path, _: not (names(path) & frozen), params)
