"""The MoE drop counts (`routed_experts(return_counts=True)`, `M3ForCausalLM.moe_assignment_counts`) and the
trainer's moe/dropped_frac: what the capacity factor's receive buffers really dropped, on every exchange."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding.expert import routed_experts
from sharding.layout import Layout
from sharding.mesh import MeshConfig, build_mesh
from tests.test_expert_parallel import CFG, E, K
from tests.tiny_runs import first_step, tiny_trainer, two_steps


def _counted(layout, exchange, capacity_factor, ids, valid):
    """(per-token kept assignments read off the output, [kept, real] the layer reports). The experts answer every
    row with ones (summed over the width shards) and every router weight is 1, so a token's output is the number
    of its assignments an expert ran: an oracle through the exchange itself, not a second copy of its rule."""
    b, s, _ = ids.shape
    x = jnp.concatenate([ids.astype(jnp.float32), jnp.zeros((b, s, 6), jnp.float32)], -1)  # d = 8; ids in x

    def route_fn(t, *router):
        return jnp.ones((t.shape[0], K), jnp.float32), t[:, :K].astype(jnp.int32)

    def expert_fn(rows, sizes, gate_up, down, *, expected_rows):  # a width shard's part of the sum (tensor axis)
        return jnp.full_like(rows, gate_up.shape[2] / 4)

    gate_up, down = jnp.zeros((E, 2, 4, 8)), jnp.zeros((E, 8, 4))
    fn = jax.jit(lambda x, v: routed_experts(x, route_fn, (), expert_fn, gate_up, down, layout=layout,
                                             capacity_factor=capacity_factor, exchange=exchange, token_valid=v,
                                             return_counts=True))
    out, counts = fn(x, valid)
    return np.asarray(out)[..., 0], np.asarray(counts)


LAYOUTS = {"one device": (None, "padded"), "ep8 padded": ((1, 1, 8, 1), "padded"),
           "data2 ep2 tp2 padded": ((2, 1, 2, 2), "padded"), "ep4 ragged": ((1, 1, 4, 1), "ragged_emulated"),
           "data2 context2 ep2 ragged": ((2, 2, 2, 1), "ragged_emulated")}


@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0, 1.5])
@pytest.mark.parametrize("where", list(LAYOUTS))
def test_the_counts_are_the_assignments_the_experts_ran(where, capacity_factor):
    """kept = the (token, expert) assignments whose expert output reached their token, real = those of the real
    tokens, on one device and expert-parallel (padded blocks per source, one ragged pool), tokens also split
    over data and context and copied over tensor (each counted once), with padding and a hot expert."""
    shape, exchange = LAYOUTS[where]
    layout = Layout() if shape is None else build_mesh(MeshConfig(*shape), CFG, devices=jax.devices()[:np.prod(shape)])
    rng = np.random.default_rng(0)
    ids = rng.choice(E, size=(8, 16, K), p=[0.3] + [0.1] * 7)  # expert 0 hot
    ids[..., 1] = (ids[..., 0] + 1 + rng.integers(0, E - 1, (8, 16))) % E  # two distinct experts per token
    valid = np.ones((8, 16), bool)
    valid[1, 10:] = valid[6, 3:] = False  # padding
    per_token, (kept, real) = _counted(layout, exchange, capacity_factor, jnp.asarray(ids), jnp.asarray(valid))
    assert real == (valid.sum() if capacity_factor is not None else valid.size) * K
    assert kept == per_token.sum()
    assert per_token[~valid].sum() == 0 or capacity_factor is None  # padding takes no slot under a capacity
    if capacity_factor is None or capacity_factor >= 1.5 and where == "one device":
        assert kept == real
    if capacity_factor == 0.5:
        assert 0 < kept < real


def test_the_model_counts_each_moe_layer_and_a_decode_step_is_refused():
    """moe_assignment_counts: per MoE layer of the tiny model, real = the real tokens x k; dropless keeps them
    all, a tight capacity drops some; the counts come from one forward (no logits)."""
    from m3jax import tiny
    cfg = tiny.m3_config()  # a dense layer, then MoE layers in two stacks (full and sparse attention)
    ids = jnp.asarray(tiny.random_ids(cfg, 2, 24))
    mask = jnp.asarray(np.arange(24)[None, :] < np.array([[24], [17]]))
    for cf in (None, 0.25):
        model = tiny.m3_model(cfg, moe_capacity_factor=cf)
        counts = np.asarray(model.moe_assignment_counts(ids, attention_mask=mask))
        n_moe = model.num_moe_layers
        assert counts.shape == (n_moe, 2) and n_moe > 0
        real = (24 * 2 if cf is None else 24 + 17) * cfg.num_experts_per_tok
        assert (counts[:, 1] == real).all()
        assert (counts[:, 0] == real).all() if cf is None else (counts[:, 0] < real).all()
    with pytest.raises(ValueError, match="return_moe_counts needs the whole sequence"):
        model(ids[:, :1], cache=model.init_cache(2, 8), return_moe_counts=True)


@pytest.mark.slow  # ~15 s: three tiny trainers, four steps in all
def test_the_trainer_logs_the_share_dropped_every_n_steps(tmp_path):
    """logging.moe_drops_every: moe/dropped_frac and one curve per MoE layer at steps 1, 1 + N, ... (not step 2
    with N = 2); a capacity of 0.25 drops most assignments, none dropless."""
    tight, second = two_steps(tiny_trainer(tmp_path, "tight", "model.moe_capacity_factor=0.25",
                                           "logging.moe_drops_every=2"))
    assert not any(k.startswith("moe/") and "route" not in k for k in second) and "time/moe_drops" not in second
    layers = sorted(k for k in tight if k.startswith("moe/dropped_frac/layer_"))
    assert layers and 0.5 < tight["moe/dropped_frac"] < 1
    assert all(0 < tight[k] < 1 for k in layers)
    dropless = first_step(tmp_path, "dropless", "logging.moe_drops_every=1")
    assert dropless["moe/dropped_frac"] == 0 and "moe/dropped_frac" not in first_step(tmp_path, "off")


def test_the_drops_have_a_panel_of_their_own_when_logged():
    from rl.observe import DROPS_PANEL, panels
    rows = [{"step": 1, "moe/dropped_frac": 0.2, "moe/dropped_frac/layer_10": 0.1, "moe/dropped_frac/layer_2": 0.3}]
    assert panels(rows)[DROPS_PANEL] == ("moe/dropped_frac", "moe/dropped_frac/layer_2", "moe/dropped_frac/layer_10")
    assert DROPS_PANEL not in panels([{"step": 1, "indexer/recall": 0.9}])


def test_the_share_is_over_all_layers_and_counts_replayed_routes_only_under_replay():
    """phases.moe_drops: 1 - kept / real per layer and over the layers' sums; the sample is the first micro-batch,
    with the generator's routes when the update replays them (its drops are those routes'), else without."""
    import types
    from rl import phases
    seen = []

    def counts_pass(params, rest, sample):
        seen.append({k: v.shape for k, v in sample.items()})
        return np.array([[3, 4], [4, 4]], np.int32)

    micro = {"input_ids": np.zeros((2, 1, 4), np.int32), "attention_mask": np.ones((2, 1, 4), np.int32),
             "routes": np.zeros((2, 1, 4, 2, 2), np.int32)}
    state = types.SimpleNamespace(params=None, rest=None)
    got = phases.moe_drops(counts_pass, state, micro, replay=True)
    assert got == {"moe/dropped_frac": 0.125, "moe/dropped_frac/layer_0": 0.25, "moe/dropped_frac/layer_1": 0.0}
    assert phases.moe_drops(counts_pass, state, micro, replay=False) == got
    assert seen == [{"input_ids": (1, 4), "attention_mask": (1, 4), "routes": (1, 4, 2, 2)},
                    {"input_ids": (1, 4), "attention_mask": (1, 4)}]
