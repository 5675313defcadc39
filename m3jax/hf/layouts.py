"""One table between HF checkpoint names and m3jax parameters, used by load, save and weight transfer.

Every HF tensor is a `Slot`: a name, its HF shape, the m3jax parameter it lives in (a path into the
model's state), and the leading index inside that parameter (layer within the stack, expert, gate/up
half). The tensor is that sub-array reshaped; no transposes are needed because m3jax keeps HF's
[out, in] orientation. Layouts (../shared/docs/m3-architecture.md §4):
- "native":   `model.layers.{i}.mlp.experts.gate_up_proj`, `self_attn.indexer.*` (text-only class);
- "native_vl": the same under `model.language_model.` (VL class state dict before conversion);
- "released": `language_model.model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2`,
  `self_attn.index_*` (the shipped checkpoint, and what the VL class's save_pretrained writes).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator

from m3jax.config import MOE_MLP, SPARSE_ATTENTION, M3Config

LAYOUTS = ("native", "native_vl", "released")
_PREFIX = {
    "native": ("model.", "lm_head.weight"),
    "native_vl": ("model.language_model.", "lm_head.weight"),
    "released": ("language_model.model.", "language_model.lm_head.weight"),
}
# Tensors of a released checkpoint that the text model does not hold: skipped with one info line.
SKIPPED = re.compile(r"^(vision_tower|multi_modal_projector|patch_merge_mlp|model\.vision_tower|"
                     r"model\.multi_modal_projector|model\.patch_merge_mlp|visual)\.|(^|\.)mtp\.")


# transformers 5.19's VL save_pretrained renames every `.mlp.` to `.block_sparse_moe.`, dense layers
# included; the release and vLLM keep dense layers under `.mlp.`. Both are read; `.mlp.` is written.
_DENSE_ALIAS = re.compile(r"^(language_model\.model\.layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$")


def canonical_name(name: str) -> str:
    """The name `slots` uses for a checkpoint tensor that has another spelling in the wild."""
    return _DENSE_ALIAS.sub(r"\1mlp.\2", name)


@dataclasses.dataclass(frozen=True)
class Slot:
    name: str  # HF tensor name
    shape: tuple[int, ...]  # HF shape
    param: tuple  # path into nnx.state(model): ("embed",) or ("stacks", s, "experts_gate_up")
    index: tuple[int, ...] = ()  # leading index into the parameter


def detect_layout(names) -> str:
    names = list(names)
    if any(n.startswith("language_model.") for n in names):
        return "released"
    if any(n.startswith("model.language_model.") for n in names):
        return "native_vl"
    return "native"


def slots(cfg: M3Config, layout: str) -> Iterator[Slot]:
    """Every HF tensor of the text model in `layout`, in checkpoint order (by layer)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    pre, lm_head = _PREFIX[layout]
    released = layout == "released"
    d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    yield Slot(f"{pre}embed_tokens.weight", (cfg.vocab_size, d), ("embed",))
    stack_of = {}
    for s, (_, _, ids) in enumerate(cfg.segments()):
        for pos, i in enumerate(ids):
            stack_of[i] = (s, pos)
    for i in range(cfg.num_hidden_layers):
        s, l = stack_of[i]
        p = f"{pre}layers.{i}."

        def slot(name, shape, param, *index):
            return Slot(p + name, shape, ("stacks", s, param), (l, *index))

        yield slot("input_layernorm.weight", (d,), "input_norm")
        yield slot("post_attention_layernorm.weight", (d,), "post_norm")
        yield slot("self_attn.q_proj.weight", (h * hd, d), "q_proj")
        yield slot("self_attn.k_proj.weight", (kv * hd, d), "k_proj")
        yield slot("self_attn.v_proj.weight", (kv * hd, d), "v_proj")
        yield slot("self_attn.o_proj.weight", (d, h * hd), "o_proj")
        yield slot("self_attn.q_norm.weight", (hd,), "q_norm")
        yield slot("self_attn.k_norm.weight", (hd,), "k_norm")
        if cfg.layer_types[i] == SPARSE_ATTENTION:
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            ix = "self_attn.index_" if released else "self_attn.indexer."
            yield slot(f"{ix}q_proj.weight", (hi * di, d), "index_q_proj")
            yield slot(f"{ix}k_proj.weight", (di, d), "index_k_proj")
            yield slot(f"{ix}q_norm.weight", (di,), "index_q_norm")
            yield slot(f"{ix}k_norm.weight", (di,), "index_k_norm")
        if cfg.mlp_layer_types[i] == MOE_MLP:
            e, inter, si = cfg.num_local_experts, cfg.intermediate_size, cfg.shared_intermediate_size
            if released:
                m = "block_sparse_moe."
                yield slot(f"{m}gate.weight", (e, d), "router")
                yield slot(f"{m}e_score_correction_bias", (e,), "router_bias")
                for x in range(e):
                    yield slot(f"{m}experts.{x}.w1.weight", (inter, d), "experts_gate_up", x, 0)
                    yield slot(f"{m}experts.{x}.w3.weight", (inter, d), "experts_gate_up", x, 1)
                    yield slot(f"{m}experts.{x}.w2.weight", (d, inter), "experts_down", x)
                yield slot(f"{m}shared_experts.gate_proj.weight", (si, d), "shared_gate_up", 0)
                yield slot(f"{m}shared_experts.up_proj.weight", (si, d), "shared_gate_up", 1)
                yield slot(f"{m}shared_experts.down_proj.weight", (d, si), "shared_down")
            else:
                yield slot("mlp.gate.weight", (e, d), "router")
                yield slot("mlp.gate.e_score_correction_bias", (e,), "router_bias")
                yield slot("mlp.experts.gate_up_proj", (e, 2 * inter, d), "experts_gate_up")
                yield slot("mlp.experts.down_proj", (e, d, inter), "experts_down")
                yield slot("mlp.shared_experts.gate_up_proj.weight", (2 * si, d), "shared_gate_up")
                yield slot("mlp.shared_experts.down_proj.weight", (d, si), "shared_down")
        else:
            inter = cfg.dense_intermediate_size
            if released:
                yield slot("mlp.gate_proj.weight", (inter, d), "mlp_gate_up", 0)
                yield slot("mlp.up_proj.weight", (inter, d), "mlp_gate_up", 1)
            else:
                yield slot("mlp.gate_up_proj.weight", (2 * inter, d), "mlp_gate_up")
            yield slot("mlp.down_proj.weight", (d, inter), "mlp_down")
    yield Slot(f"{pre}norm.weight", (d,), ("final_norm",))
    yield Slot(lm_head, (cfg.vocab_size, d), ("lm_head",))
