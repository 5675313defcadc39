"""Tiny random Hugging Face MiniMax-M3 models built locally (no hub), the parity reference.

The models themselves are built by `m3jax.tiny` (shared with scripts/bench_*.py); these are the names the
tests use for them, plus `hf_logits`.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from m3jax import tiny

TINY = tiny.HF_TINY
VARIANTS = tiny.HF_VARIANTS
tiny_config = tiny.hf_config        # (variant="release_like", **overrides) -> MiniMaxM3VLTextConfig
build_model = tiny.hf_model         # (cfg, seed=0, attn="eager") -> MiniMaxM3VLForCausalLM
save = tiny.save_hf                 # (model, path, layout="native", **save_pretrained_kw) -> path
released_model = tiny.released_hf_model
random_ids = tiny.random_ids        # (cfg, batch, seq, seed=0) -> int32 [batch, seq] in [3, vocab)


def hf_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kw = {} if attention_mask is None else {"attention_mask": torch.tensor(attention_mask)}
        return model(torch.tensor(ids, dtype=torch.long), **kw).logits.float().numpy()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
