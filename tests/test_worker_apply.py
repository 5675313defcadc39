"""How a vLLM worker process writes an update (rl.generation.vllm_worker_weights): in place through the applier
it built for its model, else vLLM's reload_weights; an applier that cannot be built is a reason, not a crash
of the engine's start. The real engines are in tests/test_vllm_engine_tp.py and tests/test_vllm_engine_ray.py."""

from types import SimpleNamespace

import pytest

from rl.generation.vllm_worker_weights import WorkerWeights

pytest.importorskip("vllm")


class _Worker(WorkerWeights):
    rank = 1

    def __init__(self, model):
        self.model_runner = SimpleNamespace(model=model)
        self.reloaded = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        self.reloaded.append(list(weights_iterator))


def test_a_worker_without_an_applier_says_why_and_reloads():
    worker = _Worker(model=object())  # not a torch module: the applier cannot walk it
    why = worker.m3jax_setup_apply()
    assert why.startswith("worker 1: no in-place applier (AttributeError")
    worker.m3jax_write_weights(iter([("model.norm.weight", 1)]))
    assert worker.reloaded == [[("model.norm.weight", 1)]]


def test_a_covered_worker_applies_in_place_until_dropped():
    import torch

    worker = _Worker(model=torch.nn.Sequential(torch.nn.LayerNorm(4)))  # plain parameters: nothing to re-pack
    assert worker.m3jax_setup_apply() is None
    written = []
    worker._m3jax_applier.apply = lambda tensors: written.append(list(tensors))
    worker.m3jax_write_weights(iter([("a", 1)]))
    assert written == [[("a", 1)]] and not worker.reloaded
    worker.m3jax_drop_apply()
    worker.m3jax_write_weights(iter([("a", 2)]))
    assert worker.reloaded == [[("a", 2)]]
