"""A diverged run (every update skipped for a non-finite gradient) stops with an error instead of training on to
"done" with weights that no longer change (rl.skipped_updates, optim.stop_after_skipped_steps)."""

import json
import logging
import os
import subprocess
import sys

import pytest

from rl.skipped_updates import SkippedUpdates, UpdatesSkipped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_steps_with_skipped_updates_are_warned_of_and_a_row_of_them_stops_the_run(caplog):
    watch = SkippedUpdates(3, updates_per_step=2)
    with caplog.at_level(logging.WARNING, logger="rl.trainer"):
        watch.after(1, 0, 0.1, 1.0)
        watch.after(2, 2, float("nan"), float("nan"))
        watch.after(3, 1, 0.2, 3.0)  # one of two skipped: the weights changed, the row starts again
        watch.after(4, 2, float("nan"), float("nan"))
        watch.after(5, 2, float("nan"), float("nan"))
        with pytest.raises(UpdatesSkipped) as e:
            watch.after(6, 2, float("nan"), float("nan"))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["step 2", "step 3", "step 4", "step 5", "step 6"]
    assert caplog.records[1].getMessage() == ("step 3: 1 of 2 update(s) skipped, the gradient not finite (loss 0.2, "
                                              "gradient norm 3): the weights did not change")
    assert caplog.records[-1].getMessage().endswith("(3 steps in a row)")
    assert str(e.value).startswith("the updates of steps 4 to 6 were all skipped, their gradients not finite "
                                   "(optim.stop_after_skipped_steps = 3): the run has diverged (or every batch "
                                   "overflows), and its weights have not changed since step 3; the run stops.")


def test_no_limit_only_warns():
    watch = SkippedUpdates(0, updates_per_step=1)
    for step in range(1, 50):
        watch.after(step, 1, float("nan"), float("nan"))
    assert watch.in_a_row == 49


@pytest.mark.slow  # ~25 s: the tiny trainer, diverging at its second step, stopped and resumed
def test_a_diverged_run_stops_with_one_error_line_also_across_a_resume(tmp_path):
    """A learning rate of 1e30: step 1's update leaves weights whose forward overflows, and every update after it is
    skipped. The run used to print `done: 12 steps` with a loss of nan from step 2 on. Stopped after step 3 and
    resumed, it stops at step 4 as a run without the break does (the count of skipped steps in a row was not in the
    checkpoint, so a resume began it again: a helper's audit)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "run"

    def train(steps):
        return subprocess.run([sys.executable, "-m", "m3jax.train", "--config", "configs/tiny.yaml",
                               f"run.out_dir={out}", f"run.total_steps={steps}", "optim.lr=1e30",
                               "optim.stop_after_skipped_steps=3", "eval.at_start=false", "eval.every_steps=0"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    first = train(3)  # steps 2 and 3 skipped: under the limit
    assert first.returncode == 0, first.stderr[-3000:]
    r = train(12)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: the updates of steps 2 to 4 were all skipped"), \
        r.stderr[-3000:]
    assert "done:" not in r.stdout
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["skipped_updates"] for row in rows] == [0, 1, 1]  # step 4 stopped the run before its row
