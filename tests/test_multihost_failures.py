"""A multi-host job one of whose processes fails must stop on every process, promptly and with the same error: a
process that exits alone leaves the others waiting in jax.distributed.initialize or at their next collective (slow:
two-process CPU jobs, each bounded so that a regression fails instead of hanging the suite)."""

import os
import subprocess

import pytest

from rl.run_lock import RunLock
from tests.test_multihost import TWO_HOSTS, two_hosts


def outputs_within(procs: list[subprocess.Popen], seconds: float) -> list[str]:
    """Each process's output; a process still running after `seconds` (all together) fails the test, killed."""
    import time
    deadline, logs, hung = time.time() + seconds, [], None
    for i, p in enumerate(procs):
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.time()))[0])
        except subprocess.TimeoutExpired:
            hung = i if hung is None else hung
            p.kill()
            logs.append(p.communicate()[0])
    if hung is not None:
        pytest.fail(f"process {hung} still ran after {seconds:.0f} s (hung); the outputs:\n" + "\n".join(logs)[-4000:])
    return logs


@pytest.mark.slow  # ~15 s: no process gets past its start
def test_a_lock_refused_on_process_zero_stops_every_process(tmp_path):
    """Only process 0 takes the run's lock. Refused, it used to exit alone (3) while process 1 waited in
    jax.distributed.initialize for a coordinator that never came (5 minutes, then an opaque error)."""
    run, out = tmp_path / "run", str(tmp_path / "out")
    run.mkdir()
    (run / "keep.txt").write_text("the other run's")
    with RunLock(str(run)):  # another run holds the directory
        before = sorted(os.listdir(run))
        procs = two_hosts(out, [*TWO_HOSTS, "run.total_steps=1", f"run.out_dir={run}"])
        logs = outputs_within(procs, 60)  # process 1 waited 5 minutes for a coordinator
        assert sorted(os.listdir(run)) == before  # nothing of the refused job
    assert [p.returncode for p in procs] == [3, 3], "\n".join(logs)[-4000:]
    for log in logs:
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"pid {os.getpid()}" in errors[0] and str(run) in errors[0], log[-3000:]
