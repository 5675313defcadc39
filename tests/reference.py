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


def hf_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None,
              position_ids: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kw = {} if attention_mask is None else {"attention_mask": torch.tensor(attention_mask)}
        if position_ids is not None:
            kw["position_ids"] = torch.tensor(position_ids, dtype=torch.long)
        return model(torch.tensor(ids, dtype=torch.long), **kw).logits.float().numpy()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def next_token_grads(model, ids) -> dict:
    """{parameter path: gradient as numpy} of the mean next-token cross entropy of `model` (an M3ForCausalLM)
    on ids [B, S] (predicting ids[:, 1:] from ids[:, :-1])."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.asarray(ids)

    def loss_fn(params):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, params, rest)(ids[:, :-1]), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(jax.jit(jax.grad(loss_fn))(params))}


def assert_grads_close(got: dict, want: dict, rtol: float, at_least: int = 10) -> None:
    """Every gradient `want` holds a nonzero value in is within rtol (of its max) in `got`; one that is all
    zero in want (the indexer: no LM gradient) is all zero in got; at least `at_least` compared."""
    checked = 0
    for key, w in want.items():
        g = got[key]
        if not np.any(w):
            assert not np.any(g), key
            continue
        assert np.abs(g - w).max() / np.abs(w).max() < rtol, key
        checked += 1
    assert checked >= at_least, checked
