"""A quiet, honest terminal (rl.logs): the project's INFO lines and anyone's warnings on the terminal,
third-party INFO (absl/orbax, jax, ...) in <run.out_dir>/run.log; `logging.level: debug` shows it all.
Also: the after-effects of an unreadable checkpoint (rl.checkpoint) go to the DEBUG log, not the terminal."""

import logging
import os
import sys
import types
import warnings

import pytest

from rl import logs
from rl.config import ConfigError, load_config
from rl.config import schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


@pytest.fixture
def routed(tmp_path):
    """setup() on tmp_path; yields a function (level) -> path of run.log; always torn down."""
    def go(level="info"):
        return logs.setup(str(tmp_path), level)
    yield go
    logs.teardown()


def emit_all():
    logging.getLogger("rl.trainer").info("project info")
    logging.getLogger("rl.trainer").debug("project debug")
    logging.getLogger("sharding.mesh").info("sharding info")
    logging.getLogger("orbax.checkpoint").info("orbax info")
    logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu'")
    logging.getLogger("ray").warning("ray warning")
    logging.getLogger("jax").debug("jax debug")
    from absl import logging as absl_logging
    absl_logging.info("absl info")


def test_info_level_routes_third_party_info_to_the_file_only(routed, capsys):
    path = routed("info")
    assert path.endswith("run.log")
    emit_all()
    err = capsys.readouterr().err
    assert "project info" in err and "sharding info" in err and "ray warning" in err
    for quiet in ("orbax info", "backend 'tpu'", "absl info", "project debug", "jax debug"):
        assert quiet not in err, quiet
    text = open(path).read()
    for logged in ("project info", "project debug", "sharding info", "orbax info", "backend 'tpu'", "absl info",
                   "ray warning"):
        assert logged in text, logged
    assert "jax debug" not in text  # third-party DEBUG only at level debug


def test_orbaxs_wait_for_the_previous_save_stays_in_the_run_log(routed, capsys):
    """A loaded machine's slow async save made orbax warn on the terminal, which the run's time/checkpoint holds."""
    from absl import logging as absl_logging
    path = routed("info")
    absl_logging.warning("Waiting for previous save to complete took %f seconds. If this number is high, consider "
                         "checkpointing less frequently.", 1.04)
    absl_logging.warning("another absl warning")
    err = capsys.readouterr().err
    assert "Waiting for previous save" not in err and "another absl warning" in err
    assert "Waiting for previous save to complete took 1.04" in open(path).read()


def test_the_other_processes_of_a_job_show_their_warnings_only_named(tmp_path, capsys):
    """A job's processes share one log (the scheduler's): the others' INFO lines stay in their run.<i>.log."""
    try:
        path = logs.setup(str(tmp_path), "info", process_index=3)
        emit_all()
    finally:
        logs.teardown()
    err = capsys.readouterr().err
    assert path.endswith("run.3.log")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].endswith(" WARNING [process 3] ray: ray warning"), err
    text = open(path).read()
    assert "project info" in text and "sharding info" in text and "ray warning" in text


def test_debug_level_shows_everything(routed, capsys):
    path = routed("debug")
    emit_all()
    err = capsys.readouterr().err
    text = open(path).read()
    for line in ("project info", "project debug", "orbax info", "backend 'tpu'", "absl info", "jax debug"):
        assert line in err and line in text, line


def test_warnings_and_unraisable_exceptions_are_logged(routed, capsys):
    path = routed()
    warnings.warn("careful", UserWarning)
    sys.unraisablehook(types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("boom"), exc_traceback=None,
                                             err_msg="Exception ignored in", object="an object"))
    err = capsys.readouterr().err
    assert "careful" in err and "boom" in err and "an object" in err
    text = open(path).read()
    assert "py.warnings" in text and "careful" in text and "py.unraisable" in text


def test_an_exception_that_ends_a_thread_is_one_line_and_its_traceback_goes_to_the_file(routed, capsys):
    """tensorboardX's writer thread on a full disk printed its 14-line traceback after the run's error line."""
    import threading

    def write_event():
        raise OSError(28, "No space left on device")
    path = routed()
    thread = threading.Thread(target=write_event, name="Thread-3")
    thread.start()
    thread.join()
    err = capsys.readouterr().err
    assert err.endswith("WARNING py.thread: Thread-3 ended by OSError: [Errno 28] No space left on device\n"), err
    assert len(err.splitlines()) == 1, err
    text = open(path).read()
    assert "INFO py.thread [" in text and "Traceback" in text and "in write_event" in text


def test_log_lines_go_above_the_progress_bar(routed, capsys):
    from tqdm import tqdm
    routed()
    bar = tqdm(total=3, file=sys.stderr)
    bar.update(1)
    logging.getLogger("rl.trainer").info("between steps")
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    # tqdm.write clears the bar, writes the line, and draws the bar again
    assert "between steps\n" in err and err.index("between steps") < err.rindex("2/3")


def test_libraries_with_their_own_handler_are_adopted_on_import(tmp_path, monkeypatch, capsys):
    """Ray and vLLM give their logger a stderr handler (propagate off) when imported, after setup."""
    pkg = tmp_path / "lib" / "loudlib"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import logging, sys\n"
        "log = logging.getLogger('loudlib')\n"
        "log.addHandler(logging.StreamHandler(sys.stderr)); log.setLevel(logging.INFO); log.propagate = False\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.setattr(logs, "OWN_HANDLERS", ("loudlib",))
    try:
        path = logs.setup(str(tmp_path / "run"))
        import loudlib
        loudlib.log.info("loud info")
        loudlib.log.warning("loud warning")
    finally:
        logs.teardown()
        sys.modules.pop("loudlib", None)
    err = capsys.readouterr().err
    assert "loud info" not in err and err.count("loud warning") == 1
    text = open(path).read()
    assert "INFO loudlib" in text and "WARNING loudlib" in text


def test_teardown_restores_logging(tmp_path):
    root = logging.getLogger()
    import threading
    before = (root.level, list(root.handlers), sys.unraisablehook, threading.excepthook, logging.getLogger("rl").level)
    logs.setup(str(tmp_path), "info")
    assert root.handlers != before[1]
    logs.teardown()
    assert (root.level, list(root.handlers), sys.unraisablehook, threading.excepthook,
            logging.getLogger("rl").level) == before


def test_other_processes_write_their_own_file(tmp_path):
    try:
        assert logs.setup(str(tmp_path), process_index=3).endswith("run.3.log")
    finally:
        logs.teardown()


def test_config_key_and_its_choices_mirror_rl_logs():
    assert schema.LOG_LEVELS == logs.LEVELS
    assert load_config(TINY).logging.level == "info"
    assert load_config(TINY, ["logging.level=debug"]).logging.level == "debug"
    with pytest.raises(ConfigError, match="logging.level"):
        load_config(TINY, ["logging.level=verbose"])


def test_abandoned_orbax_reads_go_to_the_debug_log(caplog):
    """What orbax leaves behind when it gives up on an unreadable checkpoint: the unraisable "Event loop is
    closed" from tensorstore's threads, unfinished coroutines, asyncio's never-retrieved task errors."""
    from rl import checkpoint_logs as ckpt  # rl.checkpoint's log handling

    seen = []
    hook = ckpt._QuietAbandonedReads(seen.append)
    try:
        raise RuntimeError("Event loop is closed")
    except RuntimeError as e:
        closed = types.SimpleNamespace(exc_type=RuntimeError, exc_value=e, exc_traceback=e.__traceback__,
                                       err_msg=None, object=None)
    other = types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("x"), exc_traceback=None, err_msg=None,
                                  object=None)
    with caplog.at_level(logging.DEBUG, logger="rl.checkpoint"):
        hook(closed)
        hook(other)
    assert seen == [other]  # anything else: to the previous hook
    assert [r.levelno for r in caplog.records if r.name == "rl.checkpoint"] == [logging.DEBUG]

    orbax_file = os.path.join("site-packages", "orbax", "checkpoint", "serialization.py")
    rec = logging.LogRecord("asyncio", logging.ERROR, "x", 1, "Task exception was never retrieved\nfuture: <Task "
                            f"coro=<async_deserialize() defined at {orbax_file}:394>>", None, None)
    assert ckpt._demote_orbax_task_errors(rec) and rec.levelno == logging.DEBUG
    mine = logging.LogRecord("asyncio", logging.ERROR, "x", 1, "Task exception was never retrieved\nfuture: "
                             "<Task coro=<mine() defined at /app/mine.py:3>>", None, None)
    assert ckpt._demote_orbax_task_errors(mine) and mine.levelno == logging.ERROR


# The terminal of a real 200-step run and of a checkpoint restore: tests/test_trainer.py (one run serves both).
