"""rl.generation.backends: the run's sampling parameters and the probe check's index arithmetic."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.config import M3Config
from rl.config import load_config
from rl.generation import backends
from rl.generation.base import token_logprobs

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
TINY_VLLM = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-vllm.yaml")


def test_empty_stop_tokens_mean_the_models_eos():
    cfg = load_config(TINY, ["generation.stop_token_ids=[]"])
    assert backends.sampling_of(cfg, 12).stop_token_ids == (12,)
    assert backends.sampling_of(cfg, (7, 12)).stop_token_ids == (7, 12)
    explicit = load_config(TINY, ["generation.stop_token_ids=[5]"])
    assert backends.sampling_of(explicit, 12).stop_token_ids == (5,)


@pytest.mark.slow  # compiles a model's logprob pass
def test_probe_batch_and_diff_line_up_with_per_sequence_logprobs():
    cfg = M3Config(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=16, intermediate_size=16, dense_intermediate_size=48, shared_intermediate_size=16,
                   num_local_experts=2, num_experts_per_tok=1, layer_types=("full_attention",),
                   mlp_layer_types=("dense",), index_n_heads=1, index_head_dim=16, index_block_size=4,
                   index_topk_blocks=1)
    model = m3jax.M3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    prompts, responses = backends.probe_sequences(3, cfg.vocab_size, 5, 4)
    prompts[1] = prompts[1][:3]  # ragged prompts: the response starts at a different column
    b = backends.probe_batch(prompts, responses, width=12, pad_id=0)
    logits = model(jnp.asarray(b["input_ids"][0]), attention_mask=jnp.asarray(b["attention_mask"][0]))
    batch_lp = np.asarray(token_logprobs(logits, jnp.asarray(b["targets"][0]), 1.0))
    per_seq = []
    for p, r in zip(prompts, responses):
        lg = model(jnp.asarray([p + r]))[0, len(p) - 1:len(p) + len(r) - 1]
        per_seq.append(np.asarray(token_logprobs(lg, jnp.asarray(r), 1.0)))
    assert backends.probe_max_abs_diff([per_seq], batch_lp, prompts) < 1e-5
    shifted = [np.roll(x, 1) for x in per_seq]  # an off-by-one alignment must show up
    assert backends.probe_max_abs_diff([shifted], batch_lp, prompts) > 1e-2


def test_probe_diff_under_top_k_fails_on_stale_or_nan_weights():
    """|-inf - -inf| is NaN and max(worst, NaN) kept worst: under top-k every probe with a token outside the kept set
    was passed over, and an engine serving stale or NaN weights read a difference of 0."""
    inf = -np.inf
    prompts = [[1, 2], [3, 4]]
    trainer = np.array([[0.0, -0.5, inf, -1.0], [0.0, -0.7, -0.2, inf]])
    same = [[np.array([-0.5, inf, -1.0]), np.array([-0.7, -0.2, inf])]]
    assert backends.probe_max_abs_diff(same, trainer, prompts) == 0.0  # -inf on both sides agrees
    stale = [[np.array([-0.5, -2.0, inf]), np.array([-0.7, -0.2, inf])]]  # another kept set
    assert backends.probe_max_abs_diff(stale, trainer, prompts) == np.inf
    nan = [[np.array([-0.5, inf, -1.0]), np.array([np.nan, np.nan, np.nan])]]
    assert backends.probe_max_abs_diff(nan, trainer, prompts) == np.inf
    off = [[np.array([-0.5, inf, -1.25]), np.array([-0.7, -0.2, inf])]]
    assert backends.probe_max_abs_diff(off, trainer, prompts) == 0.25


def test_weight_transport_is_read_where_the_pool_is_built(monkeypatch, tmp_path):
    """generation.weight_transport (and the two host-memory switches, and where the collective path's buckets
    live) reach the pool's config, and a transport that is not built, or a CUDA group without CUDA, stops the
    pool before any engine (or Ray) starts."""
    from rl.generation import vllm_pool

    import types

    from flax import nnx

    from m3jax import tiny

    built = []
    monkeypatch.setattr(vllm_pool, "VLLMPool", lambda pool_cfg, graphdef, pad_id: built.append(pool_cfg))
    model = tiny.m3_model(load_config(TINY_VLLM).model.m3_config(), seed=0)  # the trainer's model
    path = m3jax.save_pretrained(model, tmp_path / "release", layout="released")  # what the engines start from
    cfg = load_config(TINY_VLLM, ["model.tiny=null", f"model.path={path}"], check_paths=False)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = types.SimpleNamespace(params=params, rest=rest)
    backends.make_generator(cfg, graphdef, state, pad_id=0, run_dir="/nowhere")
    assert built[0].transport == cfg.generation.weight_transport == "ray"
    assert built[0].vocab_size == model.cfg.vocab_size  # the pool refuses ids past it (test_vllm_pool_logic.py)
    assert built[0].malloc_tuning and built[0].warm_object_store  # the defaults (rl.generation.host_memory, local_ray)
    off = load_config(TINY_VLLM, ["model.tiny=null", f"model.path={path}", "generation.vllm_malloc_tuning=false",
                                  "generation.vllm_object_store_warmup=false"], check_paths=False)
    backends.make_generator(off, graphdef, state, pad_id=0, run_dir="/nowhere")
    assert not built[1].malloc_tuning and not built[1].warm_object_store
    assert built[0].group_device == "cpu"  # generation.weight_group_device auto, on a CPU trainer: gloo
    cuda = load_config(TINY_VLLM, ["model.tiny=null", f"model.path={path}", "generation.weight_transport=collective",
                                   "generation.weight_group_device=cuda"], check_paths=False)
    with pytest.raises(ValueError, match="weight_group_device: cuda, but torch sees no CUDA device"):
        backends.make_generator(cuda, graphdef, state, pad_id=0, run_dir="/nowhere")
    assert len(built) == 2  # refused before the pool was built
    monkeypatch.undo()
    with pytest.raises(vllm_pool.PoolError, match=r"weight transport 'nccl' is not built; allowed: ray"):
        vllm_pool.VLLMPool(vllm_pool.PoolConfig(model_dir="/nowhere", transport="nccl"))


def test_a_checkpoint_in_another_dtype_than_the_trainers_is_refused_before_the_pool(monkeypatch, tmp_path):
    """The engines check every pushed tensor's dtype against their checkpoint's; a model.path in bfloat16 under
    precision.master none (float32 parameters) had every push refused, found only after the first training step.
    Now make_generator says so before any engine starts; a checkpoint in the trainer's dtypes starts the pool."""
    import types

    from flax import nnx

    from m3jax import tiny
    from rl.generation import vllm_pool

    built = []
    monkeypatch.setattr(vllm_pool, "VLLMPool", lambda pool_cfg, graphdef, pad_id: built.append(pool_cfg))
    m3cfg = load_config(TINY_VLLM).model.m3_config()
    release = m3jax.save_pretrained(tiny.m3_model(m3cfg, seed=0, dtype=jnp.bfloat16), tmp_path / "bf16",
                                    layout="released")
    trainer = m3jax.from_pretrained(release, dtype=jnp.float32)  # precision.master: none
    graphdef, params, rest = nnx.split(trainer, nnx.Param, ...)
    state = types.SimpleNamespace(params=params, rest=rest)
    cfg = load_config(TINY_VLLM, ["model.tiny=null", f"model.path={release}", "precision.master=none"],
                      check_paths=False)
    with pytest.raises(ValueError, match=r"push language_model\.model\.embed_tokens\.weight as float32, but the "
                                         r"engines' checkpoint .* holds it as bfloat16"):
        backends.make_generator(cfg, graphdef, state, pad_id=0, run_dir=str(tmp_path))
    assert built == []
    same = m3jax.save_pretrained(trainer, tmp_path / "fp32", layout="released")
    ok = load_config(TINY_VLLM, ["model.tiny=null", f"model.path={same}", "precision.master=none"], check_paths=False)
    backends.make_generator(ok, graphdef, state, pad_id=0, run_dir=str(tmp_path))
    assert built[0].model_dir == str(same)
