"""The planner follows the model on short sequences: over at most index_topk_blocks * index_block_size keys the
model runs its sparse layers as full layers and never the indexer (`m3jax.model.attention.sees_every_block`), so
the plan executes them as a model of full layers would, while the model FLOPs (what the maths needs) stay put."""

import dataclasses

import pytest

from m3jax.config import FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION
from m3jax.plan.activations import layer_phases
from m3jax.plan.flops import step_flops
from m3jax.plan.memory import Batch, _shard_dims
from m3jax.plan.remat import small_config
from sharding.mesh import MeshConfig

CFG = small_config(2)
SPAN = CFG.index_topk_blocks * CFG.index_block_size
FULL = dataclasses.replace(CFG, layer_types=(FULL_ATTENTION,) * CFG.num_hidden_layers)


@pytest.mark.parametrize("attention, sparse_attention", [("dense", "gather"), ("flash", "gather"), ("dense", "masked")])
def test_short_sequences_execute_as_full_layers(attention, sparse_attention):
    kw = dict(attention=attention, sparse_attention=sparse_attention, remat=True)
    short, full = step_flops(CFG, 4, SPAN, **kw), step_flops(FULL, 4, SPAN, **kw)
    assert short["executed_total"] == full["executed_total"] < step_flops(CFG, 4, SPAN + 1, **kw)["executed_total"]
    assert short["indexer_executed"] == short["indexer_proj_executed"] == 0
    assert short["model_total"] > full["model_total"]  # the sparse model's maths still counts its indexer
    longer = step_flops(CFG, 4, SPAN + CFG.index_block_size, **kw)
    assert longer["indexer_executed"] > 0 and longer["indexer_proj_executed"] > 0


def test_short_sequences_hold_a_full_layers_attention_memory():
    mesh = MeshConfig()
    dims = _shard_dims(mesh, None)

    def attention_phase(cfg, attn, seq):
        batch = Batch(micro_batch=1, seq_len=seq, num_micro=1)
        terms = layer_phases(cfg, mesh, attn, MOE_MLP, batch, 4, batch.exchange, dims)["attention"]
        return {k: v for k, v in terms.items() if k != "gathered_weights"}  # the indexer's weights stay

    assert attention_phase(CFG, SPARSE_ATTENTION, SPAN) == attention_phase(CFG, FULL_ATTENTION, SPAN)
    assert attention_phase(CFG, SPARSE_ATTENTION, 2 * SPAN) != attention_phase(CFG, FULL_ATTENTION, 2 * SPAN)
