"""m3jax.tiny: the one builder of the small random models that benchmarks and tests share."""

import numpy as np
import pytest

from m3jax import tiny
from m3jax.config import DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION
from tests import reference as ref


def test_m3_config_layer_pattern_and_defaults():
    cfg = tiny.m3_config()
    assert cfg.layer_types == (FULL_ATTENTION,) + (SPARSE_ATTENTION,) * 3
    assert cfg.mlp_layer_types == (DENSE_MLP,) + (MOE_MLP,) * 3
    assert (cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.vocab_size) == (128, 8, 2, 512)
    assert cfg.shared_intermediate_size == cfg.intermediate_size  # None = the routed experts' width
    two = tiny.m3_config(layers=2, full_attention_layers=2, dense_layers=0, pad_token_id=0, num_local_experts=4)
    assert two.layer_types == (FULL_ATTENTION,) * 2 and two.mlp_layer_types == (MOE_MLP,) * 2
    assert two.pad_token_id == 0 and two.num_local_experts == 4  # any other M3Config field passes through
    with pytest.raises(ValueError, match="dense_layers=5"):
        tiny.m3_config(layers=4, dense_layers=5)


@pytest.mark.slow  # three eager forwards
def test_m3_model_is_seeded_and_runs():
    cfg = tiny.m3_config(layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         intermediate_size=16, dense_intermediate_size=32, num_local_experts=4, vocab_size=64,
                         index_head_dim=16, index_block_size=4)
    ids = tiny.random_ids(cfg, 2, 12, seed=1)
    assert ids.dtype == np.int32 and ids.shape == (2, 12) and ids.min() >= 3 and ids.max() < cfg.vocab_size
    a = np.asarray(tiny.m3_model(cfg, seed=3)(ids))
    b = np.asarray(tiny.m3_model(cfg, seed=3)(ids))
    c = np.asarray(tiny.m3_model(cfg, seed=4)(ids))
    assert a.shape == (2, 12, cfg.vocab_size) and np.isfinite(a).all()
    assert np.array_equal(a, b) and not np.allclose(a, c)


@pytest.mark.slow  # builds a torch model and converts it
def test_hf_reference_and_its_m3jax_copy_agree():
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        tiny.hf_config("nope")
    cfg = tiny.hf_config("mixed_kinds", max_position_embeddings=512)
    assert cfg.max_position_embeddings == 512  # overrides win
    assert cfg.num_local_experts == tiny.HF_VARIANTS["mixed_kinds"]["num_local_experts"]  # the variant's change
    assert cfg.hidden_size == tiny.HF_TINY["hidden_size"]  # the rest from HF_TINY
    hf = tiny.hf_model(cfg, seed=5)
    ids = tiny.random_ids(cfg, 2, 10, seed=0)
    m3 = tiny.m3_from_hf(hf)
    np.testing.assert_allclose(np.asarray(m3(ids)), ref.hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


def test_tests_reference_is_m3jax_tiny():
    assert ref.TINY is tiny.HF_TINY and ref.VARIANTS is tiny.HF_VARIANTS
    assert (ref.tiny_config, ref.build_model, ref.save, ref.random_ids) == \
        (tiny.hf_config, tiny.hf_model, tiny.save_hf, tiny.random_ids)
