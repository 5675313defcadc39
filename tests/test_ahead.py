"""One step off policy (`grpo.max_trajectory_age_steps: 1`, rl.ahead): the pipeline, its draining, resume."""

import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

from rl.ahead import AheadDraw, draws_ahead


def test_draws_ahead_except_before_checkpoints_evaluations_and_the_end():
    assert draws_ahead(1, 6, 3, False) and draws_ahead(2, 6, 3, False)
    assert not draws_ahead(3, 6, 3, False)  # a checkpoint follows
    assert not draws_ahead(4, 6, 3, True)  # an evaluation follows
    assert not draws_ahead(6, 6, 0, False)  # the last step
    assert draws_ahead(3, 6, 0, False)  # checkpoint.every_steps 0: only at the end


def test_one_draw_in_flight_taken_with_its_version_and_loader_state():
    ahead, started, release = AheadDraw(), threading.Event(), threading.Event()

    def draw():
        started.set()
        release.wait(5)
        return "rollouts"

    try:
        ahead.launch(draw, {"position": 7}, version=3)
        assert started.wait(5) and ahead.pending and ahead.loader_state == {"position": 7}
        with pytest.raises(AssertionError, match="one draw ahead"):
            ahead.launch(draw, {}, version=4)
        threading.Timer(0.2, release.set).start()
        got, version, waited = ahead.take()
        assert (got, version) == ("rollouts", 3) and waited >= 0.1
        assert not ahead.pending and ahead.loader_state is None
    finally:
        ahead.close()


def test_a_failed_draw_raises_where_it_is_taken():
    ahead = AheadDraw()
    try:
        ahead.launch(lambda: 1 / 0, {}, version=0)
        assert ahead.settle() >= 0  # settling does not raise: the step that takes it does
        with pytest.raises(ZeroDivisionError):
            ahead.take()
    finally:
        ahead.close()


def test_close_waits_for_the_draw_in_flight():
    ahead, done = AheadDraw(), []
    ahead.launch(lambda: (time.sleep(0.2), done.append(1)), {}, version=0)
    ahead.close()
    assert done == [1] and not ahead.pending


def _run(tmp_path, name, *overrides):
    from rl.config import load_config
    from rl.trainer import GRPOTrainer
    cfg = load_config("configs/tiny.yaml", [f"run.out_dir={tmp_path / name}", "grpo.prompts_per_step=4",
                                            "grpo.group_size=4", "grpo.micro_batch_size=8", "run.total_steps=6",
                                            "checkpoint.every_steps=3", "checkpoint.async_save=false",
                                            "eval.every_steps=0", "eval.at_start=false", "logging.tensorboard=false",
                                            "logging.progress_bar=false", "logging.plot=false", *overrides])
    GRPOTrainer(cfg).run()
    rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    return [r for r in rows if "reward/mean" in r], tmp_path / name


def _exported(out):
    from safetensors.numpy import load_file
    return load_file(os.path.join(out, "export", "model.safetensors"))


@pytest.mark.slow  # three tiny training runs of 3-6 steps (~1 min on the 2-core CPU)
def test_age_one_overlaps_drains_at_checkpoints_and_resumes_bitwise(tmp_path, monkeypatch):
    on_policy, _ = _run(tmp_path, "age0")
    from rl import score_once
    scoring = 0.15
    slow = score_once.score_specs

    def slow_scoring(*args, **kwargs):  # scoring with a length of its own, to find it in the timings
        time.sleep(scoring)
        return slow(*args, **kwargs)
    monkeypatch.setattr(score_once, "score_specs", slow_scoring)
    rows, straight = _run(tmp_path, "age1", "grpo.max_trajectory_age_steps=1")
    monkeypatch.undo()
    # step 1 and the step after the checkpoint at 3 are drawn on their own weights; the others one step old
    assert [r["rollout/age_steps"] for r in rows] == [0, 1, 1, 0, 1, 1]
    assert all("time/wait_rollout" in r for r in rows) and "rollout/age_steps" not in on_policy[0]
    # a draw made ahead reports its scoring (it showed nowhere: an audit); a step's own draw is waited on whole
    assert all(r["time/reward_ahead"] >= scoring for r in rows if r["rollout/age_steps"])
    assert all(r["time/wait_rollout"] >= r["time/generate"] + scoring for r in rows if not r["rollout/age_steps"])
    # the same prompts and the same first step; later steps sample with older weights
    assert rows[0]["reward/mean"] == on_policy[0]["reward/mean"]
    assert [r["reward/mean"] for r in rows[1:]] != [r["reward/mean"] for r in on_policy[1:]]
    # stopped after the checkpoint at 3 (the run's directory as it was then: a run of its own to 3 steps cost a
    # trainer build and compile), then resumed to 6: bitwise the uninterrupted run
    shutil.copytree(straight, tmp_path / "resumed")
    for done in ("checkpoints/6", "export"):
        shutil.rmtree(tmp_path / "resumed" / done)
    resumed_rows, resumed = _run(tmp_path, "resumed", "grpo.max_trajectory_age_steps=1")
    # the rows past the checkpoint are the resumed run's: it draws step 4 on its own weights, as the first run did
    assert [r["step"] for r in resumed_rows] == [1, 2, 3, 4, 5, 6]
    assert [r["rollout/age_steps"] for r in resumed_rows] == [0, 1, 1, 0, 1, 1]
    want, got = _exported(straight), _exported(resumed)
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8), err_msg=name)
