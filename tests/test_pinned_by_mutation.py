"""Behaviour a mutation audit (session 54) found no test pinned: each mutant changed what a user gets (a learning rate,
an evaluation figure, a reference's memory, a resumed run's prompts, a skipped weight check) and passed every test.
Each test here fails on its mutant (checked by applying it)."""

import math
import types

import jax.numpy as jnp
import numpy as np
import pytest

from tests.tiny_runs import TINY


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_each_schedule_decays_to_zero_at_the_last_step_after_its_warmup(schedule):
    """decay over total_steps - warmup_steps (over total_steps, lr(100) was 1e-4), and each schedule its own curve
    (swapped, both read 5e-4 where the one test looked)."""
    from rl.config import load_config
    from rl.policy import learning_rate
    cfg = load_config(TINY, [f"optim.schedule={schedule}", "optim.warmup_steps=10", "run.total_steps=100",
                             "optim.lr=1e-3"])
    lr = learning_rate(cfg)
    frac = {"linear": lambda x: 1 - x, "cosine": lambda x: 0.5 * (1 + math.cos(math.pi * x))}[schedule]
    for step in (10, 30, 55, 99, 100):
        assert float(lr(step)) == pytest.approx(1e-3 * frac((step - 10) / 90), rel=1e-5, abs=1e-9), step
    assert float(lr(5)) == pytest.approx(5e-4)


def test_maj_at_k_keeps_the_sign_and_takes_an_answer_correct_if_any_sample_of_it_scored_so():
    import rl.evaluate as ev
    assert ev.majority_key("\\boxed{-1/2}", "boxed") != ev.majority_key("\\boxed{1/2}", "boxed")
    keys = [ev.majority_key(t, "boxed") for t in ("\\boxed{-3}", "\\boxed{3}", "\\boxed{3}")]
    assert ev.majority_accuracy(keys, np.array([1, 0, 0], bool), 3) == 0.0  # 3 wins, and 3 is wrong
    # one timed-out scoring of the majority answer does not make it wrong
    assert ev.majority_accuracy(["5", "5"], np.array([1, 0], bool), 2) == 1.0


def test_eval_rollouts_write_each_sample_beside_its_own_prompt():
    """Row i is a sample of prompt i // n (i % n wrote prompt j's text beside prompt 0's answer)."""
    import rl.evaluate as ev
    from rl.config import load_config
    from rl.tasks import make_task
    from tests.test_evaluate import FakeEngine
    cfg = load_config(TINY, ["eval.max_prompts=4", "eval.prompts_per_batch=4"])
    task = make_task("copy", num_digits=4)
    es = ev.build_eval_set(cfg, task.tokenizer, (12,))
    _, rows = ev.evaluate(FakeEngine(4), es, task.tokenizer, samples_of=1)
    by_prompt = {}
    for row in rows:
        by_prompt.setdefault(row["answer"], set()).add(row["prompt"])
    assert len(by_prompt) == 1 and all(len(p) == 1 for p in by_prompt.values())
    (prompt,) = next(iter(by_prompt.values()))
    assert next(iter(by_prompt)) in prompt.replace(" ", "")  # the copy task's answer is its prompt's digits


def test_a_host_memory_reference_stays_in_host_memory_after_a_reset():
    from rl.reference import ReferenceWeights
    ref = ReferenceWeights({"w": jnp.ones(4)}, "host")
    kind = ref.held["w"].sharding.memory_kind
    ref.reset({"w": jnp.zeros(4)})
    assert ref.held["w"].sharding.memory_kind == kind
    ref.reset({"w": jnp.zeros(4)}, mix=0.5)
    assert ref.held["w"].sharding.memory_kind == kind


def test_a_checkpoint_taken_with_a_draw_in_flight_keeps_the_loader_position_before_that_draw():
    """Its prompts are drawn again on resume (the position after it skipped them)."""
    from rl.ahead import AheadDraw
    from rl.trainer import GRPOTrainer
    ahead = AheadDraw()
    ahead.launch(lambda: "step 4's draw", {"position": 3}, 3)
    me = types.SimpleNamespace(ahead=ahead, loader=types.SimpleNamespace(state_dict=lambda: {"position": 4}),
                               cfg=types.SimpleNamespace(run=types.SimpleNamespace(seed=0)), best=None, kept=[],
                               reference_step=0, trained_under={},
                               skipped_updates=types.SimpleNamespace(in_a_row=0))
    try:
        assert GRPOTrainer._meta(me, 3)["data"] == {"position": 3}
    finally:
        ahead.close()


def test_a_weight_check_no_engine_answered_fails():
    from rl.generation.base import SamplingParams
    from rl.weight_sync import ProbeCheck, sync_weights

    class NoAnswer:
        resent_rows = restarts = 0

        def set_weights(self, params, version, rest):
            return types.SimpleNamespace(gb_per_s=1.0, convert_s=0, send_s=0, apply_s=0, senders=1)

        def score(self, prompts, responses, sampling):
            return []

    probe = ProbeCheck([[1, 2]], [[3]], SamplingParams(max_new_tokens=1), lambda p, r: np.zeros((1, 3)), 1e-3)
    with pytest.raises(RuntimeError):
        sync_weights(NoAnswer(), types.SimpleNamespace(params=None, rest=None), 7, probe)


def test_best_falls_back_to_the_next_kept_step_whose_checkpoint_is_there():
    from rl.checkpoint_keep import chosen_step

    class Run:
        directory = "/run/checkpoints"

        def steps(self):
            return [20, 60]  # 40's checkpoint set aside as unreadable

        def read_meta(self, step):
            return {"kept_best": [{"metric": "val/pass@1", "value": 0.9, "step": 40},
                                  {"metric": "val/pass@1", "value": 0.8, "step": 20}]}
    assert chosen_step(Run(), "best") == 20


def test_group_advantages_divide_by_std_plus_eps():
    """A(r) = (r - mean) / (std + eps), std with Bessel's correction: rewards 1e-6 apart are not blown up to +-0.7."""
    from rl.grpo.advantages import batch_normalized_advantages, group_advantages
    r = jnp.asarray([0.0, 1e-6, 0.0, 1e-6])
    std = np.std([0.0, 1e-6], ddof=1)
    np.testing.assert_allclose(np.abs(np.asarray(group_advantages(r, 2))), 5e-7 / (std + 1e-6), rtol=1e-3)
    assert float(jnp.max(jnp.abs(batch_normalized_advantages(r, 2)))) < 0.5


def test_io_tests_compare_lines_without_trailing_spaces():
    from rl.rewards import code
    assert code._lines("a   \nb\t\n") == code._lines("a\nb\n")


# ------------------------------------------------------------------ the planner (a fourth mutation audit)
def _recipe_job():
    from m3jax.plan.job import load_job
    return load_job("configs/recipes/m3-32node.yaml", [], "release")


def test_a_sweep_plans_only_meshes_of_its_device_count(tmp_path, capsys):
    """n % (data * context * expert) let 16-device meshes into a sweep of 24."""
    from m3jax.plan.__main__ import sweep
    from m3jax.plan.flops import Hardware
    for n in (16, 24):  # the recipe fits no 24-device mesh (its 128 experts): the mutant listed 36
        rows, _ = sweep(_recipe_job(), n, Hardware(), 80.0, str(tmp_path / f"{n}.png"))
        assert all(math.prod(r[0]) == n for r in rows) and (rows or n == 24), n


def test_a_mesh_whose_data_and_expert_shards_do_not_divide_an_update_is_invalid():
    import dataclasses
    from m3jax.plan.job import invalid_reason
    job = _recipe_job()
    job = dataclasses.replace(job, mesh=dataclasses.replace(job.mesh, data=2, context=1, expert=4, tensor=1),
                              micro_batch=1, seqs_per_update=6)
    assert invalid_reason(job) is not None


def test_the_bucketed_kernel_plans_its_fp32_accumulators_and_its_dropped_rows():
    from m3jax.config import M3Config
    from m3jax.plan.activations import moe_terms
    from m3jax.plan.flops import expert_rows_factor
    from m3jax.plan.memory import Batch
    from sharding.mesh import MeshConfig
    cfg = M3Config(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=32, dense_intermediate_size=128, shared_intermediate_size=32,
                   num_local_experts=8, num_experts_per_tok=2, layer_types=["full_attention", "minimax_m3_sparse"],
                   mlp_layer_types=["dense", "sparse"], partial_rotary_factor=0.5, index_n_heads=2,
                   index_head_dim=16, index_block_size=8, index_topk_blocks=2)
    mesh = MeshConfig(1, 1, 4, 1)
    tiled = moe_terms(cfg, mesh, 64, 2, None, "ragged", "tiled")["expert_grad_fp32"]
    assert tiled > 0 and moe_terms(cfg, mesh, 64, 2, None, "ragged", "bucketed")["expert_grad_fp32"] == tiled
    b = Batch(1, 256, 1, moe_capacity_factor=0.5, moe_exchange="ragged", ragged_dot="dense", moe_kernel="bucketed",
              platform="gpu")
    assert expert_rows_factor(cfg, MeshConfig(1, 1, 2, 1), b) == 0.5
