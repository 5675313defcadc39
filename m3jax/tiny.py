"""Small random MiniMax-M3 models for benchmarks, tests and demos: the one place that builds them.

JAX side (needs only m3jax):
- `m3_config(...)`: an `M3Config` whose first `full_attention_layers` layers use full attention and the
  rest lightning-indexer sparse attention, and whose first `dense_layers` layers have a dense MLP and the
  rest MoE. The defaults are a 4-layer model (1 full + dense, 3 sparse + MoE with 8 experts, top-2,
  hidden 128); every other `M3Config` field can be passed by name.
- `m3_model(cfg, seed=0, ...)`: `M3ForCausalLM` with random weights.

Hugging Face side (the transformers reference; needs torch and transformers, imported on first use):
- `HF_TINY` / `HF_VARIANTS`: the tiny reference configs (several shapes: heads / KV heads / experts /
  top-k / rotary fraction / block sizes, and layer patterns where attention and MLP kinds do not line up);
  `hf_config(variant, **overrides)` builds one as a `MiniMaxM3VLTextConfig` (legacy key names);
- `hf_model(cfg, seed)`: the random fp32 HF model, with non-trivial norms and router bias (HF
  initialises them to 0); `save_hf(model, path, layout)` writes the native or the released layout;
  `m3_from_hf(model)` is the same weights as an m3jax model.

`random_ids(cfg, batch, seq)`: token ids in [3, vocab) (past the special ids) for either config.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np

from m3jax.config import DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION, M3Config

if TYPE_CHECKING:
    from m3jax.model.decoder import M3ForCausalLM


# ============================================================================== JAX: M3Config / M3ForCausalLM
def m3_config(*, layers: int = 4, full_attention_layers: int = 1, dense_layers: int = 1, vocab_size: int = 512,
              hidden_size: int = 128, num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 32,
              intermediate_size: int = 64, dense_intermediate_size: int = 256,
              shared_intermediate_size: int | None = None, num_local_experts: int = 8, num_experts_per_tok: int = 2,
              partial_rotary_factor: float = 0.5, index_n_heads: int = 2, index_head_dim: int = 32,
              index_block_size: int = 16, index_topk_blocks: int = 2, bos_token_id: int | None = 1,
              eos_token_id: int | None = 2, **fields: Any) -> M3Config:
    """A small M3Config: full attention then sparse, dense MLP then MoE (see the module docstring).

    shared_intermediate_size: None = intermediate_size. fields: any other M3Config field.
    """
    if not (0 <= full_attention_layers <= layers and 0 <= dense_layers <= layers):
        raise ValueError(f"full_attention_layers={full_attention_layers} and dense_layers={dense_layers} must be "
                         f"in [0, layers={layers}]")
    return M3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, dense_intermediate_size=dense_intermediate_size,
        shared_intermediate_size=intermediate_size if shared_intermediate_size is None else shared_intermediate_size,
        num_local_experts=num_local_experts, num_experts_per_tok=num_experts_per_tok,
        layer_types=(FULL_ATTENTION,) * full_attention_layers + (SPARSE_ATTENTION,) * (layers - full_attention_layers),
        mlp_layer_types=(DENSE_MLP,) * dense_layers + (MOE_MLP,) * (layers - dense_layers),
        partial_rotary_factor=partial_rotary_factor, index_n_heads=index_n_heads, index_head_dim=index_head_dim,
        index_block_size=index_block_size, index_topk_blocks=index_topk_blocks, bos_token_id=bos_token_id,
        eos_token_id=eos_token_id, **fields)


def m3_model(cfg: M3Config, seed: int = 0, dtype=None, **options: Any) -> "M3ForCausalLM":
    """`M3ForCausalLM(cfg)` with random weights from `seed`; dtype None = the model's default (float32);
    options: remat, attention_query_chunk, ..."""
    from flax import nnx

    from m3jax.model.decoder import M3ForCausalLM

    if dtype is not None:
        options["dtype"] = dtype
    return M3ForCausalLM(cfg, rngs=nnx.Rngs(seed), **options)


def random_ids(cfg, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """[batch, seq] int32 token ids in [3, cfg.vocab_size) (ids 0-2 are pad / bos / eos in these configs)."""
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, size=(batch, seq)).astype(np.int32)


# ============================================================================== Hugging Face reference
HF_TINY = dict(
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
HF_VARIANTS = {
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


def hf_config(variant: str = "release_like", **overrides: Any):
    """The tiny reference `MiniMaxM3VLTextConfig`: HF_TINY, then the variant's changes, then `overrides`."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    if variant not in HF_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; allowed: {', '.join(HF_VARIANTS)}")
    return MiniMaxM3VLTextConfig(**{**HF_TINY, **HF_VARIANTS[variant], **overrides})


def hf_model(cfg, seed: int = 0, attn: str = "eager"):
    """A random fp32 `MiniMaxM3VLForCausalLM` (eval mode) whose norms and router bias are non-trivial."""
    import torch
    from transformers import MiniMaxM3VLForCausalLM

    torch.manual_seed(seed)
    cfg._attn_implementation = attn  # transformers reads the attention kernel from this config attribute
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


def released_hf_model(text_model):
    """The multimodal class (`MiniMaxM3SparseForConditionalGeneration`, the release's layout) wrapping the
    same text weights, with a tiny vision tower."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    vcfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    cfg = MiniMaxM3VLConfig(text_config=text_model.config.to_dict(), vision_config=vcfg)
    vl = MiniMaxM3SparseForConditionalGeneration(cfg).eval()
    vl.model.language_model.load_state_dict(text_model.model.state_dict())
    vl.lm_head.load_state_dict(text_model.lm_head.state_dict())
    return vl


def save_hf(model, path: str, layout: str = "native", **kw: Any) -> str:
    """Save with transformers: "native" via the text class, "released" via the VL class (legacy names).
    kw: passed to `save_pretrained` (e.g. max_shard_size)."""
    if layout not in ("native", "released"):
        raise ValueError(f"layout={layout!r}: expected 'native' or 'released'")
    (model if layout == "native" else released_hf_model(model)).save_pretrained(path, **kw)
    return path


def m3_from_hf(model, dtype=None, **options: Any) -> "M3ForCausalLM":
    """The HF model's weights as an m3jax model (saved to a temporary directory and loaded back with
    `m3jax.from_pretrained`; options: remat, ...)."""
    from m3jax.hf.load import from_pretrained

    with tempfile.TemporaryDirectory(prefix="m3jax_tiny_") as d:
        save_hf(model, os.path.join(d, "model"), "native")
        return from_pretrained(os.path.join(d, "model"), dtype, **options)
