"""Where log records go during a run: a quiet terminal, everything in `<run.out_dir>/run.log`.

    terminal (stderr)   INFO and up from the project's own loggers (`m3jax`, `rl`, `sharding`, the
                        `__main__` script), WARNING and up from anyone; written above the progress bar
                        (`tqdm.write`), never through it.
    run.log             every record: INFO and up from everyone (absl / orbax, jax, Ray, vLLM, ...), and
                        DEBUG from the project. Appended to, so a resumed run continues the same file.

With `logging.level: debug` the terminal shows everything run.log gets, and both get DEBUG from everyone.
Also routed into logging (so that they obey the same rules and land in run.log): absl (orbax logs
through it), Ray and vLLM (they print through handlers of their own, removed when they are imported),
`warnings.warn` (logger `py.warnings`), exceptions Python can only report as "Exception ignored in
..." (logger `py.unraisable`, WARNING) and those that end a thread (logger `py.thread`: one WARNING line, the
traceback at INFO, so in run.log; a library's writer thread on a full disk printed 14 lines after the run's error).
Not here: what Ray actors print (vLLM engines included) stays in Ray's session logs (the pool starts Ray with
log_to_driver=False).

In a multi-host job each process writes its own file: run.log for process 0, run.<i>.log for process i; on the
terminal the others show WARNING and up only, tagged `[process i]`.
`setup` is called once by `m3jax.train` when the config is known and the run directory is locked.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import threading

LEVELS = ("info", "debug")              # mirrored in rl.config.schema.LOG_LEVELS
PROJECT = ("m3jax", "rl", "sharding", "__main__")
OWN_HANDLERS = ("ray", "vllm")          # libraries that give their logger a stderr handler on import
TERMINAL_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d %(threadName)s]: %(message)s"


def is_project(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PROJECT)


def log_file_name(process_index: int = 0) -> str:
    return "run.log" if process_index == 0 else f"run.{process_index}.log"


class TerminalFilter(logging.Filter):
    """What the terminal shows at `level` info: the project's INFO+, anyone's WARNING+. `infos` False (the processes
    of a multi-host job but the first): WARNING+ only. A scheduler gathers every process's terminal into one job log,
    where the 32-node recipe's 16 training hosts printed each of their INFO lines 16 times (the load's progress: 160
    lines); their INFO lines are in their own run.<i>.log."""

    def __init__(self, level: str = "info", infos: bool = True):
        super().__init__()
        self.debug, self.infos = level == "debug", infos

    def filter(self, record: logging.LogRecord) -> bool:
        if self.debug:
            return True
        if record.levelno >= logging.WARNING:
            return not _reported_by_the_run(record)
        return self.infos and record.levelno >= logging.INFO and is_project(record.name)


# Library warnings about what the run reports itself, kept for run.log: orbax's wait for the previous async save
# (a loaded machine's slow save, which the next step's `time/checkpoint` holds) broke the quiet terminal.
REPORTED_BY_THE_RUN = (("absl", "Waiting for previous save to complete took"),)


def _reported_by_the_run(record: logging.LogRecord) -> bool:
    return any(record.name == name and str(record.msg).startswith(prefix) for name, prefix in REPORTED_BY_THE_RUN)


def terminal_format(process_index: int = 0) -> str:
    """TERMINAL_FORMAT, naming the process in a multi-host job's others: their lines share the job log with process
    0's."""
    return TERMINAL_FORMAT if process_index == 0 else TERMINAL_FORMAT.replace(
        " %(name)s", f" [process {process_index}] %(name)s")


class TqdmHandler(logging.Handler):
    """Writes to the current sys.stderr through `tqdm.write`, which clears any progress bar, prints the
    line and draws the bar again below it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is a dependency
                sys.stderr.write(msg + "\n")
            else:
                tqdm.write(msg, file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class RunLogFile(logging.FileHandler):
    """run.log. A record it cannot write (a full disk, a lost mount) would be a traceback on the terminal per record,
    as logging's default `handleError` prints one: the first failure is one warning there instead, and the file takes
    no more records (what stopped the run is its own error line)."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        if not self.failed:
            self.failed = True  # first: the warning below comes through this handler again
            logging.getLogger(__name__).warning("%s cannot be written (%s): its records from here on are lost",
                                                self.baseFilename, error.strerror or error)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # its last records did not fit: handleError said so
            self.failed = True


class _Setup:
    def __init__(self):
        self.handlers: list[logging.Handler] = []
        self.saved = None


_active = _Setup()


def setup(run_dir: str | None, level: str = "info", *, process_index: int = 0) -> str | None:
    """Route logging as described above; returns the log file's path. Calling it again replaces the
    previous setup (`teardown` undoes it). run_dir None: the terminal only, no file (a reader such as
    `python -m m3jax.eval` writes nothing into a run directory)."""
    if level not in LEVELS:
        raise ValueError(f"logging level {level!r}: expected one of {LEVELS}")
    teardown()
    root = logging.getLogger()
    debug = level == "debug"
    _active.saved = {
        "root_level": root.level, "root_handlers": list(root.handlers),
        "project_levels": {p: logging.getLogger(p).level for p in PROJECT},
        "unraisablehook": sys.unraisablehook, "absl_level": logging.getLogger("absl").level,
        "threading_excepthook": threading.excepthook,
    }
    for h in list(root.handlers):  # e.g. an earlier basicConfig: it would print everything again
        root.removeHandler(h)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    for p in PROJECT:  # the project's DEBUG records reach run.log even at level info
        logging.getLogger(p).setLevel(logging.DEBUG)

    handlers: list[logging.Handler] = []
    path = None
    if run_dir is not None:
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, log_file_name(process_index))
        file_handler = RunLogFile(path, mode="a", encoding="utf-8")
        file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
        handlers.append(file_handler)
    terminal = TqdmHandler()
    terminal.setFormatter(logging.Formatter(terminal_format(process_index), datefmt="%H:%M:%S"))
    terminal.addFilter(TerminalFilter(level, infos=process_index == 0))
    if not debug:  # the project's own DEBUG records: run.log only
        terminal.setLevel(logging.INFO)
    handlers.append(terminal)
    for h in handlers:
        root.addHandler(h)
    _active.handlers = handlers

    _route_absl(debug)
    for name in OWN_HANDLERS:
        if name in sys.modules:
            adopt(name)
        elif not any(isinstance(f, _AdoptOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AdoptOnImport())
    logging.captureWarnings(True)
    sys.unraisablehook = _log_unraisable
    threading.excepthook = _log_thread_exception
    logging.getLogger(__name__).debug("logging to %s (level %s), pid %d, argv %s", path, level, os.getpid(),
                                      sys.argv)
    return path


def teardown() -> None:
    """Close the handlers of `setup` and restore what it changed."""
    saved, _active.saved = _active.saved, None
    if saved is None:
        return
    root = logging.getLogger()
    for h in _active.handlers:
        root.removeHandler(h)
        h.close()
    _active.handlers = []
    for h in saved["root_handlers"]:
        root.addHandler(h)
    root.setLevel(saved["root_level"])
    for p, lvl in saved["project_levels"].items():
        logging.getLogger(p).setLevel(lvl)
    logging.getLogger("absl").setLevel(saved["absl_level"])
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AdoptOnImport)]
    logging.captureWarnings(False)
    if sys.unraisablehook is _log_unraisable:
        sys.unraisablehook = saved["unraisablehook"]
    if threading.excepthook is _log_thread_exception:
        threading.excepthook = saved["threading_excepthook"]


def adopt(name: str) -> None:
    """Make a library's logger ours: drop the handlers it gave itself, let its records propagate to the
    root handlers, and its level follow the root's."""
    logger = logging.getLogger(name)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


class _AdoptOnImport(importlib.abc.MetaPathFinder):
    """Runs `adopt` on a library of OWN_HANDLERS right after its package is first imported (Ray and
    vLLM are imported late, when the generation backend is built, and set up their logging then)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in OWN_HANDLERS or fullname in sys.modules:
            return None
        sys.meta_path.remove(self)  # find the real spec (and no recursion), then come back
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _AdoptingLoader(spec.loader, fullname)
        return spec


class _AdoptingLoader(importlib.abc.Loader):
    def __init__(self, loader, name):
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        if _active.saved is not None:  # still set up
            adopt(self.name)

    def __getattr__(self, attr):  # get_resource_reader, is_package, ... of the real loader
        return getattr(self.loader, attr)


def _route_absl(debug: bool) -> None:
    """absl logs through Python logging unless its own handler was installed (absl.app.run does):
    make sure it is not, and let the absl logger follow the root level."""
    try:
        from absl import logging as absl_logging
    except ImportError:
        return
    handler = absl_logging.get_absl_handler()
    root = logging.getLogger()
    if handler in root.handlers:
        root.removeHandler(handler)
    absl_logging.use_python_logging(quiet=True)
    absl_logging.set_verbosity("debug" if debug else "info")


def _log_unraisable(unraisable) -> None:
    """An exception raised where nobody can catch it (a __del__, a callback from a foreign thread):
    Python would print its traceback; log it instead."""
    where = unraisable.err_msg or "Exception ignored in"
    if unraisable.object is not None:
        where = f"{where}: {unraisable.object!r}"
    exc = (unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)
    logging.getLogger("py.unraisable").warning("%s", where, exc_info=exc if unraisable.exc_type else None)


def _log_thread_exception(args) -> None:
    """An exception that ended a thread (a library's background writer, say): Python would print its traceback on the
    terminal; one line goes there instead, the traceback to run.log."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "a thread"
    log = logging.getLogger("py.thread")
    log.info("%s ended by an exception", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
    log.warning("%s ended by %s: %s", name, args.exc_type.__name__, args.exc_value)
