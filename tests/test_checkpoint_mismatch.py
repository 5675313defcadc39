"""A run's checkpoint resumed under a changed config: refused by name, never skipped.

A checkpoint that reads but holds another state (a changed model or optimizer config) used to count as
unreadable: the resume fell back to older steps, found none of the right shape, and started from step 0 in
the same directory, saving the new run's steps beside the old run's. `rl.checkpoint` now compares the saved
state's tree and shapes (orbax metadata, no array read) with the run's and raises CheckpointMismatch naming
the first difference, before anything is moved or restored.
"""

import dataclasses
import os

import jax
import pytest
from flax import nnx

from m3jax import M3ForCausalLM
from rl.checkpoint import Checkpointer, CheckpointMismatch
from sharding import optim_step
from sharding.train_step import init_state
from tests.test_checkpoint import CFG, meta_of


def fresh_state(cfg, weight_decay=0.1):
    opt = optim_step.adamw(1e-3, weight_decay=weight_decay, master="none")
    return jax.device_put(init_state(M3ForCausalLM(cfg, rngs=nnx.Rngs(0)), opt)[1], jax.devices()[0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("run") / "checkpoints")
    state = fresh_state(CFG)
    ck = Checkpointer(d)
    ck.save(1, state, meta_of(1))
    ck.close()
    return d, state


def listing(d):
    return sorted(os.listdir(d))


def test_same_config_resumes(saved):
    d, state = saved
    ck = Checkpointer(d)
    try:
        got, meta = ck.restore_latest(fresh_state(CFG))
    finally:
        ck.close()
    assert meta == meta_of(1) and int(got.step) == int(state.step)


@pytest.mark.parametrize("method", ["restore_latest", "restore_step"])
def test_another_model_shape_is_refused_by_name(saved, method):
    d, _ = saved
    before = listing(d)
    ck = Checkpointer(d)
    like = fresh_state(dataclasses.replace(CFG, intermediate_size=16))
    try:
        with pytest.raises(CheckpointMismatch) as err:
            ck.restore_latest(like) if method == "restore_latest" else ck.restore_step(1, like)
    finally:
        ck.close()
    msg = str(err.value)
    assert msg.startswith(f"checkpoint step 1 in {d} holds another state than this run's config builds: ")
    assert "experts_down/value is (1, 8, 64, 32) there, (1, 8, 64, 16) in this run's state" in msg, msg
    assert "resume with that config, or start this one in another run.out_dir" in msg
    assert listing(d) == before  # nothing set aside


def test_another_optimizer_state_is_refused(saved):
    """No weight decay drops a state of the optimizer chain: a tree that differs, not only a shape."""
    d, _ = saved
    ck = Checkpointer(d)
    try:
        with pytest.raises(CheckpointMismatch, match="holds another state than this run's config builds: it "):
            ck.restore_latest(fresh_state(CFG, weight_decay=None))
    finally:
        ck.close()
