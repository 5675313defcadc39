"""Mesh construction and its rules: one clear error per violation."""

import jax
import pytest

from m3jax import M3Config
from sharding.mesh import MeshConfig, MeshError, build_mesh, mesh_config_of, validate
from sharding.rules import logical_to_spec, rules_for, use_rules

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
    (MeshConfig(1, 1, 16, 1), {"model": True}, r"num_local_experts=8 is not divisible by the expert-parallel size 16"),
    (MeshConfig(1, 1, 1, 4), {"model": True}, r"num_key_value_heads=2 is not divisible by mesh.tensor=4"),
    (MeshConfig(1, 1, 1, 8), {"model": True}, r"num_key_value_heads=2 is not divisible by mesh.tensor=8"),
    (MeshConfig(128, 1, 1, 1, expert_axes=("expert",)), {"model": True},
     r"hidden_size=64 is not divisible by mesh.data=128 \(FSDP\)"),
    (MeshConfig(1, 4, 1, 1), {"model": True, "seq_len": 48}, r"sequence length 48 is not divisible by "
                                                              r"mesh.context=4 x index_block_size=8"),
    (MeshConfig(1, 3, 1, 1), {"seq_len": 64}, r"sequence length 64 is not divisible by mesh.context=3$"),
    (MeshConfig(2, 1, 2, 1), {"batch": 6}, r"batch 6 is not divisible by mesh.data x mesh.expert = 4"),
])
def test_each_rule_has_its_error(mesh, kwargs, message):
    model = CFG if kwargs.pop("model", False) else None
    with pytest.raises(MeshError, match=message):
        validate(mesh, model, **kwargs)


def test_build_mesh_and_read_back():
    mesh = build_mesh(MeshConfig(2, 2, 2, 1), CFG, seq_len=64, batch=4)
    assert dict(mesh.shape) == {"data": 2, "context": 2, "expert": 2, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert mesh_config_of(mesh).shape == (2, 2, 2, 1)
    with pytest.raises(MeshError, match="lack"):
        mesh_config_of(jax.make_mesh((8,), ("x",)))


def test_rules_table_decides_placement():
    assert logical_to_spec(("layers", "experts", None, "expert_mlp", "embed")) == \
        jax.sharding.PartitionSpec(None, ("data", "context", "expert"), None, "tensor", None)
    with use_rules(rules_for(("expert",))):  # experts on the expert axis only: embed is FSDP again
        assert logical_to_spec(("experts", None, "expert_mlp", "embed")) == \
            jax.sharding.PartitionSpec("expert", None, "tensor", "data")
