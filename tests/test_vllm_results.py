"""What vLLM engines answer, as a Rollout (rl.generation.vllm_results): vLLM's routed_experts rows become
`Rollout.routes` exactly as the JAX engine lays them out (issue 14 item 1), and a CPU pool refuses to
promise them.
A real GPU engine's routes are checked by scripts/gpu_check.py (check 9); CPU vLLM cannot return them."""

import re

import numpy as np
import pytest

from rl.generation.vllm_results import (CPU_REASON, assemble_rollout, moe_layer_ids, rollout_routes,
                                        routes_from_vllm)

TEXT = {"num_hidden_layers": 4, "moe_layer_freq": [0, 1, 0, 1]}


def vllm_rows(n_tokens, n_layers=4, k=2, seed=0):
    """What vLLM returns: uint8 [tokens, all layers, k]; dense layers' rows never written (zeros)."""
    rows = np.random.default_rng(seed).integers(0, 8, (n_tokens, n_layers, k)).astype(np.uint8)
    rows[:, [0, 2]] = 0
    return rows


def test_moe_layer_ids_follow_the_released_config():
    assert moe_layer_ids(TEXT) == [1, 3]
    with pytest.raises(ValueError, match=r"moe_layer_freq=\[0, 1\]: expected a list with one 0/1 per layer \(4"):
        moe_layer_ids({"num_hidden_layers": 4, "moe_layer_freq": [0, 1]})


def test_routes_from_vllm_keeps_the_moe_layers_as_int16():
    rows = vllm_rows(7)
    got = routes_from_vllm(rows, [1, 3], n_tokens=7, k=2)
    assert got.dtype == np.int16 and got.shape == (7, 2, 2)
    np.testing.assert_array_equal(got, rows[:, [1, 3]].astype(np.int16))
    for bad, n_tokens, k, msg in ((rows, 8, 2, r"shape \(7, 4, 2\): expected \[8 tokens"),
                                  (rows, 7, 4, "k=4"), (rows[:, :3], 7, 2, ">= 4 layers")):
        with pytest.raises(ValueError, match=msg):
            routes_from_vllm(bad, [1, 3], n_tokens=n_tokens, k=k)
    with pytest.raises(ValueError, match="not started with enable_return_routed_experts"):
        routes_from_vllm(None, [1, 3], n_tokens=7, k=2)


def test_rollout_routes_lay_rows_out_as_prompt_plus_response():
    a, b = routes_from_vllm(vllm_rows(5, seed=1), [1, 3], 5, 2), routes_from_vllm(vllm_rows(3, seed=2), [1, 3], 3, 2)
    out = rollout_routes([a, b], width=6)
    assert out.shape == (2, 6, 2, 2) and out.dtype == np.int16
    np.testing.assert_array_equal(out[0, :5], a)
    np.testing.assert_array_equal(out[1, :3], b)
    assert not out[0, 5:].any() and not out[1, 3:].any()
    assert rollout_routes([None, None], width=6) is None
    with pytest.raises(ValueError, match="1 of 2 rows came back without routes"):
        rollout_routes([a, None], width=6)
    with pytest.raises(ValueError, match="routes for 5 tokens exceed the rollout width 4"):
        rollout_routes([a, b], width=4)


def test_rollout_carries_the_engines_routes():
    """assemble_rollout, as the pool's generate calls it, with the answers of engines started with
    return_routes: the routes sit where the JAX engine puts them (row i, token j of prompt + response), width
    = prompt width + max_new_tokens, so `rl.phases.train_batch` slices them like input_ids."""
    prompts = [[1, 2, 3], [4, 5]]
    responses = [[7, 8], [9, 10, 11]]
    per_row = [routes_from_vllm(vllm_rows(len(p) + len(r) - 1, seed=i), [1, 3], len(p) + len(r) - 1, 2)
               for i, (p, r) in enumerate(zip(prompts, responses))]
    results = [(r, [-0.5] * len(r), False, rt) for r, rt in zip(responses, per_row)]
    out = assemble_rollout(prompts, results, 4, 5, pad_id=0, version=3)
    assert out.routes.shape == (2, 9, 2, 2) and out.weight_version == 3
    assert out.tokens.tolist() == [[7, 8, 0, 0], [9, 10, 11, 0]] and out.lengths.tolist() == [2, 3]
    for i, rt in enumerate(per_row):
        np.testing.assert_array_equal(out.routes[i, :len(rt)], rt)
    assert assemble_rollout(prompts, [r[:3] for r in results], 4, None, pad_id=0, version=3).routes is None


def test_cpu_pool_refuses_routes_before_any_engine_starts(ray_local):
    from rl.generation.vllm_pool import PoolConfig, PoolError, VLLMPool

    with pytest.raises(PoolError, match=r"grpo.routing_replay: rollout\).*" + re.escape(CPU_REASON)):
        VLLMPool(PoolConfig(model_dir="/nonexistent", servers=1, return_routes=True))
