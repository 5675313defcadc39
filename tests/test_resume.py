"""kill -9 at random points (including during an async save), rerun the same command: the finished run's
final params are bitwise those of an uninterrupted run with the same seed. Also with DAPO dynamic
sampling, whose refill rounds move the data position by a variable number of batches per step."""

import glob
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8


def command(out_dir, extra=()):
    return [sys.executable, "-m", "m3jax.train", "--config", "configs/tiny.yaml", f"run.out_dir={out_dir}",
            f"run.total_steps={STEPS}", "checkpoint.every_steps=2", "checkpoint.async_save=true",
            "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false", *extra]


def env():
    e = {**os.environ, "PYTHONPATH": ROOT}
    e.pop("XLA_FLAGS", None)
    return e


def run_to_end(out_dir, extra=()):
    r = subprocess.run(command(out_dir, extra), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def logged_steps(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def run_and_kill(out_dir, when, extra=()):
    """Start the run and SIGKILL it as soon as `when(out_dir)` holds (or it ends by itself)."""
    p = subprocess.Popen(command(out_dir, extra), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while p.poll() is None and time.time() < deadline:
        if when(out_dir):
            p.send_signal(signal.SIGKILL)
            p.wait()
            return True
        time.sleep(0.005)
    return False


def exported(out_dir):
    return load_file(os.path.join(out_dir, "export", "model.safetensors"))


@pytest.mark.slow
def test_killed_runs_resume_bitwise(tmp_path):
    """(Dynamic sampling's multi-round draws resume from the same loader state too: tests/test_dapo.py
    replays that fast; a second end-to-end case cost ~2-4 min of the suite.)"""
    extra = ()
    straight = str(tmp_path / "straight")
    run_to_end(straight, extra)

    killed = str(tmp_path / "killed")
    saving = lambda d: bool(glob.glob(os.path.join(d, "checkpoints", "*.orbax-checkpoint-tmp*")))  # noqa: E731
    kills = [run_and_kill(killed, lambda d: logged_steps(d) >= 1, extra),  # mid-run, before any checkpoint
             run_and_kill(killed, saving, extra),  # during an async save
             run_and_kill(killed, lambda d: logged_steps(d) >= 6, extra)]  # later, after resuming twice
    assert sum(kills) >= 2, "the run finished before it could be killed"
    run_to_end(killed, extra)

    want, got = exported(straight), exported(killed)
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8), err_msg=name)
