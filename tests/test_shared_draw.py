"""rl.shared_draw: one step off policy in a multi-host job with the vLLM pool. Process 0 draws alone (no collective:
its pool's generate, its own scoring) on the background thread; the draw is shared from the main thread when the
step takes it. Two processes simulated in one, with the broadcast stand-in of tests/test_multihost.py."""

import json
import zlib

import numpy as np
import pytest

from rl import phases, shared_draw
from rl.ahead import AheadDraw
from rl.config import load_config
from rl.generation import multihost
from rl.generation.multihost import ProcessZeroPool
from rl.generation.backends import sampling_of
from rl.rewards import registry
from rl.prompt_loader import build_data
from tests.test_multihost import Broadcast, FakePool, _zero_model
from tests.test_run_config import TINY


def crc_parity(completion, answer, prompt, **kw):
    """0 or 1 from the prompt and the completion: some groups informative, some not, the same in both 'processes'."""
    return float(zlib.crc32(f"{prompt}|{completion}".encode()) % 2)


@pytest.fixture
def parity_reward():
    registry.register_reward("_test_parity", mode="inline")(crc_parity)
    yield
    registry._REGISTRY.pop("_test_parity", None)


def _config(*overrides):
    return load_config(TINY, ["grpo.max_trajectory_age_steps=1", "grpo.prompts_per_step=4", "grpo.group_size=2", "grpo.micro_batch_size=8",
                              "reward=[{name: _test_parity, weight: 1.0}]", *overrides], check_paths=False)


class NoCollective:
    """_from_zero on a thread that must issue none (process 0's draw ahead)."""

    def __call__(self, value):
        raise AssertionError("a collective on the draw-ahead thread")


@pytest.mark.parametrize("dynamic", [False, True])
def test_every_process_gets_process_zeros_draw(monkeypatch, parity_reward, dynamic):
    cfg = _config(*(["grpo.dynamic_sampling=true", "grpo.dynamic_sampling_max_rounds=4"] if dynamic else []))
    graphdef, _, _ = _zero_model()
    sampling = sampling_of(cfg, 2)
    (tokenizer, loader0, _), (_, loader1, _) = build_data(cfg), build_data(cfg)
    zero = ProcessZeroPool(FakePool(), graphdef, is_zero=True)
    other = ProcessZeroPool(None, graphdef, is_zero=False)
    bc = Broadcast()

    # the background thread: process 0 draws with no collective; the others run nothing
    monkeypatch.setattr(multihost, "_from_zero", NoCollective())
    assert shared_draw.ahead_draw(other, loader1, tokenizer, cfg, sampling, 3)() is None
    drawn = shared_draw.ahead_draw(zero, loader0, tokenizer, cfg, sampling, 3)()
    if dynamic:
        assert drawn.rounds > 1 and drawn.picked is not None and drawn.picked[:, 0].max() > 0  # groups of later rounds

    monkeypatch.setattr(multihost, "_from_zero", bc.zero)
    assert shared_draw.share(drawn, zero, loader0, tokenizer, cfg, sampling) is drawn
    monkeypatch.setattr(multihost, "_from_zero", bc.other)
    got = shared_draw.share(None, other, loader1, tokenizer, cfg, sampling)
    assert not bc.sent  # the other process offered every collective process 0 sent, in the same order

    assert loader1.state_dict() == loader0.state_dict()  # both loaders end where the draw did
    for name in ("tokens", "logprobs", "lengths", "truncated"):
        a, b = getattr(got.samples.rollout, name), getattr(drawn.samples.rollout, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert got.samples.rollout.prompt_ids == drawn.samples.rollout.prompt_ids
    assert got.samples.completions == drawn.samples.completions and got.samples.answers == drawn.samples.answers
    assert got.samples.records == drawn.samples.records
    assert np.array_equal(got.reward, drawn.reward) and got.reward.std() > 0
    assert got.parts.keys() == drawn.parts.keys() and all(np.array_equal(got.parts[k], drawn.parts[k])
                                                          for k in got.parts)
    assert (got.failures, got.metrics, got.generate_s, got.draw_s, got.rounds) == (
        drawn.failures, drawn.metrics, drawn.generate_s, drawn.draw_s, drawn.rounds)
    # the same draw the synchronous path (every process in it, broadcasts inside) would make
    (_, loader2, _) = build_data(cfg)
    monkeypatch.setattr(multihost, "_from_zero", lambda v: v)
    sync = phases.draw(zero, loader2, tokenizer, cfg, sampling, 3)
    assert np.array_equal(sync.reward, drawn.reward) and sync.samples.completions == drawn.samples.completions


def test_a_draw_that_failed_on_process_zero_raises_on_every_process(monkeypatch, parity_reward):
    cfg = _config()
    graphdef, _, _ = _zero_model()
    sampling = sampling_of(cfg, 2)
    tokenizer, loader, _ = build_data(cfg)
    zero = ProcessZeroPool(FakePool(), graphdef, is_zero=True)
    other = ProcessZeroPool(None, graphdef, is_zero=False)
    bc = Broadcast()

    def dead(*a, **k):
        raise ConnectionError("no engine left")

    zero.pool.generate = dead
    ahead = AheadDraw()
    ahead.launch(shared_draw.ahead_draw(zero, loader, tokenizer, cfg, sampling, 1), loader.state_dict(), version=0)
    monkeypatch.setattr(multihost, "_from_zero", bc.zero)
    with pytest.raises(ConnectionError, match="no engine left"):
        shared_draw.take_shared(ahead, zero, loader, tokenizer, cfg, sampling)
    monkeypatch.setattr(multihost, "_from_zero", bc.other)
    ahead_other = AheadDraw()
    ahead_other.launch(shared_draw.ahead_draw(other, loader, tokenizer, cfg, sampling, 1), {}, version=0)
    with pytest.raises(RuntimeError, match=r"the draw ahead failed on process 0 \(ConnectionError: no engine left\)"):
        shared_draw.take_shared(ahead_other, other, loader, tokenizer, cfg, sampling)
    assert not bc.sent
    ahead.close()
    ahead_other.close()


@pytest.mark.slow
def test_two_hosts_train_one_step_off_policy_with_a_pool_on_process_zero(tmp_path, monkeypatch):
    """The real thing, on a fake pool (tests/workers/multihost_train.py): two processes joined by jax.distributed,
    process 0 drawing each next step on its background thread while both train. A collective issued from that thread
    would meet the step's in a different order on the two processes (gloo: "collective mismatch") or hang."""
    from tests.test_multihost import TWO_HOSTS, two_hosts

    monkeypatch.setenv("M3JAX_TEST_POOL", "fake")
    run, out = tmp_path / "run", str(tmp_path / "out")
    procs = two_hosts(out, [*TWO_HOSTS, "generation.backend=vllm", "generation.verify_probes=0",
                            "grpo.max_trajectory_age_steps=1", "run.total_steps=4", "checkpoint.every_steps=0",
                            "eval.every_steps=0", "eval.at_start=false", f"run.out_dir={run}"])
    try:  # ~80 s on the 2-core machine; the old path (the draw's broadcasts on its thread) hung past 5 minutes
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    done = [[line for line in log.splitlines() if line.startswith("done:")] for log in logs]
    assert done[0] and done[0] == done[1], done  # the same last step's figures on both hosts
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["rollout/age_steps"] for r in rows] == [0, 1, 1, 1]  # steps 2-4 drawn while the one before trained
