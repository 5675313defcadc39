"""Tiny random Hugging Face MiniMax-M3 models built locally (no hub), the parity reference."""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers import MiniMaxM3VLForCausalLM
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig, MiniMaxM3VLTextConfig
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, dense_intermediate_size=96,
    shared_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, rotary_dim=8, partial_rotary_factor=0.5, rope_theta=5e6,
    num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0,
    moe_layer_freq=[0, 1, 1, 1],
    sparse_attention_config=dict(sparse_num_index_heads=2, sparse_index_dim=16, sparse_block_size=8,
                                 sparse_topk_blocks=2, sparse_local_block=1,
                                 sparse_attention_freq=[0, 1, 1, 1]),
    max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)

# Several shapes: heads / kv heads / experts / top-k / rotary fraction / block size / top-k blocks /
# local blocks, and layer patterns where attention and MLP kinds do not line up.
VARIANTS = {
    "release_like": {},
    "mixed_kinds": dict(num_hidden_layers=5, moe_layer_freq=[1, 0, 1, 1, 0], num_attention_heads=8,
                        num_key_value_heads=4, head_dim=8, rotary_dim=4, partial_rotary_factor=0.25,
                        num_local_experts=6, num_experts_per_tok=3,
                        sparse_attention_config=dict(sparse_num_index_heads=4, sparse_index_dim=8,
                                                     sparse_block_size=4, sparse_topk_blocks=3,
                                                     sparse_local_block=2,
                                                     sparse_attention_freq=[1, 1, 0, 1, 1])),
    "mqa_full_rope": dict(num_attention_heads=6, num_key_value_heads=1, head_dim=16, rotary_dim=16,
                          partial_rotary_factor=1.0, num_local_experts=16, num_experts_per_tok=4,
                          sparse_attention_config=dict(sparse_num_index_heads=3, sparse_index_dim=32,
                                                       sparse_block_size=16, sparse_topk_blocks=2,
                                                       sparse_local_block=1,
                                                       sparse_attention_freq=[0, 1, 1, 1])),
}


def tiny_config(variant: str = "release_like", **overrides) -> MiniMaxM3VLTextConfig:
    kw = {**TINY, **VARIANTS[variant], **overrides}
    return MiniMaxM3VLTextConfig(**kw)


def build_model(cfg: MiniMaxM3VLTextConfig, seed: int = 0, attn: str = "eager") -> MiniMaxM3VLForCausalLM:
    """A random fp32 HF model whose norms and router bias are non-trivial (HF initialises them to 0)."""
    torch.manual_seed(seed)
    cfg._attn_implementation = attn
    model = MiniMaxM3VLForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def save(model: MiniMaxM3VLForCausalLM, path: str, layout: str = "native", **kw) -> str:
    """Save with transformers: "native" via the text class, "released" via the VL class (legacy names)."""
    if layout == "native":
        model.save_pretrained(path, **kw)
        return path
    vl = released_model(model)
    vl.save_pretrained(path, **kw)
    return path


def released_model(text_model) -> MiniMaxM3SparseForConditionalGeneration:
    """The multimodal class wrapping the same text weights (with a tiny vision tower)."""
    vcfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    cfg = MiniMaxM3VLConfig(text_config=text_model.config.to_dict(), vision_config=vcfg)
    vl = MiniMaxM3SparseForConditionalGeneration(cfg).eval()
    vl.model.language_model.load_state_dict(text_model.model.state_dict())
    vl.lm_head.load_state_dict(text_model.lm_head.state_dict())
    return vl


def random_ids(cfg, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, size=(batch, seq)).astype(np.int32)


def hf_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kw = {} if attention_mask is None else {"attention_mask": torch.tensor(attention_mask)}
        return model(torch.tensor(ids, dtype=torch.long), **kw).logits.float().numpy()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
