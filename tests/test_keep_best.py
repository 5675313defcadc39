"""checkpoint.keep_best: the k best held-out evaluations' checkpoints stay beside the newest, and `--export DIR --step
N` exports one (rl.checkpoint_keep)."""

import json
import os
import subprocess
import sys

import pytest

from m3jax import eval as m3jax_eval
from m3jax import train
from rl.checkpoint_keep import chosen_step, step_argument

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")


@pytest.mark.slow  # ~25 s: 6 steps of the tiny demo, each evaluated
def test_the_best_steps_are_saved_off_schedule_and_kept_and_exported(tmp_path, capsys):
    """With checkpoint.every_steps 0 and keep 1, only step 6 would stay; each step whose evaluation enters the two
    best is saved when it comes, kept through the later saves, and deleted once two better ones came. (A learning
    rate high enough that the held-out reward moves both ways.)"""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    # the evaluation's 64 prompts x 4 samples are a training batch's shape: one generation program for both
    args = [f"run.out_dir={out}", "run.total_steps=6", "eval.every_steps=1", "eval.at_start=false",
            "checkpoint.every_steps=0", "checkpoint.keep=1", "checkpoint.keep_best=2",
            "eval.best_metric=reward_mean", "optim.lr=0.05", "logging.progress_bar=false", "logging.plot=false",
            "logging.tensorboard=false", "checkpoint.export_hf_at_end=false"]
    r = subprocess.run([sys.executable, "-m", "m3jax.train", "--config", CONFIG, *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [(row["step"], row["val/reward_mean"]) for row in map(json.loads, open(out / "metrics.jsonl"))
             if "val/reward_mean" in row]
    assert [s for s, _ in evals] == [1, 2, 3, 4, 5, 6]
    two_best = [s for s, _ in sorted(evals, key=lambda e: (-e[1], e[0]))[:2]]  # the earlier of a tie first
    assert sorted(int(s) for s in os.listdir(out / "checkpoints")) == sorted({*two_best, 6})
    best = two_best[0]
    assert f"(best val/reward_mean {dict(evals)[best]:.3f} at step {best})" in r.stdout
    assert f"; the best evaluations' checkpoints kept: steps {two_best[0]}, {two_best[1]};" in r.stdout

    capsys.readouterr()
    assert train.main(["--config", CONFIG, *args, "--export", str(tmp_path / "best"), "--step", "best"]) == 0
    assert capsys.readouterr().out.strip() == f"exported step {best} to {tmp_path / 'best'}"
    # and scored again: what the run logged at that step, exactly
    assert m3jax_eval.main(["--config", CONFIG, *args, "--step", "best"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"# step {best} of {out}:") and f"val/reward_mean {dict(evals)[best]!r}" in printed
    gone = min(set(range(1, 6)) - set(two_best))
    assert train.main(["--config", CONFIG, *args, "--export", str(tmp_path / "x"), "--step", str(gone)]) == 1
    kept = ", ".join(map(str, sorted({*two_best, 6})))
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: no checkpoint of step {gone} to export in {out / 'checkpoints'} (steps: {kept})")
    assert not (tmp_path / "x").exists()


def test_keep_best_needs_an_evaluation_during_the_run():
    from rl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"checkpoint.keep_best = 2 with eval.every_steps = 0: no evaluation"):
        load_config(CONFIG, ["checkpoint.keep_best=2", "eval.every_steps=0"])
    with pytest.raises(ConfigError, match=r"checkpoint.keep_best"):  # a count now, not a switch
        load_config(CONFIG, ["checkpoint.keep_best=true"])


def test_step_goes_with_export(capsys):
    with pytest.raises(SystemExit):
        train.main(["--config", CONFIG, "--step", "3"])
    assert "--step goes with --export DIR" in capsys.readouterr().err


class _Reader:
    """The checkpoints a reader lists, and the newest one's meta."""
    directory = "/run/checkpoints"

    def __init__(self, steps, meta):
        self._steps, self.meta = steps, meta

    def steps(self):
        return list(self._steps)

    def read_meta(self, step):
        assert step == self._steps[-1]
        return self.meta


def test_step_best_is_the_first_kept_checkpoint_else_the_best_evaluations_where_it_has_one():
    kept = [{"metric": "val/pass@1", "value": 0.9, "step": 40}, {"metric": "val/pass@1", "value": 0.8, "step": 20}]
    best = {"metric": "val/pass@1", "value": 0.95, "step": 0}  # the initial policy: no checkpoint of the run
    assert chosen_step(_Reader([20, 40, 60], {"kept_best": kept, "best": best}), "best") == 40
    assert chosen_step(_Reader([20, 40, 60], {"kept_best": kept}), None) is None  # the newest
    assert chosen_step(_Reader([20, 40, 60], {}), 20) == 20
    # no keep_best, but the best evaluation's step was saved on schedule
    assert chosen_step(_Reader([20, 40, 60], {"best": {**best, "step": 40}}), "best") == 40
    with pytest.raises(FileNotFoundError, match=r"^--step best: the newest checkpoint \(step 60 in /run/checkpoints\) "
                       r"names no checkpoint of the best evaluation: its best evaluation, step 0 \(val/pass@1 0.95\), "
                       r"has no checkpoint; a run with checkpoint.keep_best >= 1"):
        chosen_step(_Reader([20, 40, 60], {"best": best}), "best")
    with pytest.raises(FileNotFoundError, match="the run had evaluated nothing"):
        chosen_step(_Reader([60], {}), "best")
    with pytest.raises(FileNotFoundError, match=r"^--step best: no checkpoint in /run/checkpoints$"):
        chosen_step(_Reader([], {}), "best")
    with pytest.raises(FileNotFoundError, match=r"^no checkpoint of step 30 to export in /run/checkpoints \(steps: "
                       r"20, 40, 60\)$"):
        chosen_step(_Reader([20, 40, 60], {}), 30, " to export")


def test_step_is_a_number_or_best(capsys):
    assert step_argument("best") == "best" and step_argument("12") == 12
    with pytest.raises(SystemExit):
        train.main(["--config", CONFIG, "--export", "/tmp/x", "--step", "last"])
    assert "argument --step: 'last': expected a step number or 'best'" in capsys.readouterr().err
