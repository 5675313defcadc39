"""checkpoint.keep_best: the best held-out evaluation's checkpoint stays beside the newest, and `--export DIR --step N`
exports it (rl.checkpoint_keep)."""

import json
import os
import subprocess
import sys

import pytest

from m3jax import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")


@pytest.mark.slow  # ~20 s: 6 steps of the tiny demo, evaluated every 2
def test_the_best_step_is_saved_off_schedule_and_kept_and_exported(tmp_path, capsys):
    """A learning rate high enough that the held-out reward peaks early (at step 2 here) and falls after: with
    checkpoint.every_steps 0 and keep 1, only step 6 would stay; the best step is saved when its evaluation comes
    and kept through the later saves."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    # the evaluation's 64 prompts x 4 samples are a training batch's shape: one generation program for both
    args = [f"run.out_dir={out}", "run.total_steps=6", "eval.every_steps=2", "eval.at_start=false",
            "checkpoint.every_steps=0", "checkpoint.keep=1", "checkpoint.keep_best=true",
            "eval.best_metric=reward_mean", "optim.lr=0.05", "logging.progress_bar=false", "logging.plot=false",
            "logging.tensorboard=false", "checkpoint.export_hf_at_end=false"]
    r = subprocess.run([sys.executable, "-m", "m3jax.train", "--config", CONFIG, *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [(row["step"], row["val/reward_mean"]) for row in map(json.loads, open(out / "metrics.jsonl"))
             if "val/reward_mean" in row]
    best = max(evals, key=lambda e: (e[1], -e[0]))[0]  # the earliest of the highest
    assert 0 < best < 6, f"the held-out reward should peak before the end here: {evals}"
    assert sorted(int(s) for s in os.listdir(out / "checkpoints")) == [best, 6]
    assert f"(best val/reward_mean {dict(evals)[best]:.3f} at step {best})" in r.stdout

    capsys.readouterr()
    assert train.main(["--config", CONFIG, *args, "--export", str(tmp_path / "best"), "--step", str(best)]) == 0
    assert capsys.readouterr().out.strip() == f"exported step {best} to {tmp_path / 'best'}"
    assert train.main(["--config", CONFIG, *args, "--export", str(tmp_path / "x"), "--step", "3"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: no checkpoint of step 3 to export in {out / 'checkpoints'} (steps: {best}, 6)")
    assert not (tmp_path / "x").exists()


def test_keep_best_needs_an_evaluation_during_the_run():
    from rl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"checkpoint.keep_best = true with eval.every_steps = 0: no evaluation"):
        load_config(CONFIG, ["checkpoint.keep_best=true", "eval.every_steps=0"])


def test_step_goes_with_export(capsys):
    with pytest.raises(SystemExit):
        train.main(["--config", CONFIG, "--step", "3"])
    assert "--step goes with --export DIR" in capsys.readouterr().err
