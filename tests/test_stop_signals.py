"""SIGTERM / SIGINT during a run save the step it is on and stop it (rl.stop_signals); the wall limit on a step that
is saved anyway stops the run once saved."""

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from rl.stop_signals import StopSignals
from tests.test_resume import ROOT, command, env, logged_steps


def test_a_signal_is_recorded_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as s:
        assert s.agree(False, False) == (False, False, False, False)
        os.kill(os.getpid(), signal.SIGTERM)  # handled between bytecodes: the process lives on
        time.sleep(0.01)
        assert s.name == "SIGTERM" and s.agree(False, False) == (True, True, False, True)  # a stop saves its step
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM changes nothing
        time.sleep(0.01)
        with pytest.raises(KeyboardInterrupt):  # a Ctrl-C after a signal: stop at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGTERM) is before
    with StopSignals() as s:
        assert s.agree(True, False) == (True, True, False, False)
        assert s.agree(False, True) == (False, True, False, False)
        assert s.name is None


def test_slurms_warning_before_the_time_limit_stops_the_run_as_sigterm_does():
    """SIGUSR1 (`#SBATCH --signal=USR1@600`) ended the process at once (Python's default), losing every unsaved
    step."""
    from m3jax.train import _signal_number
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as s:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert s.name == "SIGUSR1" and s.agree(False, False) == (True, True, False, True)
    assert signal.getsignal(signal.SIGUSR1) is before
    assert 128 + _signal_number("SIGUSR1") == 138  # the run's exit status


def test_every_process_names_the_same_cause_of_a_stop(monkeypatch):
    """The wall limit crossed on process 0's clock only: process 1 reported "a stop on another process" and exited
    143 beside process 0's 0; the agreement now says whether any process was signalled."""
    from jax.experimental import multihost_utils
    others = {"wall": [1, 0, 0, 0], "signal": [1, 1, 0, 1]}
    for what, theirs in others.items():
        monkeypatch.setattr(multihost_utils, "process_allgather", lambda mine: np.stack([np.asarray(theirs), mine]))
        with StopSignals() as s:
            got = s.agree(False, False, process_count=2)
        assert got == (True, True, False, what == "signal"), what


def checkpoints(out_dir):
    d = os.path.join(out_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


@pytest.mark.slow
def test_sigterm_saves_the_step_and_stops_then_the_rerun_resumes(tmp_path):
    out = str(tmp_path / "run")
    extra = ["checkpoint.every_steps=0", "checkpoint.export_hf_at_end=true"]  # only the last step saves by itself
    p = subprocess.Popen(command(out, extra), cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.time() + 600
    while p.poll() is None and logged_steps(out) < 1 and time.time() < deadline:
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=600)
    steps = max(json.loads(x)["step"] for x in open(os.path.join(out, "metrics.jsonl")))  # row 0: the first eval
    assert p.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert f"stopped by SIGTERM after step {steps} of 8, saved" in stdout, stdout
    assert 1 <= steps < 8 and checkpoints(out) == [steps] and not os.path.exists(os.path.join(out, "export"))
    assert "Traceback" not in stderr
    r = subprocess.run(command(out, extra), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "done: 8 steps" in r.stdout, r.stderr[-3000:]
    rows = [json.loads(x)["step"] for x in open(os.path.join(out, "metrics.jsonl"))]
    assert rows == list(range(0, 9)) and os.path.exists(os.path.join(out, "export"))


@pytest.mark.slow
def test_the_wall_limit_on_a_saved_step_stops_once_saved(tmp_path):
    """Before, the step was saved twice: the second save raised and the run ended as if its save had failed."""
    out = str(tmp_path / "run")
    r = subprocess.run(command(out, ["checkpoint.every_steps=1", "run.max_wall_minutes=0.0001"]), cwd=ROOT,
                       env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stopped by run.max_wall_minutes after step 1 of 8, saved" in r.stdout, r.stdout
    assert checkpoints(out) == [1] and "error" not in r.stderr


@pytest.mark.slow  # two tiny runs (~25 s); the fast loop's signal checks are the two above
def test_a_signal_during_the_last_saves_wait_stops_once_it_is_saved(tmp_path, monkeypatch):
    """The handlers were put back before the run's end waited for its last (async) save: a SIGTERM there ended the
    process with the save in flight, the step lost. Now the save completes, the run stops as by that signal, and the
    export is left to the rerun (which resumes at the last step and exports)."""
    from rl import checkpoint
    from tests.tiny_runs import tiny_trainer
    wait = checkpoint.Checkpointer.wait

    def preempted_in_the_wait(self, quiet=False):
        if quiet:  # the run's end
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        return wait(self, quiet)

    monkeypatch.setattr(checkpoint.Checkpointer, "wait", preempted_in_the_wait)
    before = signal.getsignal(signal.SIGTERM)
    trainer = tiny_trainer(tmp_path, "run", "run.total_steps=2", "checkpoint.async_save=true",
                           "checkpoint.every_steps=1", "checkpoint.export_hf_at_end=true", "eval.at_start=false",
                           "eval.every_steps=0", "logging.progress_bar=false", "logging.plot=false")
    trainer.run()
    out = str(tmp_path / "run")
    assert trainer.stopped_by == "SIGTERM" and trainer.last_step == 2
    assert checkpoints(out) == [1, 2] and sorted(os.listdir(os.path.join(out, "checkpoints", "2")))
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if "tmp" in n]
    assert not os.path.exists(os.path.join(out, "export")) and signal.getsignal(signal.SIGTERM) is before
    monkeypatch.undo()
    rerun = tiny_trainer(tmp_path, "run", "run.total_steps=2", "checkpoint.async_save=true",
                         "checkpoint.every_steps=1", "checkpoint.export_hf_at_end=true", "eval.at_start=false",
                         "eval.every_steps=0", "logging.progress_bar=false", "logging.plot=false")
    rerun.run()
    assert rerun.resumed_from == 2 and rerun.stopped_by is None and os.path.exists(os.path.join(out, "export"))
