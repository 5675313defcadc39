"""VLLMPool's own logic with fake engines (no vLLM, so it is in the fast loop): chunked rollouts put every
row back in its place, a re-sent row samples the same tokens, an engine that dies mid-rollout is replaced
and loses or duplicates nothing, as is one lost during an update, the replacement serves only once a weight
update reaches it, a rejected update leaves every engine on its old version. The real engines:
tests/test_vllm_pool.py (slow)."""

import dataclasses
import os
import re
import time

import jax
import numpy as np
import pytest

from rl.generation import host_memory
from rl.generation import transfer as tr
from rl.generation import vllm_pool
from m3jax.hf.shapes import TENSOR_TABLE, shapes_only
from rl.generation.base import SamplingParams
from rl.generation.pool_config import NO_WEIGHTS
from rl.generation.vllm_actor import actor_class
from rl.generation.vllm_pool import EngineActor, PoolConfig, PoolError, VLLMPool

ray = pytest.importorskip("ray", reason="ray is not installed (scripts/setup.sh installs it)")

# The fake checkpoint: tensor name -> (shape, dtype); "w0"[0] is the "weights" that shift every token.
MANIFEST = {"w0": ((2, 3), np.dtype(np.float32)), "w1": ((4,), np.dtype(np.float32))}
VOCAB = 50


def fake_tokens(prompt, seed, offset, max_new):
    """What the fake engine samples: a function of (prompt, per-row seed, weights) only."""
    n = 1 + (seed + sum(prompt)) % max_new
    return [int(prompt[0]) + 1000 * offset] + [3 + (seed + 7 * i + offset) % VOCAB for i in range(1, n)]


class FakeEngine:
    """The VLLMEngine surface EngineActor uses. Dies (os._exit) at its first generate call when the
    file `<model_dir>/die` exists (and removes it, so its replacement lives)."""

    def __init__(self, model_dir):
        try:  # test_a_replacement_still_starting_is_reported_as_starting: this engine takes long to build
            os.remove(os.path.join(model_dir, "slow-start"))
        except FileNotFoundError:
            pass
        else:
            time.sleep(30)
        # a directory of shapes alone (m3jax.hf.shapes): dummy weights, as a VLLMEngine starts from it
        self.model_dir, self.version, self.calls = model_dir, NO_WEIGHTS if shapes_only(model_dir) else 0, 0
        self.weights = {n: np.zeros(s, d) for n, (s, d) in MANIFEST.items()}

    def check(self, name, shape, dtype):
        try:  # test_an_engine_dying_during_an_update_is_replaced_and_the_rest_commit: dies while staging
            os.remove(os.path.join(self.model_dir, "die-staging"))
        except FileNotFoundError:
            pass
        else:
            os._exit(1)
        if name not in MANIFEST:
            raise KeyError(f"{name!r} is not a tensor of this checkpoint")
        if (tuple(shape), np.dtype(dtype)) != MANIFEST[name]:
            raise ValueError(f"{name!r}: expected {MANIFEST[name]}, got {tuple(shape)} {dtype}")

    def load_weights(self, named_arrays):
        self.weights.update({n: np.array(a) for n, a in named_arrays})

    def generate(self, prompts, sp, seeds):
        try:  # whichever engine removes the file dies; the other may race it to the check and must live
            os.remove(os.path.join(self.model_dir, "die"))
        except FileNotFoundError:
            pass
        else:
            os._exit(1)
        self.calls += 1
        time.sleep(0.05)  # long enough for the other engine to take the next chunk
        offset = int(self.weights["w0"][0, 0])
        out = []
        for p, s in zip(prompts, seeds):
            ids = fake_tokens(p, s, offset, sp.max_new_tokens)
            out.append((ids, [-0.1 * (i + 1) for i in range(len(ids))], len(ids) == sp.max_new_tokens))
        return out

    def score(self, prompts, responses, temperature, top_p, top_k):
        for what in ("die", "hang"):  # test_a_dead_or_hung_engine_while_scoring_is_replaced
            try:
                os.remove(os.path.join(self.model_dir, f"{what}-scoring"))
            except FileNotFoundError:
                continue
            if what == "die":
                os._exit(1)
            time.sleep(3600)
        return [np.full(len(r), -float(self.weights["w0"][0, 0]), np.float32) for r in responses]

    def health(self):
        return {"ok": True, "version": self.version, "pid": os.getpid(), "calls": self.calls}


class FakeActor(EngineActor):
    def __init__(self, cfg, rank):  # EngineActor's, with a FakeEngine instead of a VLLMEngine
        self.rank, self.engine = rank, FakeEngine(cfg.model_dir)
        self.staged, self.busy_since = tr.StagedUpdate(), None


def weights(offset):
    return [("w0", np.full((2, 3), offset, np.float32)), ("w1", np.arange(4, dtype=np.float32))]


@pytest.fixture(scope="module")
def pool(tmp_path_factory, ray_local):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_pool, "_ACTOR", actor_class(FakeActor, "FakeEngineActor"))
        d = tmp_path_factory.mktemp("fake-pool")
        p = VLLMPool(PoolConfig(model_dir=str(d), servers=2, bucket_bytes=32, request_timeout_s=60, max_restarts=1),
                     pad_id=99)
        yield p
        p.shutdown()


def prompts(n, seed=0):
    return np.random.default_rng(seed).integers(0, 90, (n, 5)).tolist()


def check_rollout(r, ps, sp, offset):
    """Row i answers prompt i; tokens and logprobs padded after each row's length."""
    assert r.tokens.shape == r.logprobs.shape == (len(ps), sp.max_new_tokens)
    for i, p in enumerate(ps):
        n = int(r.lengths[i])
        assert r.tokens[i, 0] == p[0] + 1000 * offset, i
        assert (r.tokens[i, n:] == 99).all() and (r.logprobs[i, n:] == 0).all()
        np.testing.assert_allclose(r.logprobs[i, :n], -0.1 * np.arange(1, n + 1), rtol=1e-6)
        assert bool(r.truncated[i]) == (n == sp.max_new_tokens)
        assert r.prompt_ids[i] == p


def test_rollout_rows_come_back_in_place_and_reproducible(pool):
    ps, sp = prompts(24), SamplingParams(max_new_tokens=6)
    a = pool.generate(ps, sp, jax.random.key(0))
    check_rollout(a, ps, sp, offset=0)
    assert a.weight_version == 0 and len(set(a.lengths.tolist())) > 1
    assert all(h["calls"] >= 1 for h in pool.health())  # both engines took chunks
    b = pool.generate(ps, sp, jax.random.key(0))
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.lengths, b.lengths)
    c = pool.generate(ps, sp, jax.random.key(1))
    assert not np.array_equal(a.tokens, c.tokens)  # the key decides the per-row seeds


def test_cpu_engine_processes_start_with_the_malloc_tunables(pool):
    # each actor process was started with them (rl.generation.host_memory)
    want = host_memory.engine_malloc_env()["GLIBC_TUNABLES"]
    assert "glibc.malloc.mmap_max=" in want and [h["glibc_tunables"] for h in pool.health()] == [want] * 2


def test_update_commits_everywhere_or_nowhere(pool):
    stats = pool.push(iter(weights(2)), version=1)
    assert stats.version == 1 and stats.buckets == 2 and stats.lost == [] and pool.version == 1
    assert [h["version"] for h in pool.health()] == [1, 1]
    ps, sp = prompts(8, seed=1), SamplingParams(max_new_tokens=4)
    check_rollout(pool.generate(ps, sp, jax.random.key(2)), ps, sp, offset=2)
    assert [[float(x) for x in lp] for lp in pool.score(ps, [[1, 2]] * 8, sp)[0]] == [[-2.0, -2.0]] * 8
    bad = weights(3)[:1] + [("w1", np.zeros(5, np.float32))]  # the wrong shape: every engine refuses
    with pytest.raises(tr.TransferError, match="'w1'"):
        pool.push(iter(bad), version=2)
    assert pool.version == 1 and [h["version"] for h in pool.health()] == [1, 1]
    check_rollout(pool.generate(ps, sp, jax.random.key(2)), ps, sp, offset=2)


def test_engine_dying_mid_rollout_is_replaced_and_rows_resent(pool):
    # the pool holds an update beyond the checkpoint's version 0 whichever tests ran before (test order, or
    # another pytest-xdist worker), so that a replacement engine differs from it
    pool.push(iter(weights(2)), version=pool.version + 1)
    ps, sp = prompts(32, seed=2), SamplingParams(max_new_tokens=5)
    want = pool.generate(ps, sp, jax.random.key(3))
    resent, restarts = pool.resent_rows, pool.restarts
    open(os.path.join(pool.cfg.model_dir, "die"), "w").close()
    got = pool.generate(ps, sp, jax.random.key(3))
    assert pool.resent_rows > resent and pool.restarts == restarts + 1
    assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.lengths, want.lengths)
    # the replacement starts from the checkpoint (version 0): it serves only after the next update
    deadline = time.time() + 60
    while len([h for h in pool.health() if h["state"] == "up"]) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert sorted(h["version"] for h in pool.health()) == [0, pool.version]
    assert len(pool.serving()) == 1
    pool.push(iter(weights(2)), version=pool.version + 1)
    assert len(pool.serving()) == 2
    check_rollout(pool.generate(ps, sp, jax.random.key(3)), ps, sp, offset=2)


def test_an_engine_dying_during_an_update_is_replaced_and_the_rest_commit(tmp_path, ray_local, monkeypatch):
    """The engine that dies while staging a bucket is named lost and replaced; the other commits the version, and the
    pool serves it. (A mutation audit: the pool taking the lost engine for updated, or replacing the live one, passed
    every test.)"""
    monkeypatch.setattr(vllm_pool, "_ACTOR", actor_class(FakeActor, "FakeEngineActor"))
    p = VLLMPool(PoolConfig(model_dir=str(tmp_path), servers=2, bucket_bytes=32, request_timeout_s=60, max_restarts=1),
                 pad_id=99)
    try:
        open(tmp_path / "die-staging", "w").close()
        stats = p.push(iter(weights(5)), version=1)
        assert len(stats.lost) == 1 and p.restarts == 1 and p.version == 1
        serving = p.serving()
        assert len(serving) == 1 and serving[0].version == 1 and serving[0].rank != stats.lost[0]
        ps, sp = prompts(8, seed=4), SamplingParams(max_new_tokens=4)
        check_rollout(p.generate(ps, sp, jax.random.key(5)), ps, sp, offset=5)  # the new weights, on the survivor
        deadline = time.time() + 60  # the replacement: up from the checkpoint, serving after the next update
        while len([h for h in p.health() if h["state"] == "up"]) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert sorted(h["version"] for h in p.health()) == [0, 1]
        p.push(iter(weights(6)), version=2)
        assert len(p.serving()) == 2
        check_rollout(p.generate(ps, sp, jax.random.key(5)), ps, sp, offset=6)
    finally:
        p.shutdown()


def test_no_engine_left_is_a_clear_error(pool):
    saved = pool.slots
    pool.slots = []
    try:
        with pytest.raises(PoolError, match="no vLLM engine serves weight version"):
            pool.generate(prompts(2), SamplingParams(max_new_tokens=2), jax.random.key(0))
        with pytest.raises(PoolError, match="no live vLLM engine"):
            pool.push(iter(weights(1)), version=9)
    finally:
        pool.slots = saved


def test_a_pool_started_from_shapes_serves_only_once_weights_arrive(tmp_path, ray_local, monkeypatch):
    """Engines started from a random model's shapes hold vLLM's dummy weights: a rollout or a scoring before the
    first push would sample from noise, so it is refused with the reason; the push of version 0 makes them serve.
    A replacement engine starts on dummy weights too and serves only once the next update reaches it."""
    (tmp_path / TENSOR_TABLE).write_text("{}")  # what the fake engines look at; VLLMEngine reads it (m3jax.hf.shapes)
    monkeypatch.setattr(vllm_pool, "_ACTOR", actor_class(FakeActor, "FakeEngineActor"))  # replacements too
    p = VLLMPool(PoolConfig(model_dir=str(tmp_path), servers=2, bucket_bytes=32, request_timeout_s=60, max_restarts=1),
                 pad_id=99)
    try:
        assert p.version == NO_WEIGHTS and [h["version"] for h in p.health()] == [NO_WEIGHTS] * 2
        ps, sp = prompts(6), SamplingParams(max_new_tokens=4)
        with pytest.raises(PoolError, match="a rollout before the first weight update: the engines started from "
                                            f"{tmp_path}, the model's shapes alone"):
            p.generate(ps, sp, jax.random.key(0))
        with pytest.raises(PoolError, match="scoring before the first weight update"):
            p.score(ps, [[1]] * 6, sp)
        assert sum(h["calls"] for h in p.health()) == 0
        p.push(iter(weights(3)), version=0)
        assert p.version == 0 and [h["version"] for h in p.health()] == [0, 0]
        check_rollout(p.generate(ps, sp, jax.random.key(0)), ps, sp, offset=3)
        open(tmp_path / "die", "w").close()
        check_rollout(p.generate(ps, sp, jax.random.key(0)), ps, sp, offset=3)  # its rows re-sent to the other
        assert p.restarts == 1
        deadline = time.time() + 60
        while time.time() < deadline:  # the replacement is up (its process may take seconds to start)
            states = p.health()
            if all(h["state"] == "up" for h in states):
                break
            time.sleep(0.2)
        assert sorted(h.get("version") for h in states) == [NO_WEIGHTS, 0], states
        assert len(p.serving()) == 1
        p.push(iter(weights(3)), version=1)
        assert len(p.serving()) == 2
    finally:
        p.shutdown()


def test_a_replacement_still_starting_is_reported_as_starting(tmp_path, ray_local, monkeypatch):
    """The pool's health, which its "no healthy vLLM engine left" error lists, asked a replacement that was still
    building its engine and reported it "unreachable: GetTimeoutError", 5 s late (an audit)."""
    monkeypatch.setattr(vllm_pool, "_ACTOR", actor_class(FakeActor, "FakeEngineActor"))
    p = VLLMPool(PoolConfig(model_dir=str(tmp_path), servers=2, bucket_bytes=32, request_timeout_s=60, max_restarts=1),
                 pad_id=99)
    try:
        ps, sp = prompts(6), SamplingParams(max_new_tokens=4)
        for name in ("die", "slow-start"):  # an engine dies; its replacement takes 30 s to build
            open(tmp_path / name, "w").close()
        p.generate(ps, sp, jax.random.key(0))
        started = time.time()
        states = p.health()
        assert time.time() - started < 2, "health waited on the starting engine"
        assert sorted(h["state"] for h in states) == ["starting (replacement 1 of the pool's 1)", "up"], states
    finally:
        p.shutdown()


@pytest.mark.parametrize("bad, message", [
    ("id", "prompt 1 holds token id 90: expected ids in [0, 90)"),
    ("length", "row 0: 5 prompt tokens + max_new_tokens 2044 = 2049 positions: expected at most the engines' "
               "max_model_len = 2048"),
    ("score length", "row 0: 5 prompt + 2044 response tokens = 2049 positions: expected at most the engines' "
                     "max_model_len - 1 = 2047"),
    ("temperature", "temperature=0.005: vLLM samples at 0.01 or more"),
])
def test_a_bad_request_is_refused_before_any_engine_sees_it(pool, monkeypatch, bad, message):
    """vLLM raises on such a request; inside the pool that error looked like a dead engine, which it replaced
    (and re-sent the same rows to the replacement). Now the request is refused first: no engine is called or
    replaced."""
    monkeypatch.setattr(pool, "cfg", dataclasses.replace(pool.cfg, vocab_size=90))
    calls, restarts = sum(h["calls"] for h in pool.health() if "calls" in h), pool.restarts
    ps = prompts(3)
    with pytest.raises(ValueError, match=re.escape(message)):
        if bad == "id":
            pool.generate([ps[0], ps[1][:4] + [90], ps[2]], SamplingParams(max_new_tokens=4), jax.random.key(0))
        elif bad == "temperature":  # vLLM would raise it to 0.01 and return logprobs at that temperature
            pool.generate(ps, SamplingParams(max_new_tokens=4, temperature=0.005), jax.random.key(0))
        elif bad == "length":
            pool.generate(ps, SamplingParams(max_new_tokens=2044), jax.random.key(0))
        else:
            pool.score(ps, [[3] * 2044] * 3, SamplingParams(max_new_tokens=1))
    assert sum(h["calls"] for h in pool.health() if "calls" in h) == calls and pool.restarts == restarts


class _SlowEngine:
    version = 0

    def generate(self, prompts, sp, seeds):
        time.sleep(1.0)
        return []

    def health(self):
        return {"ok": True, "version": 0}


class SlowActor(EngineActor):
    def __init__(self):  # EngineActor's would start vLLM
        self.rank, self.engine, self.busy_since = 0, _SlowEngine(), None


def test_the_actor_class_answers_health_while_it_works_and_leaves_engine_actor_unmarked(ray_local):
    """`actor_class` puts health in its own concurrency group (the pool's hang detection reads busy_s while a
    rollout runs), and marks wrappers, not EngineActor's own methods: ray.method marks the function it is given,
    so a class started later without these groups would inherit the marks and fail to start."""
    actor = actor_class(SlowActor, "SlowActor").remote()
    ray.get(actor.health.remote())
    work, busy = actor.generate.remote([0], [], None, []), None
    while busy is None and not ray.wait([work], timeout=0)[0]:
        busy = ray.get(actor.health.remote(), timeout=5)["busy_s"]
    ray.get(work)
    ray.kill(actor)
    assert busy is not None  # answered while generate ran
    assert not any(hasattr(getattr(EngineActor, m), "__ray_concurrency_group__") for m in ("generate", "health"))


@pytest.mark.parametrize("what", ["die", "hang"])
def test_a_dead_or_hung_engine_while_scoring_is_replaced(pool, monkeypatch, what):
    """The probe check after a push scores on every engine; one that dies or hangs there is replaced and the
    others' answers are returned, as in a rollout (a bare ray.get raised Ray's error to the trainer, and left a
    hung engine serving, to stall the next rollout for another timeout)."""
    pool.push(iter(weights(3)), version=pool.version + 1)
    assert len(pool.serving()) == 2
    monkeypatch.setattr(pool, "cfg", dataclasses.replace(pool.cfg, request_timeout_s=3, max_restarts=pool.restarts + 2))
    restarts = pool.restarts
    open(os.path.join(pool.cfg.model_dir, f"{what}-scoring"), "w").close()
    t0 = time.time()
    got = pool.score(prompts(2), [[3, 4]] * 2, SamplingParams(max_new_tokens=1))
    assert time.time() - t0 < 30
    assert len(got) == 1 and all((x == -3).all() for x in got[0])  # the other engine's answer
    assert pool.restarts == restarts + 1 and len(pool.serving()) == 1
    resent = pool.resent_rows  # the next rollout runs on the engine left: no chunk waits on the failed one
    check_rollout(pool.generate(prompts(4), SamplingParams(max_new_tokens=3), jax.random.key(0)), prompts(4),
                  SamplingParams(max_new_tokens=3), offset=3)
    assert pool.resent_rows == resent
    only = pool.serving()
    monkeypatch.setattr(pool, "slots", only)  # none left to answer: one PoolError naming why
    open(os.path.join(pool.cfg.model_dir, "die-scoring"), "w").close()
    with pytest.raises(PoolError, match=r"no vLLM engine answered the scoring request \(engine \d: ActorDiedError\)"):
        pool.score(prompts(2), [[3, 4]] * 2, SamplingParams(max_new_tokens=1))


def test_a_spent_restart_budget_replaces_no_engine(tmp_path, ray_local, monkeypatch):
    """max_restarts = 0: a dying engine's rows go to the other and nothing is started in its place (a mutation audit:
    `>` for `>=` restarted once past the budget, and no test saw it)."""
    monkeypatch.setattr(vllm_pool, "_ACTOR", actor_class(FakeActor, "FakeEngineActor"))
    p = VLLMPool(PoolConfig(model_dir=str(tmp_path), servers=2, bucket_bytes=32, request_timeout_s=60, max_restarts=0),
                 pad_id=99)
    try:
        ps, sp = prompts(8), SamplingParams(max_new_tokens=4)
        open(tmp_path / "die", "w").close()
        check_rollout(p.generate(ps, sp, jax.random.key(1)), ps, sp, offset=0)
        assert p.restarts == 0 and sum(slot.actor is not None for slot in p.slots) == 1
    finally:
        p.shutdown()
