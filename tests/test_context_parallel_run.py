"""The trainer on a context-parallel mesh: its rows split into whole indexer blocks per context shard, and a run
equals the one-device run.

Before `rl.policy.training_positions`, every row had max_prompt_tokens + max_new_tokens - 1 positions, which no
context-parallel mesh can split (4095 on the one-node recipe's context 2, 8191 on the 32-node recipe's context
8): any run with mesh.context > 1 stopped at start-up with a MeshError."""

import pytest

from rl.config import load_config
from rl.policy import sequence_width, training_positions
from sharding.mesh import validate
from tests.tiny_runs import TINY, numbers, tiny_trainer, two_steps


@pytest.mark.parametrize("overrides, positions", [
    ([], 12),  # 8 + 5 slots, one position fewer: nothing to split
    (["mesh.data=4", "mesh.context=2", "mesh.expert_axes=[data]"], 16),  # 2 shards x 4-token blocks: 12 -> 16
    (["mesh.data=2", "mesh.context=4", "mesh.expert_axes=[data]"], 16),
    (["mesh.data=1", "mesh.context=8", "mesh.expert_axes=[data]"], 32),
])
def test_positions_round_up_to_whole_blocks_per_context_shard(overrides, positions):
    cfg = load_config(str(TINY), ["grpo.micro_batch_size=1", *overrides])
    m3 = cfg.model.m3_config()
    assert training_positions(cfg, m3) == positions and sequence_width(cfg, m3) == positions + 1
    validate(cfg.mesh.to_mesh_config(), m3, seq_len=positions)  # raises if a shard would cut a block


@pytest.mark.parametrize("recipe, positions", [("m3-1node-h200.yaml", 4096), ("m3-1node-h200-128e.yaml", 4096),
                                               ("m3-32node.yaml", 8192)])
def test_the_recipes_rows_split_over_their_context_shards(recipe, positions):
    from m3jax.plan.job import load_job, load_run_config
    cfg, m3 = load_run_config(f"configs/recipes/{recipe}", [], "release")
    assert training_positions(cfg, m3) == positions
    validate(cfg.mesh.to_mesh_config(), m3, seq_len=positions)
    # the planner plans the prompt + response slots: the trainer's positions, or one more where nothing splits
    assert load_job(f"configs/recipes/{recipe}", [], "release").seq_len == positions + (cfg.mesh.context == 1)


@pytest.mark.slow  # two short trainer runs
def test_a_context_parallel_run_with_cut_micro_batches_trains_like_one_device(tmp_path):
    """data 4 x context 2 against one device, two steps each: the same samples and rewards, the losses and
    gradient norms equal up to the sums' order. Responses of up to 13 tokens (the random model stops at <eos>
    early or late) fill 8 + 13 slots: 20 positions, rounded up to 24 on context 2 x 4-token blocks, and the
    context-parallel run cuts its micro-batches to 8 or 16 of them where the rows fit (grpo.micro_batch_widths).
    Routing and indexer replay are on, so the rollout's routes and block ids (21 positions) are padded too."""
    common = ["grpo.routing_replay=rollout", "grpo.indexer_replay=rollout", "generation.max_new_tokens=13"]
    want = two_steps(tiny_trainer(tmp_path, "one", *common))
    got = two_steps(tiny_trainer(tmp_path, "cp", "mesh.data=4", "mesh.context=2", "mesh.expert_axes=[data]",
                                 "grpo.micro_batch_size=1", "grpo.micro_batch_widths=[8, 16]", *common))
    assert min(g["batch/computed_frac"] for g in got) < 1.0  # some micro-batch ran cut
    for w, g in zip(want, got):
        w, g = numbers(w), numbers(g)
        assert set(w) == set(g)
        for k, v in w.items():
            if k.startswith(("indexer/recall", "batch/")):
                continue  # the recall samples the step's first micro-batch (its rows are the longest now); the
                # batch's fractions are of 20 and 24 positions:
            assert g[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
        assert g["reward/mean"] == w["reward/mean"]
        assert g["batch/real_frac"] * 24 == pytest.approx(w["batch/real_frac"] * 20)
