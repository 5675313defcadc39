"""Engines across hosts without vLLM (fast): which executor an engine gets, its placement group, and the pool's
bookkeeping of one group per engine (created with the engine, removed and recreated when the engine is
replaced). The real two-node engine: tests/test_vllm_engine_ray.py (slow, extended)."""

import os
import time

import jax
import numpy as np
import pytest

from rl.generation import vllm_pool, vllm_ray
from rl.generation.base import SamplingParams
from rl.generation.vllm_actor import actor_class
from rl.generation.vllm_pool import PoolConfig, PoolError, VLLMPool

ray = pytest.importorskip("ray", reason="ray is not installed (scripts/setup.sh installs it)")
from tests.test_vllm_pool_logic import FakeActor, check_rollout, prompts, weights  # noqa: E402


def test_executor_choice():
    choose = vllm_ray.choose_executor
    assert choose("auto", 1, 8) == "uni" and choose("auto", 8, 8) == "mp"
    assert choose("auto", 16, 8) == "ray"  # the recipe's TP 16 servers on 8-GPU nodes
    assert choose("auto", 4, 0) == "mp"  # a CPU cluster that advertises no rank slots: one host holds any
    assert choose("ray", 2, 8) == "ray" and choose("mp", 1, 0) == "mp"
    with pytest.raises(ValueError, match="'mp' keeps an engine on one host, but 16 ranks exceed the 8 devices"):
        choose("mp", 16, 8)
    with pytest.raises(ValueError, match="expected one of"):
        choose("uni", 1, 1)
    assert vllm_ray.engine_ranks(16, 16) == vllm_ray.engine_ranks(16, 1) == 16  # EP rides on the TP ranks
    with pytest.raises(ValueError, match="expert_parallel=4"):
        vllm_ray.engine_ranks(2, 4)


def test_placement_group_shape():
    one = {"GPU": 1}
    assert vllm_ray.placement(8, 8, "GPU") == ([one] * 8, "STRICT_PACK")
    assert vllm_ray.placement(16, 8, "GPU") == ([one] * 16, "PACK")  # 8 + 8, not 16 nodes
    slot = {vllm_ray.CPU_SLOT: 1}
    assert vllm_ray.placement(2, 1, vllm_ray.CPU_SLOT) == ([slot] * 2, "STRICT_SPREAD")  # one rank per node
    assert vllm_ray.hosts_spanned(16, 8) == 2 and vllm_ray.hosts_spanned(2, 0) == 1
    nodes = [{"Alive": True, "Resources": {"GPU": 8.0}}, {"Alive": False, "Resources": {"GPU": 16.0}},
             {"Alive": True, "Resources": {"CPU": 4.0}}]
    assert vllm_ray.devices_per_host(nodes, "GPU") == 8 and vllm_ray.devices_per_host(nodes, "TPU") == 0
    assert vllm_ray.device_key({"GPU": 2.0, "CPU": 8.0}) == "GPU" and vllm_ray.device_key({"CPU": 8}) == vllm_ray.CPU_SLOT


def test_actor_runtime_env_carries_the_setup_hook():
    env = vllm_ray.actor_runtime_env({"X": "1"})["env_vars"]
    assert env[vllm_ray.EXECUTOR_ENV] == "ray" and env[vllm_ray._RAY_SETUP_HOOK_ENV] == vllm_ray.SETUP_HOOK
    assert env["X"] == "1" and env["OMP_NUM_THREADS"] == "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == root
    assert vllm_ray.SETUP_HOOK == "rl.generation.vllm_patches.worker_setup"  # a function vLLM's workers can import


def _fake_actor_class():
    return actor_class(FakeActor, "FakeRayEngineActor")


def test_ray_executor_needs_rank_slots(ray_local, tmp_path):
    """On a CPU cluster whose nodes advertise no rank slots, a Ray-executor pool says so before it waits."""
    with pytest.raises(PoolError, match=f"needs 2 x '{vllm_ray.CPU_SLOT}'.*has 0"):
        VLLMPool(PoolConfig(model_dir=str(tmp_path), servers=1, tensor_parallel=2, executor="ray"))
    with pytest.raises(PoolError, match="vllm executor 'spread'"):
        VLLMPool(PoolConfig(model_dir=str(tmp_path), executor="spread"))


@pytest.fixture()
def ray_pool(ray_local, tmp_path, monkeypatch):
    """Two fake engines on the Ray executor path: each in a placement group of one CPU bundle (the local
    Ray's CPUs stand in for rank slots; the fake engine starts no workers, so no setup hook is needed)."""
    monkeypatch.setattr(vllm_pool, "_ACTOR", _fake_actor_class())
    monkeypatch.setattr(vllm_ray, "CPU_SLOT", "CPU")
    monkeypatch.setattr(vllm_ray, "actor_runtime_env", lambda base=None: {})
    p = VLLMPool(PoolConfig(model_dir=str(tmp_path), servers=2, executor="ray", bucket_bytes=32, request_timeout_s=60,
                            max_restarts=1), pad_id=99)
    yield p
    p.shutdown()


def _table(group):
    return ray.util.placement_group_table(group)


def test_one_placement_group_per_engine_replaced_with_it(ray_pool):
    p = ray_pool
    assert p.cfg.executor == "ray" and p.key == "CPU"
    groups = [s.group for s in p.slots]
    assert len({g.id for g in groups}) == 2
    for g in groups:
        t = _table(g)
        assert t["state"] == "CREATED" and t["strategy"] == "STRICT_PACK" and list(t["bundles"].values()) == [{"CPU": 1}]
    p.push(iter(weights(2)), version=1)
    ps, sp = prompts(32, seed=2), SamplingParams(max_new_tokens=5)
    want = p.generate(ps, sp, jax.random.key(3))
    open(os.path.join(p.cfg.model_dir, "die"), "w").close()  # one engine dies at its next chunk
    got = p.generate(ps, sp, jax.random.key(3))
    assert p.restarts == 1 and p.resent_rows > 0
    assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.lengths, want.lengths)  # exactly once
    replaced = [i for i, s in enumerate(p.slots) if s.restarts]
    assert len(replaced) == 1
    i = replaced[0]
    assert _table(groups[i])["state"] == "REMOVED" and p.slots[i].group.id != groups[i].id  # a fresh group
    assert _table(p.slots[1 - i].group)["state"] == "CREATED" and p.slots[1 - i].group.id == groups[1 - i].id
    deadline = time.time() + 60  # the replacement serves only once the next version reaches it
    while len([h for h in p.health() if h["state"] == "up"]) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert len(p.serving()) == 1
    p.push(iter(weights(2)), version=2)
    assert len(p.serving()) == 2
    check_rollout(p.generate(ps, sp, jax.random.key(3)), ps, sp, offset=2)
    p.shutdown()
    assert all(s.group is None for s in p.slots)
    assert _table(groups[1 - i])["state"] == "REMOVED"


class AwayWorkersActor(FakeActor):
    """A Ray-executor engine whose second worker sits on another machine than the engine actor."""

    def health(self):
        return {**super().health(), "machine": "here",
                "workers": [{"machine": "here", "node": "a", "pid": 1}, {"machine": "there", "node": "b", "pid": 2}]}


def test_workers_on_another_machine_need_the_collective_transport(ray_local, tmp_path, monkeypatch):
    """The object-store transport stages updates under the engine actor's /dev/shm: a pool whose engine has a
    worker elsewhere refuses at start (not at the first push), naming the transport that reaches it."""
    import dataclasses

    monkeypatch.setattr(vllm_pool, "_ACTOR", actor_class(AwayWorkersActor, "AwayWorkersActor"))
    monkeypatch.setattr(vllm_ray, "CPU_SLOT", "CPU")
    monkeypatch.setattr(vllm_ray, "actor_runtime_env", lambda base=None: {})
    cfg = PoolConfig(model_dir=str(tmp_path), servers=1, executor="ray", request_timeout_s=60)
    with pytest.raises(PoolError, match=r"engine 0 has workers on other machines \(\['there'\]\).*"
                                        r"weight_transport: collective"):
        VLLMPool(cfg, pad_id=99)
    VLLMPool(dataclasses.replace(cfg, transport="collective"), pad_id=99).shutdown()


def test_the_shm_transport_needs_every_engine_on_the_trainers_machine(ray_local, tmp_path, monkeypatch):
    """The shm transport's files lie in this process's /dev/shm: an engine (or a worker) on another machine is
    refused at start; engines here get a pool that owns the files and removes them at shutdown."""
    import dataclasses

    class HereActor(FakeActor):
        def health(self):
            return {**super().health(), "machine": vllm_ray.host_of(None)[0]}

    monkeypatch.setattr(vllm_pool, "_ACTOR", actor_class(AwayWorkersActor, "AwayWorkersActor"))
    monkeypatch.setattr(vllm_ray, "CPU_SLOT", "CPU")
    monkeypatch.setattr(vllm_ray, "actor_runtime_env", lambda base=None: {})
    cfg = PoolConfig(model_dir=str(tmp_path), servers=1, executor="ray", request_timeout_s=60, transport="shm")
    with pytest.raises(PoolError, match=r"engine 0 runs on other machines \(\['here', 'there'\]\) than the trainer "
                                        r".*weight_transport: collective"):
        VLLMPool(cfg, pad_id=99)
    monkeypatch.setattr(vllm_pool, "_ACTOR", actor_class(HereActor, "HereActor"))
    pool = VLLMPool(dataclasses.replace(cfg, executor="uni"), pad_id=99)
    where = pool._segments.dir
    assert os.path.isdir(where)
    pool.shutdown()
    assert not os.path.exists(where)

    from rl.generation import shared_segments

    def ours():
        mine = shared_segments._owner_prefix(os.getpid())
        return [d for d in os.listdir(shared_segments.SEGMENT_ROOT) if d.startswith(mine)]

    before = ours()

    def no_engine(self, slots):
        raise PoolError("vLLM engine 0 failed to start")

    monkeypatch.setattr(VLLMPool, "_wait_ready", no_engine)
    with pytest.raises(PoolError, match="failed to start"):
        VLLMPool(dataclasses.replace(cfg, executor="uni"), pad_id=99)
    assert ours() == before  # a pool that never started leaves no files behind
