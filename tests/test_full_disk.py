"""A run directory whose disk fills during a run (checkpoints, metrics.jsonl, run.log and TensorBoard share it): one
`error:` line naming the resume step, and no traceback after it. Which write hits the full disk first depends on
timing; where it was metrics.jsonl or run.log, a run used to print ~970 lines of tracebacks (on a 2.3 MB tmpfs,
2026-12-05). /dev/full stands in for the full disk here: every write to it fails with ENOSPC."""

import errno
import logging
import os
import re
from types import SimpleNamespace

import pytest

from m3jax import train
from rl.logs import RunLogFile
from rl.observe import RunLogger

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) as a full disk")


def test_run_log_on_a_full_disk_warns_once_and_drops_the_rest(caplog, capsys):
    handler = RunLogFile("/dev/full", mode="a", encoding="utf-8")
    logger = logging.getLogger("m3jax.test_full_disk")
    logger.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO):
            for i in range(3):
                logger.info("record %d", i)
    finally:
        logger.removeHandler(handler)
        handler.close()  # its buffered bytes do not fit either: not raised
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["/dev/full cannot be written (No space left on device): its records from here on are lost"]
    assert handler.failed and capsys.readouterr().err == ""  # logging's default: a traceback per record


def test_metrics_and_tensorboard_on_a_full_disk_raise_at_the_row_and_close_without_a_traceback(tmp_path, capsys):
    """A full disk raises out of the row's write (the trainer stops with one line naming the run directory), of
    metrics.jsonl or of TensorBoard's file, each written and flushed at the row; closing after it says nothing more
    (tensorboardX's writer thread used to retry its flush at exit and print tracebacks after the error line)."""
    pytest.importorskip("tensorboardX", reason="tensorboardX is not installed (scripts/setup.sh installs it)")
    for full in ("_jsonl", "_tb"):
        logger = RunLogger(str(tmp_path / full), tensorboard=True, progress_bar=False)
        logger.log(1, {"reward/mean": 0.5})
        if full == "_jsonl":
            logger._jsonl.close()
            logger._jsonl = open("/dev/full", "a")  # the disk fills here
        else:
            logger._tb._file.close()
            logger._tb._file = open("/dev/full", "ab")
        with pytest.raises(OSError) as e:
            logger.log(2, {"reward/mean": 0.5})
        assert e.value.errno == errno.ENOSPC, full
        logger.close()
    assert capsys.readouterr().err == ""


class FullDiskTrainer:
    """A trainer whose run directory fills at step 41, after checkpoints 20 and 40."""

    def __init__(self, cfg, **kwargs):
        self.policy = SimpleNamespace(model_cfg=cfg.model.m3_config())
        self.checkpointer = SimpleNamespace(steps=lambda: [20, 40])

    def run(self):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_run_directory_stops_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("rl.trainer.GRPOTrainer", FullDiskTrainer)
    assert train.main(["--config", CONFIG, f"run.out_dir={tmp_path}", "logging.progress_bar=false"]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(re.escape(f"error: writing into the run directory {tmp_path} failed: No space left on device "
                                  "(errno 28) (") + r"\d+\.\d\d GB free there" + re.escape(
                            "); the run stops here, and rerunning the command resumes from step 40 once that is "
                            "fixed\n"), err), err


def test_another_os_error_of_a_run_is_not_taken_for_a_full_disk(tmp_path, monkeypatch):
    class Broken(FullDiskTrainer):
        def run(self):
            raise OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr("rl.trainer.GRPOTrainer", Broken)
    with pytest.raises(OSError, match="Invalid argument"):  # a bug's traceback stays whole
        train.main(["--config", CONFIG, f"run.out_dir={tmp_path}", "logging.progress_bar=false"])


def test_what_library_threads_log_after_the_run_stays_off_the_terminal(capsys):
    """orbax's threads of a failed save report it again as the process exits, after the run's error line; its own
    `logging.info` calls give a root logger without handlers a stderr handler, through which they were printed."""
    root = logging.getLogger()
    saved = list(root.handlers)
    try:
        for handler in saved:
            root.removeHandler(handler)
        train._quiet_after_the_run()
        logging.info("orbax: a background event loop ended")  # would have run logging.basicConfig
        logging.getLogger("absl").error("a save thread raised: No space left on device")
    finally:
        root.handlers[:] = saved
    assert capsys.readouterr().err == ""
