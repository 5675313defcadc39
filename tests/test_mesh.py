"""Mesh construction and its rules: one clear error per violation."""

import jax
import pytest

from m3jax import M3Config
from sharding.mesh import MeshConfig, MeshError, build_mesh, mesh_config_of, validate
from sharding.layout import Layout, as_layout
from sharding.rules import logical_to_spec, rules_for

CFG = M3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=32,
               num_local_experts=8, num_experts_per_tok=2, partial_rotary_factor=0.5,
               layer_types=("full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "sparse"),
               index_n_heads=2, index_head_dim=16, index_block_size=8, index_topk_blocks=2)


@pytest.mark.parametrize("mesh, kwargs, message", [
    (MeshConfig(0, 1, 1, 1), {}, r"mesh axis 'data' = 0: expected a positive integer"),
    (MeshConfig(2, 2, 1, 1), {"num_devices": 8}, r"2 x 2 x 1 x 1 = 4 devices, but 8 are available"),
    (MeshConfig(1, 1, 1, 1, expert_axes=("tensor",)), {}, r"expert_axes = \('tensor',\)"),
    (MeshConfig(1, 1, 1, 1, expert_axes=("data", "data")), {}, r"expert_axes = \('data', 'data'\)"),
    (MeshConfig(1, 1, 16, 1), {"model": True}, r"num_local_experts=8 is not divisible by mesh.expert=16 = 16 "
                                                r"\(the shards of 'experts'\); mesh.expert_axes="),
    (MeshConfig(4, 2, 2, 1), {"model": True}, r"num_local_experts=8 is not divisible by mesh.data=4 x "
                                              r"mesh.context=2 x mesh.expert=2 = 16"),
    (MeshConfig(1, 1, 1, 4), {"model": True}, r"num_key_value_heads=2 is not divisible by mesh.tensor=4 = 4"),
    (MeshConfig(1, 1, 1, 8), {"model": True}, r"num_key_value_heads=2 is not divisible by mesh.tensor=8"),
    (MeshConfig(128, 1, 1, 1, expert_axes=("expert",)), {"model": True},
     r"hidden_size=64 is not divisible by mesh.data=128 = 128 \(the shards of 'embed'\)"),
    (MeshConfig(1, 4, 1, 1), {"model": True, "seq_len": 48}, r"sequence length 48 is not divisible by "
                                                              r"mesh.context=4 x 8 \(the model's block size\)"),
    (MeshConfig(1, 3, 1, 1), {"seq_len": 64}, r"sequence length 64 is not divisible by mesh.context=3$"),
    (MeshConfig(2, 1, 2, 1), {"batch": 6}, r"batch 6 is not divisible by mesh.data x mesh.expert = 4"),
])
def test_each_rule_has_its_error(mesh, kwargs, message):
    model = CFG if kwargs.pop("model", False) else None
    with pytest.raises(MeshError, match=message):
        validate(mesh, model, **kwargs)


def test_too_few_cpu_devices_says_how_to_simulate_them():
    """The miniature recipe without XLA_FLAGS: the error now says how to get its 8 devices on a CPU."""
    with pytest.raises(MeshError, match=r"= 4 devices, but 2 are available; on CPU, simulate them: "
                                        r"XLA_FLAGS=--xla_force_host_platform_device_count=4 in the environment"):
        build_mesh(MeshConfig(2, 2, 1, 1), devices=jax.devices()[:2])
    with pytest.raises(MeshError, match=r"= 1 devices, but 2 are available; expected a product of 2$"):  # too many
        build_mesh(MeshConfig(1, 1, 1, 1), devices=jax.devices()[:2])


def test_build_mesh_and_read_back():
    layout = build_mesh(MeshConfig(2, 2, 2, 1), CFG, seq_len=64, batch=4)
    assert isinstance(layout, Layout)
    mesh = layout.mesh
    assert dict(mesh.shape) == {"data": 2, "context": 2, "expert": 2, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert mesh_config_of(layout).shape == (2, 2, 2, 1)
    assert mesh_config_of(mesh).expert_axes == ("data", "context", "expert")  # a bare Mesh: the default rules
    with pytest.raises(MeshError, match="lack"):
        mesh_config_of(jax.make_mesh((8,), ("x",)))


def test_layout_carries_its_rules():
    """Where the experts live is part of the value build_mesh returns, not process state."""
    narrow = build_mesh(MeshConfig(2, 2, 2, 1, expert_axes=("expert",)), CFG)
    wide = build_mesh(MeshConfig(2, 2, 2, 1), CFG)
    assert mesh_config_of(narrow).expert_axes == ("expert",)
    assert narrow.spec(("experts", None, "expert_mlp", "embed")) == \
        jax.sharding.PartitionSpec("expert", None, "tensor", "data")
    assert wide.spec(("experts", None, "expert_mlp", "embed")) == \
        jax.sharding.PartitionSpec(("data", "context", "expert"), None, "tensor", None)
    assert narrow.size("experts") == 2 and wide.size("experts") == 8 and Layout().size("experts") == 1
    assert as_layout(None) == Layout() and as_layout(narrow) is narrow and as_layout(narrow.mesh).rules == wide.rules
    with pytest.raises(TypeError, match="expected a sharding.layout.Layout"):
        as_layout("mesh")
    with pytest.raises(KeyError, match="no row in the sharding rules table"):
        narrow.spec(("expertz",))


def test_rules_table_decides_placement():
    assert logical_to_spec(("layers", "experts", None, "expert_mlp", "embed")) == \
        jax.sharding.PartitionSpec(None, ("data", "context", "expert"), None, "tensor", None)
    # experts on the expert axis only: embed is FSDP again
    assert logical_to_spec(("experts", None, "expert_mlp", "embed"), rules_for(("expert",))) == \
        jax.sharding.PartitionSpec("expert", None, "tensor", "data")


def test_fsdp_axes_place_the_non_expert_weights():
    """mesh.fsdp_axes is the rules table's `embed` row: data by default (the table as written), any distinct token
    axes, or none (replicated); tensor is refused, and the layout gives the axes back."""
    assert MeshConfig().rules == rules_for(MeshConfig().expert_axes)
    both = build_mesh(MeshConfig(2, 2, 2, 1, fsdp_axes=("data", "context")), CFG)
    assert both.spec(("q_heads", None, "embed")) == jax.sharding.PartitionSpec("tensor", None, ("data", "context"))
    assert mesh_config_of(both).fsdp_axes == ("data", "context")
    none = build_mesh(MeshConfig(2, 2, 2, 1, fsdp_axes=()), CFG)
    assert none.spec(("q_heads", None, "embed")) == jax.sharding.PartitionSpec("tensor", None, None)
    for bad in (("tensor",), ("data", "data")):
        with pytest.raises(MeshError, match=r"mesh.fsdp_axes = .*expected distinct axes from"):
            validate(MeshConfig(2, 2, 2, 1, fsdp_axes=bad))
