"""The sharded model equals the single-device one on 8 simulated CPU devices.

Each case compiles one program, the loss and its gradients with the logits as an auxiliary output, and
compares all three with the single device's. The fast loop runs the (2, 2, 2, 1) mesh (data x context x
expert); the other meshes (tensor parallel among them) and the chunk sizes are slow.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import m3jax
from sharding.mesh import MeshConfig, build_mesh
from tests import reference as ref

MESHES = [(8, 1, 1, 1), (1, 8, 1, 1), (1, 1, 8, 1), (2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 2, 2)]
# (mesh, attention_query_chunk) against the unchunked single device: per-device query counts 8, 32, 32;
# 3 and 5 leave a padded last block.
CASES = [(shape, 0) for shape in MESHES] + [((1, 8, 1, 1), 3), ((2, 2, 2, 1), 5), ((1, 2, 2, 2), 16)]
FAST = {((2, 2, 2, 1), 0)}
# the chunked cases and the data-only mesh widen what the others check: run with -m extended
EXTENDED = {((1, 8, 1, 1), 3), ((2, 2, 2, 1), 5), ((1, 2, 2, 2), 16), ((8, 1, 1, 1), 0), ((1, 8, 1, 1), 0),
            ((1, 1, 8, 1), 0), ((2, 1, 2, 2), 0)}  # the default run keeps 2x2x2x1 and 1x2x2x2 (tensor parallel)
BATCH, SEQ = 8, 64  # SEQ = 4 x (index_topk_blocks x index_block_size): sparse layers select


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = ref.tiny_config("release_like")
    hf = ref.build_model(cfg, seed=11)
    with torch.no_grad():  # unbalanced routing: expert 0 takes every token, experts 5 and 6 none
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.zero_()
                bias[0], bias[5], bias[6] = 5.0, -5.0, -5.0
    return ref.save(hf, str(tmp_path_factory.mktemp("ckpt")), "native")


def logits_loss_and_grads(model, ids):
    """(logits, loss, gradients of the loss) from one jitted program."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(ids[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)), logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(logits), loss, grads


@pytest.fixture(scope="module")
def single(ckpt):
    model = m3jax.from_pretrained(ckpt)
    ids = jnp.asarray(ref.random_ids(model.cfg, BATCH, SEQ + 1, seed=3))
    return (model, ids, *logits_loss_and_grads(model, ids))


def assert_equals_single_device(single, logits, loss, grads):
    """Logits, loss and every gradient within 1e-5 (relative to their scale) of the single device's."""
    _, _, want_logits, want_loss, want_grads = single
    assert np.max(np.abs(logits - want_logits)) / np.max(np.abs(want_logits)) < 1e-5
    assert abs(float(loss) - float(want_loss)) < 1e-5 * abs(float(want_loss))
    got = dict(nnx.to_flat_state(grads))
    for path, g in nnx.to_flat_state(want_grads):
        g, h = np.asarray(g.get_value()), np.asarray(got[path].get_value())
        scale = np.max(np.abs(g))
        if scale == 0:
            assert not np.any(h), path  # indexer: no gradient, sharded or not
        else:
            assert np.max(np.abs(h - g)) / scale < 1e-5, path


def test_routing_is_unbalanced_and_sparse_layers_select(single):
    model, ids, _, _, _ = single
    from m3jax.model.moe import route
    stack = model.stacks[1]
    x = jnp.take(model.embed[...], ids[:, :-1], axis=0).reshape(-1, model.cfg.hidden_size)
    _, idx = route(x, stack.router[...][0], stack.router_bias[...][0], top_k=model.cfg.num_experts_per_tok)
    counts = np.bincount(np.asarray(idx).reshape(-1), minlength=model.cfg.num_local_experts)
    assert counts[0] == x.shape[0] and counts[5] == counts[6] == 0
    assert SEQ > model.cfg.index_topk_blocks * model.cfg.index_block_size


@pytest.mark.parametrize("shape,chunk", [c if c in FAST else pytest.param(*c, marks=(pytest.mark.slow,) + ((pytest.mark.extended,) if c in EXTENDED else ())) for c in CASES],
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else f"chunk{c}")
def test_sharded_logits_and_grads_equal_single_device(ckpt, single, shape, chunk):
    layout = build_mesh(MeshConfig(*shape), single[0].cfg, seq_len=SEQ, batch=BATCH)
    model = m3jax.from_pretrained(ckpt, mesh=layout, attention_query_chunk=chunk)
    with jax.set_mesh(layout.mesh):
        assert_equals_single_device(single, *logits_loss_and_grads(model, single[1]))


def test_from_pretrained_places_experts_on_their_shards(ckpt):
    mesh = build_mesh(MeshConfig(2, 1, 4, 1), seq_len=SEQ)
    model = m3jax.from_pretrained(ckpt, mesh=mesh)
    experts = model.stacks[1].experts_gate_up[...]  # [L, E=8, 2, I, d], experts over data x expert = 8
    shards = experts.addressable_shards
    assert len(shards) == 8 and all(s.data.shape[1] == 1 for s in shards)
    embed = model.embed[...]  # rows over data (x tensor = 1)
    assert all(s.data.shape == (embed.shape[0] // 2, embed.shape[1]) for s in embed.addressable_shards)


def test_fsdp_over_data_and_context_equals_single_device(ckpt, single):
    """mesh.fsdp_axes = (data, context): the non-expert weights are cut over both axes (their `embed` dimension),
    and the logits, loss and gradients stay the single device's."""
    layout = build_mesh(MeshConfig(2, 2, 2, 1, fsdp_axes=("data", "context")), single[0].cfg, seq_len=SEQ,
                        batch=BATCH)
    model = m3jax.from_pretrained(ckpt, mesh=layout)
    q_proj = model.stacks[0].q_proj[...]
    assert q_proj.sharding.spec[-1] == ("data", "context"), q_proj.sharding.spec  # [layers, H, D, embed]
    with jax.set_mesh(layout.mesh):
        assert_equals_single_device(single, *logits_loss_and_grads(model, single[1]))


@pytest.mark.slow  # two more compiles of the model (~20 s)
def test_the_bf16_model_on_a_mesh_makes_the_single_devices_logits_and_loss(ckpt, single):
    """bf16 parameters: the (2, 2, 2, 1) mesh's logits and loss are one device's bit for bit on this input (measured
    in session 50 while looking for a 0.4 % bf16 loss difference a helper saw between a mesh run and a one-device
    run). Not on every input: the mesh sums in other orders, a few bf16 units apart (docs/limitations.md)."""
    ids = single[1]
    alone = logits_loss_and_grads(m3jax.from_pretrained(ckpt, dtype=jnp.bfloat16), ids)
    layout = build_mesh(MeshConfig(2, 2, 2, 1), single[0].cfg, seq_len=SEQ, batch=BATCH)
    model = m3jax.from_pretrained(ckpt, mesh=layout, dtype=jnp.bfloat16)
    with jax.set_mesh(layout.mesh):
        logits, loss, _ = logits_loss_and_grads(model, ids)
    np.testing.assert_array_equal(logits, alone[0])
    assert float(loss) == float(alone[1])


def test_a_length_or_batch_the_mesh_does_not_divide_is_one_error_naming_the_axis(ckpt):
    """21 positions on 2 context shards raised jax's IndivisibleError (or, under value_and_grad, shard_map's) from the
    first constraint (an audit)."""
    layout = build_mesh(MeshConfig(1, 2, 2, 1), devices=jax.devices()[:4])
    model = m3jax.from_pretrained(ckpt, mesh=layout)
    with jax.set_mesh(layout.mesh):
        with pytest.raises(ValueError, match=r"21 positions on mesh axes context of 2 shards: expected a multiple "
                                             r"of 2"):
            model(jnp.zeros((4, 21), jnp.int32))
        with pytest.raises(ValueError, match=r"3 rows on mesh axes expert of 2 shards"):
            model(jnp.zeros((3, 16), jnp.int32))
