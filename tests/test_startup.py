"""What a run says while it starts (rl.startup): a line per phase, naming what it built and its time."""

import logging
import types

import jax
import jax.numpy as jnp

from rl.startup import PhaseClock, generation_line, policy_line, prompts_line
from sharding.layout import Layout


def cfg(**sections):
    base = {"data": {"kind": "synthetic", "task": "copy", "path": None},
            "grpo": {"prompts_per_step": 32, "group_size": 8},
            "model": {"path": None, "init_seed": 3},
            "generation": {"backend": "jax", "vllm_servers": 1, "vllm_tensor_parallel": 1}}
    for name, fields in sections.items():
        base[name] = {**base[name], **fields}
    return types.SimpleNamespace(**{k: types.SimpleNamespace(**v) for k, v in base.items()})


def test_each_phase_is_one_line_with_the_seconds_since_the_last(caplog):
    now = [10.0]
    clock = PhaseClock(clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="rl.startup"):
        now[0] = 12.5
        assert clock.done("prompts: %d", 7) == 2.5
        now[0] = 20.0
        clock.restart()  # what came between is timed elsewhere
        now[0] = 21.0
        clock.done("held out")
    assert [r.getMessage() for r in caplog.records] == ["prompts: 7 (2.5 s)", "held out (1.0 s)"]


def test_the_lines_name_the_source_the_size_and_the_mesh():
    params = {"a": jnp.zeros((1000, 1250), jnp.bfloat16), "b": jnp.zeros((3,), jnp.float32)}
    mesh = jax.make_mesh((2, 1, 2, 2), ("data", "context", "expert", "tensor"), devices=jax.devices()[:8])
    assert policy_line(cfg(), params, Layout(mesh=mesh), None) == (
        "policy: 1.25 M parameters (bfloat16, float32), initialised at random (model.init_seed 3); on mesh data 2 x "
        "context 1 x expert 2 x tensor 2 (8 cpu devices)")
    # a one-device config on this host of 8 (simulated) devices: the log's only hint was "on 1 cpu device"
    assert policy_line(cfg(model={"path": "/ckpt/m3"}), params, Layout(), None).endswith(
        "loaded from /ckpt/m3; on 1 of 8 cpu devices (the mesh's axes multiply to 1: the other 7 are idle)")
    assert "restored from checkpoint step 40;" in policy_line(cfg(model={"path": "/ckpt/m3"}), params, Layout(), 40)
    assert prompts_line(cfg(), 4096) == "prompts: 4096 from the synthetic task 'copy', 32 x 8 samples a step"
    assert prompts_line(cfg(data={"kind": "file", "path": "/d/train.jsonl"}), 9).startswith(
        "prompts: 9 from /d/train.jsonl,")
    assert generation_line(cfg(generation={"backend": "vllm", "vllm_servers": 4, "vllm_tensor_parallel": 8})) == \
        "generation: 4 vLLM servers, 8 devices each, started"
