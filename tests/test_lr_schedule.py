"""The learning-rate schedule is in steps (rl.policy.learning_rate); the optimizer counts updates, several per step
with grpo.updates_per_step, and skips none of the schedule for them."""

import jax
import numpy as np
import pytest

from rl.config import load_config
from rl.policy import learning_rate, update_learning_rate
from tests.tiny_runs import TINY, tiny_trainer


def test_the_optimizer_schedule_counts_updates_per_step():
    cfg = load_config(str(TINY), ["grpo.updates_per_step=4", "grpo.micro_batch_size=64", "optim.schedule=cosine",
                                  "optim.warmup_steps=3", "run.total_steps=10"])
    steps, updates = learning_rate(cfg), update_learning_rate(cfg)
    for count in range(40):
        assert float(updates(count)) == float(steps(count // 4)), count
    assert float(updates(39)) > 0  # the last step's updates, where the old count had long reached 0


@pytest.mark.slow
def test_the_second_of_two_steps_trains_with_two_updates_each(tmp_path):
    """updates_per_step 2, linear decay to 0 at step 2: step 2 trains at half the lr (before, its updates counted
    as steps 3 and 4, at lr 0, and left the weights as they were while the log said otherwise)."""
    trainer = tiny_trainer(tmp_path, "u2", "grpo.updates_per_step=2", "optim.schedule=linear", "run.total_steps=2",
                           "optim.warmup_steps=0", "optim.lr=1e-3")
    try:
        lrs, params = [], []
        for step in range(2):
            lrs.append(trainer.step(step)["lr"])
            params.append([np.asarray(x, np.float32) for x in jax.tree.leaves(trainer.state.params)])
    finally:
        trainer.engine.shutdown()
    assert lrs == pytest.approx([1e-3, 5e-4])
    moved = max(float(np.abs(a - b).max()) for a, b in zip(*params))
    assert moved > 0, "step 2 left every weight as it was"


def test_the_logged_rate_waits_out_skipped_updates_as_the_schedule_does():
    """Updates skipped for a non-finite gradient leave the schedule's count behind (Megatron's choice too): the
    logged lr is the one the next update applies, not the step number's."""
    import types

    import jax.numpy as jnp

    from rl.policy import applied_learning_rate
    cfg = load_config(str(TINY), ["optim.warmup_steps=4", "run.total_steps=10"])
    state = types.SimpleNamespace(step=jnp.int32(5), skipped=jnp.int32(2))
    assert applied_learning_rate(cfg, state) == pytest.approx(float(learning_rate(cfg)(3)))
    assert applied_learning_rate(cfg, state) < float(learning_rate(cfg)(5))
