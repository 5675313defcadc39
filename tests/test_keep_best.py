"""checkpoint.keep_best: the k best held-out evaluations' checkpoints stay beside the newest, and `--export DIR --step
N` exports one (rl.checkpoint_keep)."""

import json
import os
import subprocess
import sys

import pytest

from m3jax import train

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
    assert train.main(["--config", CONFIG, *args, "--export", str(tmp_path / "best"), "--step", str(best)]) == 0
    assert capsys.readouterr().out.strip() == f"exported step {best} to {tmp_path / 'best'}"
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
