"""A step that never finishes is taken as hung (rl.watchdog, run.hang_timeout_minutes): the process exits with one
line and its threads' stacks in the run log, for the job to be restarted."""

import os
import subprocess
import sys
import threading
import time

import pytest

from rl.watchdog import HUNG_STATUS, HangWatchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recorder():
    calls, fired = [], threading.Event()

    def on_hang(what, seconds):
        calls.append((what, seconds))
        fired.set()
    return calls, fired, on_hang


def test_a_step_past_the_limit_is_reported_once_and_one_within_it_never():
    calls, fired, on_hang = recorder()
    dog = HangWatchdog(0.5 / 60, on_hang=on_hang)  # half a second
    try:
        for step in range(1, 6):  # steps of 0.1 s: each re-arms the clock
            dog.arm(f"step {step}")
            time.sleep(0.1)
        dog.disarm()
        time.sleep(0.7)  # disarmed: nothing is watched
        assert calls == []
        dog.arm("step 6")
        assert fired.wait(5)
        time.sleep(0.7)
        assert calls == [("step 6", 0.5)]  # once
    finally:
        dog.close()
    assert not dog._thread.is_alive()


def test_no_limit_watches_nothing():
    dog = HangWatchdog(None, on_hang=lambda *a: pytest.fail("called"))
    dog.arm("step 1")
    dog.close()
    assert dog._thread is None


def run_train(tmp_path, *overrides, worker="hanging_reward_train.py", worker_args=()):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "tests/workers", worker), *worker_args, "--config",
                           os.path.join(ROOT, "configs/tiny.yaml"), f"run.out_dir={tmp_path / 'run'}", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_exit_leaves_one_line_and_the_stacks_in_the_run_log(tmp_path):
    """A process stuck in `stuck_here`: status 124, one line, and the stuck frame in run.log."""
    script = f"""
import threading
from rl import logs
from rl.watchdog import HangWatchdog
logs.setup({str(tmp_path)!r})
def stuck_here():
    threading.Event().wait()
HangWatchdog(0.2 / 60, resume_hint="; rerun it").arm("step 7")
stuck_here()
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == HUNG_STATUS and r.stderr.strip().splitlines() == [
        "error: step 7 has not finished after 0.00333333 min (run.hang_timeout_minutes): taken as hung, the process "
        "exits (status 124); the threads' stacks are in its run log; rerun it"], r.stderr
    text = (tmp_path / "run.log").read_text()
    assert "the threads' stacks when step 7 was taken as hung" in text
    assert "thread MainThread:" in text and "in stuck_here" in text


def test_the_exit_releases_the_run_lock(tmp_path):
    """os._exit runs no atexit handler: `.lock` was left naming this host, and the rerun the error line promises was
    refused on any other node ("cannot be checked from host ...")."""
    script = f"""
import threading
from rl.run_lock import RunLock
from rl.watchdog import HangWatchdog
RunLock({str(tmp_path)!r}).acquire()
HangWatchdog(0.2 / 60).arm("step 7")
threading.Event().wait()
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == HUNG_STATUS, r.stderr
    assert not (tmp_path / ".lock").exists()


@pytest.mark.slow  # ~12 s: the tiny trainer built, then held for the limit
def test_a_run_whose_evaluation_hangs_exits_with_one_error_line(tmp_path):
    """The trainer arms the watchdog: here on the initial evaluation, whose reward never returns."""
    r = run_train(tmp_path, "eval.reward=[{name: hangs}]", "run.hang_timeout_minutes=0.1")
    assert r.returncode == HUNG_STATUS, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the held-out evaluation of the initial policy has not finished after 0.1 min "
                           "(run.hang_timeout_minutes): taken as hung, the process exits (status 124); the threads' "
                           "stacks are in its run log; rerunning the command resumes from the last checkpoint "
                           "in "), last
    assert "Traceback" not in r.stderr
    assert "the threads' stacks when the held-out evaluation" in (tmp_path / "run" / "run.log").read_text()


def hung_line(what, minutes, run_dir):
    return (f"error: {what} has not finished after {minutes:g} min (run.start_timeout_minutes): taken as hung, the "
            "process exits (status 124); the threads' stacks are in its run log; rerunning the command resumes from "
            f"the last checkpoint in {run_dir / 'checkpoints'}")


@pytest.mark.slow  # ~8 s: the start until its limit
def test_a_run_whose_start_hangs_exits_with_one_error_line(tmp_path):
    """run.start_timeout_minutes watches the start as hang_timeout_minutes a step: here the generation engine never
    comes up. (The limit, 3 s, may pass before the engine is reached: the start as a whole is what is watched.)"""
    r = run_train(tmp_path, "run.start_timeout_minutes=0.05", worker="hanging_start_train.py", worker_args=["engine"])
    assert r.returncode == HUNG_STATUS, r.stderr[-3000:]
    what = "the start (the prompts read, the policy built or restored, the generator started)"
    assert r.stderr.strip().splitlines()[-1] == hung_line(what, 0.05, tmp_path / "run"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr


# ~40 s: the limit must outlast the start (the resume's clock starts again), and the resume is then held for all of it
@pytest.mark.slow
@pytest.mark.extended
def test_a_run_whose_resume_hangs_exits_with_one_error_line(tmp_path):
    """The resume is watched too: here the checkpoint read never returns (a filesystem that stopped answering)."""
    r = run_train(tmp_path, "run.start_timeout_minutes=0.5", worker="hanging_start_train.py", worker_args=["restore"])
    assert r.returncode == HUNG_STATUS, r.stderr[-3000:]
    what = "the resume (the checkpoint's state placed, the generator given its weights)"
    assert r.stderr.strip().splitlines()[-1] == hung_line(what, 0.5, tmp_path / "run"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "in never_returns" in (tmp_path / "run" / "run.log").read_text()  # the stuck frame


# ~50 s: the limit must outlast the first step (its compile, ~15 s here), and the end is then held for all of it
@pytest.mark.slow
@pytest.mark.extended
def test_a_run_whose_end_hangs_exits_with_one_error_line_after_its_last_save(tmp_path):
    """The end of the run is watched too: here the generator's shutdown never returns. The wait for the last save
    comes before it, so that checkpoint is complete and a rerun has nothing left to train."""
    r = run_train(tmp_path, "run.total_steps=1", "eval.every_steps=0", "eval.at_start=false",
                  "run.hang_timeout_minutes=0.5", "logging.plot=false", worker="hanging_shutdown_train.py")
    assert r.returncode == HUNG_STATUS, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the end of the run (its last save, the generator's shutdown) has not finished after "
                           "0.5 min (run.hang_timeout_minutes): taken as hung"), last
    assert "Traceback" not in r.stderr
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["1"]
    assert "in <lambda>" in (tmp_path / "run" / "run.log").read_text()  # the stuck shutdown's frame
