"""One run per directory (rl.run_lock): a second run is refused naming the holder; a dead holder's lock is
taken over with a warning; another host's lock is refused with the way out; the lock goes with its run."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from rl import run_lock
from rl.run_lock import RunLock, RunLockHeld, lock_run_dir, process_index

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = socket.gethostname()


def holder(directory, *, then="sleep"):
    """A python process that takes the lock on `directory`, says so on stdout, then sleeps or exits."""
    code = textwrap.dedent(f"""
        import sys, time
        from rl.run_lock import RunLock
        RunLock({str(directory)!r}).acquire()
        print("locked", flush=True)
        if {then!r} == "sleep":
            time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_second_acquire_is_refused_naming_the_holder(tmp_path):
    p = holder(tmp_path)
    try:
        with pytest.raises(RunLockHeld) as e:
            RunLock(tmp_path).acquire()
        msg = str(e.value)
        assert "\n" not in msg
        assert f"host {HOST} pid {p.pid}" in msg and str(tmp_path) in msg, msg
    finally:
        p.kill()
        p.wait()


def test_same_process_cannot_take_it_twice(tmp_path):
    with RunLock(tmp_path) as first:
        assert first.held
        with pytest.raises(RunLockHeld, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    assert not os.path.exists(tmp_path / ".lock")  # released: the file goes with it
    with RunLock(tmp_path) as again:
        assert again.took_over is None


def test_lock_of_a_killed_holder_is_taken_over_with_a_warning(tmp_path, caplog):
    p = holder(tmp_path)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == p.pid  # left behind by kill -9
    with caplog.at_level(logging.WARNING, logger="rl.run_lock"):
        lock = RunLock(tmp_path).acquire()
    try:
        assert lock.took_over and f"pid {p.pid}" in lock.took_over and "no longer running" in lock.took_over
        assert [r.getMessage() for r in caplog.records] == [lock.took_over]
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()  # signed by the new holder
    finally:
        lock.release()


def test_took_over_without_logging_when_asked(tmp_path, caplog):
    (tmp_path / ".lock").write_text(json.dumps({"host": HOST, "pid": 2 ** 22 + 12345, "started": "then"}))
    with caplog.at_level(logging.WARNING, logger="rl.run_lock"):
        lock = lock_run_dir(str(tmp_path), warn=False)
    try:
        assert "no longer running" in lock.took_over and not caplog.records
    finally:
        lock.release()


def test_holder_that_exits_releases_the_lock(tmp_path):
    p = holder(tmp_path, then="exit")
    assert p.wait(timeout=60) == 0
    assert not os.path.exists(tmp_path / ".lock")  # atexit released it
    with RunLock(tmp_path) as lock:
        assert lock.took_over is None


def test_lock_written_by_another_host_is_refused_with_the_way_out(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"host": "node-17", "pid": 4242, "started": "2026-01-01T00:00"}))
    with pytest.raises(RunLockHeld) as e:
        RunLock(tmp_path).acquire()
    msg = str(e.value)
    assert "\n" not in msg and "host node-17 pid 4242" in msg and f"delete {tmp_path / '.lock'}" in msg, msg
    assert (tmp_path / ".lock").exists()  # left alone


def test_unknown_lock_content_is_refused_not_overwritten(tmp_path):
    (tmp_path / ".lock").write_text("something else\n")
    with pytest.raises(RunLockHeld, match="unknown holder"):
        RunLock(tmp_path).acquire()
    assert (tmp_path / ".lock").read_text() == "something else\n"


def test_creates_the_run_directory(tmp_path):
    d = tmp_path / "a" / "b"
    with RunLock(d):
        assert (d / ".lock").exists()


@pytest.mark.parametrize("config, env, want", [
    (None, {}, 0),
    (3, {"JAX_PROCESS_ID": "1"}, 3),                                     # the config wins
    (None, {"JAX_PROCESS_ID": "2", "SLURM_PROCID": "5"}, 2),
    (None, {"SLURM_PROCID": "5", "OMPI_COMM_WORLD_RANK": "6"}, 5),
    (None, {"OMPI_COMM_WORLD_RANK": "6"}, 6),
    # mpirun inside sbatch: every rank inherits SLURM_PROCID=0; jax reads the Open MPI rank first
    (None, {"SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "3", "OMPI_MCA_orte_hnp_uri": "1234.0;tcp://10.0.0.1:5"}, 3),
    (None, {"JAX_PROCESS_ID": "2", "OMPI_COMM_WORLD_RANK": "3", "OMPI_MCA_orte_hnp_uri": "1234.0;tcp://h:5"}, 2),
    (None, {"JAX_PROCESS_ID": ""}, 0),
])
def test_process_index_from_config_then_environment(config, env, want):
    assert process_index(config, env) == want


def test_only_process_zero_takes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert lock_run_dir(str(tmp_path)) is None
    assert not os.path.exists(tmp_path / ".lock")
    lock = lock_run_dir(str(tmp_path), 0)
    assert lock.held
    lock.release()


def test_no_jax_import():
    r = subprocess.run([sys.executable, "-c", "import sys, rl.run_lock, rl.logs; print('jax' in sys.modules)"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stderr
    assert run_lock.LOCK_NAME == ".lock"


@pytest.mark.slow
def test_second_training_run_on_a_directory_exits_at_once(tmp_path):
    """The real command: while one run trains in a directory, a second one exits non-zero within 10 s with
    one line naming the first (host, pid)."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "m3jax.train", "--config", "configs/tiny.yaml", f"run.out_dir={out}",
           "run.total_steps=1000", "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false"]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (out / ".lock").exists() or not (out / ".lock").read_text().strip():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.05)
        t0 = time.time()
        second = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = second.communicate(timeout=60)[0]
        took = time.time() - t0
        assert first.poll() is None  # the first run is untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert second.returncode == 3 and took < 10, (second.returncode, took, output[-2000:])
    lines = output.strip().splitlines()
    assert len(lines) == 1 and f"host {HOST} pid {first.pid}" in lines[0], lines
    log = out / "run.log"  # the refused run wrote nothing into the directory
    assert not log.exists() or f"[{second.pid} " not in log.read_text()
