"""A checkpoint whose meta item is valid JSON but not what a save writes (`{}`, a list, a wrong step) is treated
like an unreadable one: a warning and the previous checkpoint on resume, one error when asked for by number.
It raised KeyError 'data' in the trainer and KeyError 'step' in eval."""

import gc
import json
import logging
import os

import pytest
from flax import nnx

import tests.test_checkpoint as tc
from m3jax import M3ForCausalLM
from rl.checkpoint import Checkpointer, CheckpointsUnreadable

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    shapes = nnx.state(nnx.eval_shape(lambda: M3ForCausalLM(tc.CFG)), nnx.Param)
    return tc.Runs(tmp_path_factory.mktemp("runs"), [tc.make_batch(shapes, seed) for seed in range(3)])["fp32"]


@pytest.fixture(scope="module")
def two_steps(run, tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("two") / "ckpt")
    ck = Checkpointer(d, async_save=False)
    ck.save(2, run.s2, tc.meta_of(2))
    ck.save(4, run.s3, tc.meta_of(4))
    ck.close()
    return d


@pytest.mark.parametrize("meta, says", [
    ({}, "'step' is missing"), ([1, 2], "JSON list"), ({**tc.meta_of(4), "data": None}, "'data' is None"),
    ({**tc.meta_of(4), "step": 9}, "'step' is 9; expected 4"), ({**tc.meta_of(4), "weight_version": "4"}, "'4'"),
])
def test_a_wrong_meta_falls_back_to_the_previous_checkpoint(run, two_steps, tmp_path, caplog, meta, says):
    d = tc.copy_of(two_steps, tmp_path)
    with open(os.path.join(d, "4", "meta", "metadata"), "w") as f:
        json.dump(meta, f)
    with caplog.at_level(logging.WARNING, logger=tc.LOGGER):
        got, restored = tc.restore(d, run.fresh)
    assert restored == tc.meta_of(2)
    tc.assert_bitwise(got, run.s2)
    warned = tc.warnings_of(caplog)
    assert any("step 4" in w and "unreadable" in w and says in w for w in warned), warned
    assert sorted(os.listdir(d)) == ["2", "4.unreadable"]
    os.rename(os.path.join(d, "4.unreadable"), os.path.join(d, "4"))
    ck = Checkpointer(d, read_only=True)  # eval --step 4: one error naming it
    try:
        with pytest.raises(CheckpointsUnreadable, match=f"checkpoint step 4 in {d} is unreadable .*{says}"):
            ck.restore_step(4, run.fresh)
    finally:
        ck.close()
        gc.collect()
