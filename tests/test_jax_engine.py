"""The JAX engine decodes exactly as full forwards: greedy = argmax, logprobs = full log-softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from rl.generation.base import SamplingParams, sampling_logits, token_logprobs
from rl.generation.jax_engine import JaxEngine
from tests import reference as ref


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = ref.build_model(ref.tiny_config("mixed_kinds"), seed=2)  # sparse layers with block 4, top-3 blocks
    return m3jax.from_pretrained(ref.save(hf, str(tmp_path_factory.mktemp("m"))))


def engine_for(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return JaxEngine(graphdef, params, rest, pad_id=0)


WIDTH = 40  # every reference forward is this long: one compile for the module


@jax.jit
def _forward(model, seq):
    return model(seq)


def full_forward_logits(model, prompt, response):
    """Logits at the response positions of one full forward of prompt + response. The sequence is followed
    by pad tokens up to WIDTH, which causal attention keeps out of every earlier position (the logits of
    the real positions are those of the unpadded forward up to float rounding)."""
    n = len(prompt) + len(response)
    assert n <= WIDTH, n
    seq = jnp.asarray([list(prompt) + list(response) + [0] * (WIDTH - n)], jnp.int32)
    return np.asarray(_forward(model, seq))[0, len(prompt) - 1: n - 1]


def prompts(cfg, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, cfg.vocab_size, n)) for n in lengths]


def test_greedy_equals_argmax_of_full_forward_every_step(model):
    ps = prompts(model.cfg, [5, 11, 8])
    sp = SamplingParams(max_new_tokens=20, temperature=0.0)
    out = engine_for(model).generate(ps, sp, jax.random.key(0))
    # 11 + 20 tokens > index_topk_blocks x index_block_size = 12: the sparse layers really select
    for row, p in enumerate(ps):
        resp = out.tokens[row, : out.lengths[row]]
        logits = full_forward_logits(model, p, resp)
        np.testing.assert_array_equal(resp, logits.argmax(-1))
        want = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(resp), 0.0))
        np.testing.assert_allclose(out.logprobs[row, : out.lengths[row]], want, atol=2e-5)


@pytest.mark.slow  # a sampling compile per case; the fast loop keeps greedy and the mask maths
@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 20)])
def test_sampled_logprobs_equal_full_forward(model, temperature, top_p, top_k):
    ps = prompts(model.cfg, [6, 9, 6, 13], seed=1)
    sp = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=top_p, top_k=top_k)
    out = engine_for(model).generate(ps, sp, jax.random.key(3))
    gen_kl = []
    for row, p in enumerate(ps):
        resp = out.tokens[row, : out.lengths[row]]
        logits = jnp.asarray(full_forward_logits(model, p, resp))
        want = np.asarray(token_logprobs(logits, jnp.asarray(resp), temperature, top_p, top_k))
        assert np.all(np.isfinite(want))  # every sampled token is inside the truncated distribution
        gen_kl.append(np.asarray(out.logprobs[row, : out.lengths[row]]) - want)
    gen_kl = np.concatenate(gen_kl)
    assert np.max(np.abs(gen_kl)) < 1e-4 and abs(np.mean(gen_kl)) < 1e-6


@pytest.mark.slow  # another generation compile; greedy and the masks stay fast
def test_stop_tokens_end_rows_and_pad_after(model):
    ps = prompts(model.cfg, [7, 7, 7, 7], seed=4)
    greedy = engine_for(model).generate(ps, SamplingParams(max_new_tokens=12, temperature=0.0), jax.random.key(0))
    stop = int(greedy.tokens[0, 3])  # the 4th greedy token of row 0 becomes a stop token
    out = engine_for(model).generate(ps, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                        stop_token_ids=(stop,)), jax.random.key(0))
    assert out.lengths[0] <= 4 and out.tokens[0, out.lengths[0] - 1] == stop and not out.truncated[0]
    assert np.all(out.tokens[0, out.lengths[0]:] == 0) and np.all(out.logprobs[0, out.lengths[0]:] == 0)
    for row in range(4):
        n = out.lengths[row]
        np.testing.assert_array_equal(out.tokens[row, :n], greedy.tokens[row, :n])
        assert out.truncated[row] == (stop not in out.tokens[row, :n])


def test_top_k_top_p_masks():
    z = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    assert np.isinf(np.asarray(sampling_logits(z, 1.0, top_k=2))[0, 2:]).all()
    kept = np.isfinite(np.asarray(sampling_logits(z, 1.0, top_p=0.8)))[0]
    np.testing.assert_array_equal(kept, [True, True, False, False])  # 0.5 + 0.3 reaches 0.8
    kept = np.isfinite(np.asarray(sampling_logits(z, 1.0, top_p=0.81)))[0]
    np.testing.assert_array_equal(kept, [True, True, True, False])
    # ties at the cut are kept whole (sampling_logits: another sampler's order among equal logits is its own)
    tied = jnp.log(jnp.asarray([[0.4, 0.2, 0.2, 0.2]]))
    assert np.isfinite(np.asarray(sampling_logits(tied, 1.0, top_p=0.5))).all()
    assert np.isfinite(np.asarray(sampling_logits(tied, 1.0, top_k=2))).all()
    for k in (4, 5):  # the vocabulary's size or more: every token, as HF's and vLLM's samplers keep
        np.testing.assert_array_equal(np.asarray(sampling_logits(z, 1.0, top_k=k)), np.asarray(z))


@pytest.mark.slow  # another generation compile
def test_rows_that_only_pad_the_batch_start_done(model):
    """Rows added to fill the batch shards are never sampled, so the decode loop ends with the real rows
    (before, a padding row decoded on until it drew a stop token or reached max_new_tokens)."""
    from rl.generation.jax_engine import generate_program

    ids = jnp.asarray([prompts(model.cfg, [6], seed=7)[0], [0] * 6], jnp.int32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0)
    tokens, logps, lengths, truncated = generate_program(graphdef, params, rest, ids, jnp.asarray([6, 1]),
                                                         jax.random.key(3), sp, 0, False, False,
                                                         jnp.asarray([True, False]))
    assert np.all(np.asarray(tokens)[1] == 0) and np.all(np.asarray(logps)[1] == 0)
    assert np.all(np.asarray(logps)[0] < 0)  # the real row samples on


@pytest.mark.slow  # compiles the scoring pass
def test_score_equals_full_forward_and_the_protocol_is_complete(model):
    """`score` (what the trainer's probe check asks of every engine) is the full forward's logprob of each
    response token; the in-process engine re-sends and restarts nothing."""
    ps = prompts(model.cfg, [5, 9, 7], seed=4)
    rs = prompts(model.cfg, [6, 3, 10], seed=5)
    sp = SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.9)
    engine = engine_for(model)
    (got,) = engine.score(ps, rs, sp)
    for p, r, lp in zip(ps, rs, got):
        want = np.asarray(token_logprobs(jnp.asarray(full_forward_logits(model, p, r)), jnp.asarray(r), 0.8, 0.9))
        assert lp.shape == (len(r),)
        np.testing.assert_allclose(lp, want, atol=2e-5)
    assert (engine.resent_rows, engine.restarts) == (0, 0)
    engine.shutdown()


@pytest.mark.slow  # compiles generation on a mesh
def test_sharded_generation_pads_rows_to_the_batch_shards(model, tmp_path, monkeypatch):
    """On a layout whose batch axes hold 4 shards, 3 prompts are padded to 4 rows and the real rows
    decode exactly as on one device (greedy). The rollout leaves the program on the batch's shards, routes and key
    blocks included: replicated, every device held all of them (the key blocks of a 32-node batch are 30 GB)."""
    import rl.generation.jax_engine as je
    from sharding.mesh import MeshConfig, build_mesh

    ps = prompts(model.cfg, [5, 11, 8], seed=6)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    want = engine_for(model).generate(ps, sp, jax.random.key(0))
    layout = build_mesh(MeshConfig(2, 1, 2, 2, expert_axes=("expert",)), model.cfg)
    path = m3jax.save_pretrained(model, str(tmp_path / "m"))
    sharded = m3jax.from_pretrained(path, mesh=layout)
    gathered, gather = [], je.gather_to_every_process
    monkeypatch.setattr(je, "gather_to_every_process", lambda a: gathered.append(a.sharding) or gather(a))
    graphdef, params, rest = nnx.split(sharded, nnx.Param, ...)
    got = JaxEngine(graphdef, params, rest, pad_id=0, return_routes=True, return_block_ids=True).generate(
        ps, sp, jax.random.key(0))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5)
    assert len(gathered) == 6  # tokens, logprobs, lengths, truncated, routes, key blocks
    assert [s.is_fully_replicated or s.spec[0] is None for s in gathered] == [False] * 6



def bad_requests(v: int, p: int) -> dict:
    """{case: (prompts, responses (None: a generate request), max_new_tokens, message)} for a model of
    vocab_size v and max_position_embeddings p."""
    return {
        "token id past the vocabulary": ([[3, 4], [5, v]], None, 4, f"prompt 1 holds token id {v}: expected ids in "
                                                                    f"[0, {v}) (the model's vocab_size)"),
        "negative token id": ([[3, -1]], None, 4, "prompt 0 holds token id -1"),
        "empty prompt": ([[3], []], None, 4, "prompt 1 is empty: expected at least one token id"),
        "no prompts": ([], None, 4, "no prompts: expected a non-empty list"),
        "past the positions": ([[3] * 8], None, p - 7, f"row 0: 8 prompt tokens + max_new_tokens {p - 7} = {p + 1} "
                                                       f"positions: expected at most the model's "
                                                       f"max_position_embeddings = {p}"),
        "score: response id past the vocabulary": ([[3]], [[v]], 1, f"response 0 holds token id {v}"),
        "score: past the positions": ([[3] * 8], [[4] * p], 1, f"row 0: 8 prompt + {p} response tokens = {p + 8} "
                                                               "positions"),
    }


@pytest.mark.parametrize("case", sorted(bad_requests(1, 1)))
def test_bad_request_is_refused_before_anything_runs(model, case, monkeypatch):
    """Every bad request raises one ValueError naming the row and what was expected, before the engine runs
    anything: the model's gather would clamp an id past the vocabulary to a real token, and RoPE would run
    past the trained positions, both silently."""
    prompts_, responses, new, message = bad_requests(model.cfg.vocab_size, model.cfg.max_position_embeddings)[case]
    engine = engine_for(model)
    import rl.generation.jax_engine as je

    def must_not_run(*a, **k):
        raise AssertionError("the engine ran a program for a bad request")
    monkeypatch.setattr(je, "_generate", must_not_run)
    monkeypatch.setattr(je, "_score", must_not_run)
    with pytest.raises(ValueError) as err:
        if responses is None:
            engine.generate(prompts_, SamplingParams(max_new_tokens=new), jax.random.key(0))
        else:
            engine.score(prompts_, responses, SamplingParams(max_new_tokens=new))
    assert message in str(err.value), str(err.value)


def test_prompt_width_past_the_positions_is_refused(model):
    p = model.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=f"prompt_width {p - 3} \\+ max_new_tokens 4: expected at most"):
        engine_for(model).generate([[3, 4]], SamplingParams(max_new_tokens=4), jax.random.key(0), prompt_width=p - 3)


def test_a_stop_token_outside_the_vocabulary_is_refused(model):
    """It is never sampled: every row ran to max_new_tokens without a word."""
    v = model.cfg.vocab_size
    with pytest.raises(ValueError, match=rf"stop token id\(s\) \[{v}\]: expected ids in \[0, {v}\)"):
        engine_for(model).generate([[3, 4]], SamplingParams(4, stop_token_ids=(v,)), jax.random.key(0))


@pytest.mark.parametrize("kw,says", [
    ({"temperature": float("nan")}, "temperature=nan: expected 0 (greedy) or a finite number >= 1e-30"),
    ({"temperature": 1e-39}, "temperature=1e-39"), ({"temperature": float("inf")}, "temperature=inf"),
    ({"top_k": 2.5}, "top_k=2.5: expected an integer >= 0"), ({"top_k": True}, "top_k=True"),
    ({"top_p": float("nan")}, "top_p=nan"), ({"max_new_tokens": 2.0}, "max_new_tokens=2.0"),
    ({"stop_token_ids": (1, -2)}, "stop_token_ids=(1, -2): expected a sequence of token ids"),
    ({"stop_token_ids": 5}, "stop_token_ids=5")])
def test_sampling_params_refuse_what_a_config_refuses(kw, says):
    """NaN sampled at temperature 1, 1e-39 returned the pad id with NaN logprobs, a float top_k or a list of stop
    ids failed deep inside jit."""
    with pytest.raises(ValueError) as e:
        SamplingParams(**{"max_new_tokens": 4, **kw})
    assert says in str(e.value), str(e.value)
    assert SamplingParams(4, stop_token_ids=[2, np.int64(3)]).stop_token_ids == (2, 3)  # a list works, as a tuple


def test_scoring_no_response_token_gives_empty_logprobs(model):
    """One-token prompts with empty responses ran a forward over no position: numpy's zero-size max error."""
    assert [[lp.shape for lp in e] for e in engine_for(model).score([[3], [4]], [[], []], SamplingParams(4))] == \
        [[(0,), (0,)]]


def test_a_low_temperature_still_samples(model):
    """Only temperature 0 is greedy (a mutation audit: greedy up to 0.5 passed every test, every group then a copy of
    one response and its advantages 0)."""
    ps = prompts(model.cfg, [6] * 8, seed=9)[:1] * 8
    out = engine_for(model).generate(ps, SamplingParams(max_new_tokens=4, temperature=0.3), jax.random.key(3))
    assert len({tuple(row) for row in np.asarray(out.tokens).tolist()}) > 1
