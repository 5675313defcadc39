"""The layout is a value: a model loaded onto `build_mesh(...)` keeps its mesh and rules for every call,
and each jitted pass of a run lowers to the expert-parallel program of the run's layout."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from rl.config import load_config
from rl.generation.backends import sampling_of
from rl.logprobs import make_logprob_pass
from sharding import optim_step
from sharding.layout import Layout
from sharding.mesh import MeshConfig, MeshError, build_mesh
from sharding.train_step import init_state, make_train_step, state_shardings
from tests import reference as ref

SEQ = 32


@pytest.fixture(scope="module")
def six_experts(tmp_path_factory):
    """A checkpoint whose 6 experts do not divide the 8 devices of data x context x expert = 2 x 2 x 2."""
    hf = ref.build_model(ref.tiny_config("release_like", num_local_experts=6, num_experts_per_tok=2), seed=5)
    return ref.save(hf, str(tmp_path_factory.mktemp("six")), "native")


@pytest.mark.slow  # loads and runs on 8 devices and on one; the fast loop keeps the MeshError case
def test_six_experts_on_eight_devices_with_explicit_expert_axes(six_experts):
    single = m3jax.from_pretrained(six_experts)
    ids = jnp.asarray(ref.random_ids(single.cfg, 4, SEQ, seed=1))
    want = np.asarray(single(ids))

    layout = build_mesh(MeshConfig(2, 2, 2, 1, expert_axes=("expert",)), single.cfg)
    model = m3jax.from_pretrained(six_experts, mesh=layout)  # no other call: no rules context, no set_mesh
    experts = model.stacks[-1].experts_gate_up[...]
    assert all(s.data.shape[1] == 3 for s in experts.addressable_shards)  # 6 experts over the expert axis (2)
    assert model.layout == layout
    with jax.set_mesh(layout.mesh):
        under_mesh = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
    no_context = np.asarray(model(ids))
    scale = np.max(np.abs(want))
    for got in (under_mesh, no_context):
        assert np.max(np.abs(got - want)) / scale <= 1e-5
    # ... and the placement is unchanged by the calls
    assert all(s.data.shape[1] == 3 for s in model.stacks[-1].experts_gate_up[...].addressable_shards)


def test_six_experts_on_the_default_expert_axes_is_a_mesh_error(six_experts):
    cfg = m3jax.M3Config.from_pretrained(six_experts)
    with pytest.raises(MeshError, match=r"num_local_experts=6 is not divisible by mesh.data=2 x mesh.context=2 x "
                                        r"mesh.expert=2 = 8 .*mesh.expert_axes"):
        build_mesh(MeshConfig(2, 2, 2, 1), cfg)
    bare = build_mesh(MeshConfig(2, 2, 2, 1))  # built without the model: from_pretrained checks it
    with pytest.raises(MeshError, match="num_local_experts=6"):
        m3jax.from_pretrained(six_experts, mesh=bare)


@pytest.mark.slow  # a forward compile; every single-device test builds its model without a layout
def test_a_model_built_without_a_layout_runs_on_one_device():
    cfg = m3jax.M3Config.from_hf_dict(ref.tiny_config("release_like").to_dict())
    assert m3jax.M3ForCausalLM(cfg, rngs=nnx.Rngs(0)).layout == Layout()


def _exchanges(text: str) -> int:
    return text.count("all_to_all") + text.count("all-to-all")


@pytest.mark.slow  # lowers a train step and a logprob pass on a mesh
def test_logprob_pass_and_train_step_lower_to_the_expert_parallel_program():
    """Both passes of a run trace the expert exchange on a multi-device layout (before the fix, the
    logprob pass ran outside the mesh and every device gathered every expert)."""
    cfg = load_config("configs/tiny.yaml", ["mesh.data=2", "mesh.context=2", "mesh.expert=2",
                                            "mesh.expert_axes=[data, expert]", "grpo.micro_batch_size=4",
                                            "grpo.prompts_per_step=2"])
    m3 = cfg.model.m3_config()
    layout = build_mesh(cfg.mesh.to_mesh_config(), m3, seq_len=SEQ)
    model = m3jax.M3ForCausalLM(m3, rngs=nnx.Rngs(0), layout=layout)
    opt = optim_step.adamw(1e-3, master="none")
    graphdef, state = init_state(model, opt)
    shardings = state_shardings(layout, state)
    state = jax.device_put(state, shardings)
    batch = {k: np.zeros((1, 4, SEQ), np.int32) for k in ("input_ids", "targets", "attention_mask")}
    batch["loss_mask"] = np.ones((1, 4, SEQ), np.float32)

    logprobs = make_logprob_pass(graphdef, sampling_of(cfg, m3.eos_token_id), layout)
    with jax.set_mesh(layout.mesh):
        text = logprobs.jitted.lower(state.params, state.rest, batch).as_text()
    assert _exchanges(text) > 0
    # Without the layout (a one-device model), the same pass has no exchange: the check can fail.
    plain = make_logprob_pass(nnx.graphdef(m3jax.M3ForCausalLM(m3, rngs=nnx.Rngs(0))), sampling_of(cfg, 12))
    assert _exchanges(plain.jitted.lower(state.params, state.rest, batch).as_text()) == 0

    step = make_train_step(graphdef, opt, mesh=layout, shardings=shardings)
    with jax.set_mesh(layout.mesh):
        text = step.jitted.lower(state, batch).as_text()
    assert _exchanges(text) > 0
    out = np.asarray(logprobs(state.params, state.rest, batch))
    assert out.shape == (1, 4, SEQ) and np.all(np.isfinite(out))


def test_the_layout_not_the_process_decides_the_platform_choices(monkeypatch):
    """A model built for GPUs in a CPU process (what the compile-only GPU checks do) makes a GPU's "auto" choices
    from its layout: the experts on ragged_dot, the sparse layers on per-tile gathers; the same model on the
    process's own CPU layout runs the bucketed kernel and the slot path. Nothing patches jax.default_backend."""
    from m3jax.model import attention
    from m3jax.tiny import m3_config

    assert jax.default_backend() == "cpu" and Layout().backend == "cpu"
    cpu_mesh = build_mesh(MeshConfig(), None, devices=jax.devices()[:1])
    assert cpu_mesh.backend == "cpu" and Layout(platform="gpu").backend == "gpu"
    assert dataclasses.replace(cpu_mesh, platform="gpu", fsdp_step_axes=("data",)).backend == "gpu"

    paths = []
    real = attention.one_device_path
    monkeypatch.setattr(attention, "one_device_path", lambda *a: paths.append(real(*a)) or paths[-1])
    cfg = m3_config()
    ids = jnp.zeros((1, 64), jnp.int32)  # 4 key blocks of 16, top-2: the sparse layers select (sees_every_block)

    def program(layout):
        model = m3jax.M3ForCausalLM(cfg, rngs=nnx.Rngs(0), layout=layout)
        paths.clear()
        text = str(jax.make_jaxpr(lambda m, i: m(i))(model, ids))
        return text, set(paths)

    gpu_text, gpu_paths = program(Layout(platform="gpu"))
    cpu_text, cpu_paths = program(Layout())
    assert "ragged_dot_general" in gpu_text and gpu_paths == {"tiles"}
    assert "ragged_dot_general" not in cpu_text and cpu_paths == {"slots"}

    # The full layer of a bf16 model asks for cuDNN for the GPU it is built for (the call itself needs a GPU's
    # cuDNN to trace, so here it is recorded and answered by the fallback).
    asked = []

    def fused(q, k, v, positions, key_valid, scale, fallback, backend=None):
        asked.append(backend)
        return fallback(q, k, v)

    monkeypatch.setattr(attention, "fused_attention", fused)
    model = m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), layout=Layout(platform="gpu"))
    jax.make_jaxpr(lambda m, i: m(i))(model, ids)
    assert asked == ["gpu"] * cfg.layer_types.count("full_attention")


def test_a_logprob_pass_batch_the_mesh_does_not_divide_is_named():
    """jax's IndivisibleError from the batch's device_put named no setting (an audit); raised before any trace."""
    cfg = load_config("configs/tiny.yaml", ["mesh.data=2", "mesh.context=2", "mesh.expert=2", "grpo.micro_batch_size=4",
                                            "mesh.expert_axes=[data, expert]"])
    m3 = cfg.model.m3_config()
    layout = build_mesh(cfg.mesh.to_mesh_config(), m3, seq_len=SEQ)
    graphdef, state = init_state(m3jax.M3ForCausalLM(m3, rngs=nnx.Rngs(0), layout=layout), optim_step.adamw(1e-3))
    batch = {k: np.zeros((1, 4, SEQ - 1), np.int32) for k in ("input_ids", "targets", "attention_mask")}
    logprobs = make_logprob_pass(graphdef, sampling_of(cfg, m3.eos_token_id), layout)
    with pytest.raises(ValueError, match=f"logprob pass batch: {SEQ - 1} positions on mesh axes context of 2 shards"):
        logprobs(state.params, state.rest, batch)
