"""A checkpoint that cannot be written (a full disk, a lost mount) stops the run with one line naming the step,
the cause, the free space and the step a rerun resumes from: at the next step for a background save, at once for
a synchronous one. orbax's own reports of the failure go to run.log, off the terminal. (The real thing, on a 2.3 MB
tmpfs, is in BENCHMARKS.md, session 36.)"""

import logging
import os
import shutil

import pytest

from rl.checkpoint import Checkpointer, CheckpointSaveFailed
from rl.checkpoint_logs import _logged_by_orbax, _orbax_errors_to_run_log

NO_SPACE = ValueError("RESOURCE_EXHAUSTED: Error writing \"master.x/0\" in OCDBT database: Failed to write 577626 "
                      "bytes to file 11: No space left on device [os_error_code='28']")


class FakeManager:
    """The orbax CheckpointManager surface Checkpointer uses, with a background save that fails at step 40: its wait
    raises the failure once, as orbax's does (its finalize thread raises it once to each waiting thread)."""

    def __init__(self):
        self.finished, self.running, self.failed = [20], False, None

    def save(self, step, args, force):
        self.running = True
        if step == 40:
            self.failed = NO_SPACE

    def is_saving_in_progress(self):
        return self.running

    def wait_until_finished(self):
        self.running = False
        failed, self.failed = self.failed, None
        if failed is not None:
            raise failed

    def all_steps(self):
        return self.finished

    def close(self):
        pass


@pytest.fixture
def checkpointer(tmp_path, monkeypatch):
    c = Checkpointer(str(tmp_path / "checkpoints"), async_save=True)
    c.manager.close()
    c.manager = FakeManager()
    monkeypatch.setattr("rl.checkpoint.portable_state", lambda state: {})
    yield c
    c.close()
    assert _orbax_errors_to_run_log not in logging.getLogger("absl").filters  # installed by a save, until close


def test_a_failed_background_save_stops_the_run_at_the_next_check(checkpointer):
    c = checkpointer
    c.check_saves()  # nothing saved yet
    c.save(40, None, {})
    c.check_saves()  # still running: returns at once
    c.manager.running = False  # the background save has ended, failing
    with pytest.raises(CheckpointSaveFailed) as e:
        c.check_saves()
    assert str(e.value) == (
        f"saving checkpoint step 40 to {c.directory} failed: No space left on device (errno 28) "
        f"({shutil.disk_usage(c.directory).free / 1e9:.2f} GB free there); the run stops here, and "
        "rerunning the command resumes from step 20 once that is fixed")
    c.wait(quiet=True)  # a run already stopping: logged, not raised
    with pytest.raises(CheckpointSaveFailed):
        c.wait()
    with pytest.raises(CheckpointSaveFailed, match="step 40"):  # nor does another save start
        c.save(41, None, {})


def test_a_failed_final_save_raises_after_the_quiet_wait_at_the_runs_end(checkpointer):
    """The trainer's end waits quietly (its own error, if any, stands), then checks: the wait took orbax's only raise
    of the failure, and a run whose last checkpoint was not written ended "done" (exit status 0)."""
    c = checkpointer
    c.save(40, None, {})
    c.wait(quiet=True)
    with pytest.raises(CheckpointSaveFailed, match="step 40 .* No space left on device"):
        c.check_saves()


def test_a_synchronous_save_whose_write_fails_raises_in_the_save(checkpointer):
    checkpointer.async_save = False
    with pytest.raises(CheckpointSaveFailed, match="step 40 .* No space left on device"):
        checkpointer.save(40, None, {})


def test_a_failed_synchronous_save_raises_at_once(checkpointer, monkeypatch):
    def fail(step, args, force):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(checkpointer.manager, "save", fail)
    with pytest.raises(CheckpointSaveFailed, match=r"step 60 .* failed: Read-only file system \(errno 30\) \("):
        checkpointer.save(60, None, {})


def test_orbax_error_records_are_told_apart_by_their_caller():
    """The "absl" logger can be a plain Logger (made before absl was imported), whose records name absl's logging
    module as their path: the stack tells orbax's from anyone else's."""
    records = []

    class Keep(logging.Filter):
        def filter(self, record):
            records.append(_logged_by_orbax(record))
            return False

    logger = logging.getLogger("test_checkpoint_save_failed.plain")
    logger.addFilter(Keep())
    here = {"logger": logger}
    exec(compile("logger.error('from orbax')", os.path.join(os.sep, "site-packages", "orbax", "x.py"), "exec"), here)
    exec(compile("logger.error('from elsewhere')", os.path.join(os.sep, "site-packages", "other", "x.py"), "exec"),
         here)
    assert records == [True, False]


def test_the_failure_names_the_newest_step_written_before_it(checkpointer):
    """The step a rerun resumes from is the newest finished checkpoint, not the oldest kept, and never the failed
    save's own step, which orbax can list on a process whose write succeeded while another's failed (a mutation
    audit: either slip passed every test, the fake holding one finished step)."""
    c = checkpointer
    c.manager.finished = [10, 20]
    c.save(40, None, {})
    c.manager.finished = [10, 20, 40]  # listed here, failed elsewhere
    c.manager.running = False
    with pytest.raises(CheckpointSaveFailed, match="rerunning the command resumes from step 20 once") as e:
        c.check_saves()
    assert str(e.value).startswith("saving checkpoint step 40 ")
