"""A model initialised at random on a layout (`M3ForCausalLM(cfg, rngs, layout=...)`, the trainer's start without
model.path) draws each parameter on its shardings: every device computes only its own shards, and the values are the
one-device draw's, bit for bit. Before, every parameter was drawn whole on jax's default device and placed on the mesh
after (by `build_policy`): a release-sized model does not fit one device that way."""

import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.model import decoder
from m3jax.model.specs import top_param_specs
from rl.config import load_config
from rl.policy import build_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
MESH = ["mesh.data=2", "mesh.context=2", "mesh.tensor=2", "grpo.micro_batch_size=64"]


def bits(x) -> np.ndarray:
    return np.asarray(x).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("precision", [["precision.master=none"],
                                       ["precision.master=compact", "precision.moment_dtype=bfloat16"]],
                         ids=["fp32", "bf16_compact"])
def test_a_state_initialised_on_a_mesh_is_the_one_device_state(tmp_path, precision):
    def state(*mesh):
        cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "model.init_seed=7", *precision, *mesh])
        return build_policy(cfg, kernel_timing="off")

    one, cut = state(), state(*MESH)
    want, got = jax.tree.leaves_with_path(one.state), jax.tree.leaves_with_path(cut.state)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, x), (_, y) in zip(got, want):
        assert (x.shape, x.dtype) == (y.shape, y.dtype), path
        np.testing.assert_array_equal(bits(x), bits(y), err_msg=jax.tree_util.keystr(path))


def test_each_parameter_is_drawn_on_its_shards(tmp_path):
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", *MESH])
    layout = build_policy(cfg, kernel_timing="off").layout
    model = m3jax.M3ForCausalLM(cfg.model.m3_config(), rngs=nnx.Rngs(3), layout=layout)
    whole = m3jax.M3ForCausalLM(cfg.model.m3_config(), rngs=nnx.Rngs(3))
    params, want = nnx.to_flat_state(nnx.state(model)), dict(nnx.to_flat_state(nnx.state(whole)))
    cut = 0
    for path, var in params:
        x = var.get_value()
        assert x.sharding.is_equivalent_to(layout.sharding(var.get_metadata()["logical_axes"]), x.ndim), path
        cut += not x.sharding.is_fully_replicated
        np.testing.assert_array_equal(bits(x), bits(want[path].get_value()), err_msg=str(path))
    assert cut >= len(params) // 2, (cut, len(params))  # most weights are cut over the mesh, not replicated
    # the draw of the embedding, cut 4 ways, computes only its shards: the partitioned program holds no array with as
    # many elements as the whole table (with jax_threefry_partitionable off it holds u32[whole], the whole draw's bits
    # on every device, and this fails)
    spec = top_param_specs(cfg.model.m3_config())["embed"]
    sharding = layout.sharding(spec.axes)
    assert sharding.shard_shape(spec.shape) != spec.shape
    text = decoder._normal.lower(jax.random.key(0), spec.shape, np.dtype("float32"), sharding).compile().as_text()
    sizes = {int(np.prod([int(n) for n in dims.split(",")])) for dims in re.findall(r"[fu]32\[([0-9,]+)\]", text)}
    assert int(np.prod(sharding.shard_shape(spec.shape))) in sizes
    assert max(sizes) < int(np.prod(spec.shape)), sorted(sizes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cut", [False, True], ids=["one_device", "cut"])
def test_a_draw_is_the_eager_draw_scaled_and_cast(tmp_path, dtype, cut):
    """One program per weight (the draw, its scale and its cast) gives the bits of the three eager ops it replaced:
    fused, XLA moved some by 1 ulp (the barrier in `decoder._normal`)."""
    key, shape = jax.random.key(11), (64, 256)
    sharding = None
    if cut:
        layout = build_policy(load_config(TINY, [f"run.out_dir={tmp_path}", *MESH]), kernel_timing="off").layout
        sharding = layout.sharding(("table_vocab", None))
    want = (0.02 * jax.random.normal(key, shape, "float32")).astype(dtype)
    got = decoder._normal(key, shape, np.dtype(want.dtype), sharding)
    assert got.dtype == want.dtype and (sharding is None or got.sharding.is_equivalent_to(sharding, 2))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("precision", [[], ["precision.master=compact", "precision.moment_dtype=bfloat16"]],
                         ids=["fp32_master", "compact_bf16_moments"])
def test_the_optimizer_state_is_made_on_the_parameters_shards(tmp_path, precision):
    """Adam's moments and the compact master's remainders were made whole (`jnp.zeros(shape)`) on jax's default
    device, then placed by `build_policy`: a release-sized model's fp32 moments are 3.4 TB, and on several hosts
    placing an unplaced array gathers it from every host to compare (jax's check). Each is now made where the
    train state keeps it."""
    policy = build_policy(load_config(TINY, [f"run.out_dir={tmp_path}", *MESH, *precision]), kernel_timing="off")
    made = policy.optimizer.init(policy.state.params)
    leaves = jax.tree.leaves_with_path(made)
    for (path, x), want in zip(leaves, jax.tree.leaves(policy.shardings.opt_state)):
        if x.ndim:  # the step counts are scalars, placed with the state
            assert x.committed and x.sharding.is_equivalent_to(want, x.ndim), (jax.tree_util.keystr(path), x.sharding)
    assert sum(not x.sharding.is_fully_replicated for _, x in leaves) >= len(leaves) // 2  # most are cut


def test_a_fresh_one_device_state_goes_into_the_programs_a_restored_one_does(tmp_path):
    """A fresh state's arrays were uncommitted and a restored one's committed (orbax puts each on a device), so the
    train step's program differed between them and the first resume of a one-device run missed the persistent
    compilation cache and compiled every program again (a soak run: 85 cache entries, 129 after its resume)."""
    policy = build_policy(load_config(TINY, [f"run.out_dir={tmp_path}"]), kernel_timing="off")
    restored = policy.place(jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices()[0]), policy.state))

    def program(state) -> str:
        return jax.jit(lambda s: jax.tree.map(lambda x: x * 2, s.params)).lower(state).as_text()

    assert all(x.committed for x in jax.tree.leaves((policy.state, restored)))
    assert program(policy.state) == program(restored)
