"""ProRL's reference reset (`grpo.reference_reset_every_steps`): the KL reference becomes the policy every N steps,
Adam restarts (`grpo.reference_reset_optimizer`), and a resumed run gets the reset reference back from its checkpoint."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sharding.precision import ScaleByAdamState, restart_adam


def test_restart_adam_zeroes_the_moments_and_count_and_keeps_the_schedule_and_placement():
    from jax.sharding import NamedSharding, PartitionSpec as P

    from sharding.optim_step import adamw
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("d"))), "b": jnp.ones(3)}
    opt = adamw(optax.linear_schedule(1.0, 0.0, 10), master="none")
    state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    for _ in range(2):
        _, state = opt.update(grads, state, params)
    fresh = restart_adam(state.inner)
    adams = [s for s in jax.tree.leaves(fresh, is_leaf=lambda s: isinstance(s, ScaleByAdamState))
             if isinstance(s, ScaleByAdamState)]
    assert len(adams) == 1 and int(adams[0].count) == 0
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves((adams[0].mu, adams[0].nu)))
    assert adams[0].mu["w"].sharding == params["w"].sharding
    counts = [int(x) for x in jax.tree.leaves(fresh) if x.ndim == 0 and x.dtype == jnp.int32]
    assert sorted(counts) == [0, 2]  # Adam's restarted, the schedule's goes on


@pytest.mark.parametrize("memory", ["device", "host"])
def test_a_mixing_reset_moves_the_reference_part_way(memory):
    from rl.reference import ReferenceWeights
    start = {"w": jnp.asarray([0.0, 1.0, -2.0]), "h": jnp.asarray([1.0, 3.0], jnp.bfloat16)}
    policy = {"w": jnp.asarray([1.0, 1.0, 2.0]), "h": jnp.asarray([2.0, 0.0], jnp.bfloat16)}
    ref = ReferenceWeights(start, memory)
    ref.reset(policy, mix=0.25)  # 0.25 x policy + 0.75 x reference
    got = ref.for_pass()
    np.testing.assert_array_equal(np.asarray(got["w"]), [0.25, 1.0, -1.0])
    assert got["h"].dtype == jnp.bfloat16 and np.asarray(got["h"], np.float32).tolist() == [1.25, 2.25]
    np.testing.assert_array_equal(np.asarray(policy["w"]), [1.0, 1.0, 2.0])  # the policy is untouched
    ref.reset(policy)  # mix 1: the policy itself
    np.testing.assert_array_equal(np.asarray(ref.for_pass()["w"]), [1.0, 1.0, 2.0])


def _cfg(tmp_path, name, *overrides):
    from rl.config import load_config
    return load_config("configs/tiny.yaml", [f"run.out_dir={tmp_path / name}", "grpo.prompts_per_step=4",
                                             "grpo.group_size=4", "grpo.micro_batch_size=8", "grpo.kl=k3",
                                             "grpo.kl_coef=0.05", "grpo.reference_reset_every_steps=2",
                                             "checkpoint.every_steps=1", "checkpoint.async_save=false",
                                             "eval.every_steps=0", "eval.at_start=false",
                                             "logging.tensorboard=false", "logging.progress_bar=false",
                                             "logging.plot=false", *overrides])


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # four tiny trainers of 3-4 steps (~20 s)
def test_the_reference_resets_to_the_policy_and_a_resume_restores_it(tmp_path):
    from rl.trainer import GRPOTrainer
    # the uninterrupted run, step by step, saved after step 3 as run() saves: the resume below continues that
    # checkpoint (a trainer of its own to save it cost a build and a compile of every program, ~3 s each)
    trainer = GRPOTrainer(_cfg(tmp_path, "run", "run.total_steps=4"))
    try:
        start = jax.tree.map(np.asarray, trainer.reference.held)
        m1 = trainer.step(0)
        _same(trainer.reference.held, start)  # step 1: no reset yet
        m2 = trainer.step(1)
        _same(trainer.reference.held, trainer.state.params)  # step 2: the reference is the policy
        adam = [s for s in jax.tree.leaves(trainer.state.opt_state.inner,
                                           is_leaf=lambda s: isinstance(s, ScaleByAdamState))
                if isinstance(s, ScaleByAdamState)][0]
        assert int(adam.count) == 0
        m3 = trainer.step(2)
        trainer.save(3, row=m3)
        m4 = trainer.step(3)
    finally:
        trainer.engine.shutdown()
    assert [m["reference/age_steps"] for m in (m1, m2, m3)] == [1.0, 0.0, 1.0]
    assert m3["kl"] < m2["kl"]  # one update from the reference instead of two
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "3" / "reference")

    def last_row(name):
        return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl") if "loss" in line][-1]

    resumed = GRPOTrainer(_cfg(tmp_path, "run", "run.total_steps=4"))
    resume, restored = resumed.resume, []

    def resume_and_record():  # what run()'s own resume restored, before its step resets the reference again
        step = resume()
        restored.append((step, resumed.reference_step))
        return step

    resumed.resume = resume_and_record
    resumed.run()
    assert restored == [(3, 2)]
    got = last_row("run")
    assert got["step"] == 4
    for k in ("loss", "kl", "grad_norm", "reward/mean", "reference/age_steps"):
        assert got[k] == float(m4[k]), k
    # the reference in the devices' pinned host memory: saved from there, restored into it, the same run
    GRPOTrainer(_cfg(tmp_path, "host", "run.total_steps=3", "grpo.reference_memory=host")).run()
    GRPOTrainer(_cfg(tmp_path, "host", "run.total_steps=4", "grpo.reference_memory=host")).run()
    got = last_row("host")
    for k in ("loss", "kl", "grad_norm", "reward/mean"):
        assert got[k] == float(m4[k]), k


def test_the_config_refuses_a_reset_without_a_kl():
    from rl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="grpo.reference_reset_every_steps.*no KL reference"):
        load_config("configs/tiny.yaml", ["grpo.reference_reset_every_steps=10"])
