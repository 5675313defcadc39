"""How orbax's reports reach the run's log (`rl.checkpoint`): its save threads' errors stay in run.log (the run's
own error says it in a line) and are announced to a multi-host job's other processes, and the after-effects of an
abandoned restore go to the DEBUG log."""

from __future__ import annotations

import logging
import os
import re
import sys

from rl import checkpoint_job

log = logging.getLogger("rl.checkpoint")


def _cause(e: Exception) -> str:
    """The reason of a failed write in a line: the OS error TensorStore names (os_error_code), else the message."""
    if isinstance(e, OSError) and e.errno and e.strerror:
        return f"{e.strerror} (errno {e.errno})"
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code:
        return f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
    return f"{type(e).__name__}: {str(e)[:300]}"


def read_failure(e: Exception) -> str:
    """Why a checkpoint could not be read, in a line: the innermost exception's message, where TensorStore names
    the array and file ('OUT_OF_RANGE: Error reading "master.embed/0.0" ...'); the outer one only repeats the
    index read and a pybind repr, which cut at 200 characters said neither."""
    inner, seen = e, {id(e)}
    while (nxt := inner.__cause__ or inner.__context__) is not None and id(nxt) not in seen:
        inner, seen = nxt, seen | {id(nxt)}
    text = " ".join((str(inner) or str(e)).split("See full TensorStore details")[0].split())
    return f"{type(inner).__name__}: {text[:300]}"


def _orbax_errors_to_run_log(record: logging.LogRecord) -> bool:
    """orbax's ERROR records (its save threads' failures, each with a traceback): INFO, so they stay in run.log and
    off the terminal, where `CheckpointSaveFailed` says it in a line. One with an exception is a save failing in
    this process: announced to the job's other processes, which would wait for its write (rl.checkpoint_job)."""
    if record.levelno >= logging.ERROR and _logged_by_orbax(record):
        record.levelno, record.levelname = logging.INFO, "INFO"
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, Exception) and not isinstance(error, checkpoint_job.FailedElsewhere):
            checkpoint_job.announce_failure(_cause(error))
    return True


def _logged_by_orbax(record: logging.LogRecord) -> bool:
    """Whether orbax logged `record` (a filter runs in the logging call). Its pathname names absl's logging module
    instead where the "absl" logger was made before absl was imported (a plain Logger, without absl's caller
    lookup), so the stack is asked then."""
    if _from_orbax(record.pathname):
        return True
    frame = sys._getframe(1)  # this module's filter, then logging's and absl's frames, then the caller
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or f"{os.sep}logging{os.sep}" in frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None and _from_orbax(frame.f_code)


class _Demote(logging.Filter):
    """Turns records whose message starts with `prefix` into DEBUG records (run.log only)."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(self.prefix):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _quiet_abandoned_reads() -> None:
    """Send the after-effects of a failed restore to the DEBUG log (run.log) instead of the terminal.

    orbax gives up on a checkpoint at its first failed read while its other reads are still in flight;
    they end later, on their own: tensorstore's threads call back into the event loop orbax has closed
    ("RuntimeError: Event loop is closed", which Python can only print as an unraisable exception),
    unfinished read coroutines are collected ("Exception ignored in: <coroutine ...>"), and asyncio
    reports "Task exception was never retrieved" for each failed read. The failure itself is already
    the warning of `restore_latest`. Installed once, the first time a checkpoint is unreadable;
    anything else goes on to the previous hook unchanged."""
    if _QuietAbandonedReads.installed:
        return
    _QuietAbandonedReads.installed = True
    sys.unraisablehook = _QuietAbandonedReads(sys.unraisablehook)
    logging.getLogger("asyncio").addFilter(_demote_orbax_task_errors)


def _from_orbax(code_or_text) -> bool:
    text = code_or_text.co_filename if hasattr(code_or_text, "co_filename") else str(code_or_text)
    return f"{os.sep}orbax{os.sep}" in text


class _QuietAbandonedReads:
    installed = False

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, u) -> None:
        loop_closed = isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
        code = getattr(u.object, "cr_code", None)  # a coroutine collected unfinished
        if loop_closed or (code is not None and _from_orbax(code)):
            where = u.err_msg or "Exception ignored in"
            log.debug("a read abandoned with an unreadable checkpoint failed afterwards (%s%s)", where,
                      "" if u.object is None else f": {u.object!r}",
                      exc_info=(u.exc_type, u.exc_value, u.exc_traceback))
        else:
            self.previous(u)


def _demote_orbax_task_errors(record: logging.LogRecord) -> bool:
    """asyncio's "Task exception was never retrieved" for orbax's reads: DEBUG (a filter on the asyncio
    logger runs before any handler, which then sees the new level)."""
    if record.levelno >= logging.ERROR and "never retrieved" in str(record.msg) and _from_orbax(record.msg):
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    return True
