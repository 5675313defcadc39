"""One run per directory: an OS lock on `<run.out_dir>/.lock`, taken before any state is changed.

The lock is `fcntl.flock` on the lock file, kept open for the life of the run: the kernel releases it
when the process ends in any way (kill -9 included), so "is the holder still running" never depends
on a pid check. The file also holds who took it (host, pid, start time, command line) so that a
refusal can name the holder; a clean exit deletes it.

What a run finds when it starts:

* no file, or an empty one: it takes the lock;
* a file locked by someone else (another run on this host, or on another host of a file system whose
  locks work across hosts): refused, naming the holder (`RunLockHeld`);
* a file nobody holds, written by a process of this host: that process died without cleaning up
  (kill -9, OOM, a crashed node rebooted): taken over, with a warning;
* a file nobody holds, written by another host: whether that run is alive cannot be known from here
  (many shared file systems do not pass flock between hosts), so it is refused, with the way out:
  delete the file once that run is known to be over.

In a multi-host job only process 0 takes the lock (`process_index`); the others share its directory, and hear its
answer before any of them writes there (`m3jax.train._job_refusal`).

Pure Python and no jax: `m3jax.train` takes the lock before it imports the trainer, so that a second
run on a busy directory is turned away at once.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import json
import logging
import os
import socket
import sys

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


# The locks this process holds, for `release_held`: a hard exit (rl.watchdog's os._exit) runs no atexit handler.
_HELD: list = []


def release_held() -> None:
    """Release every run lock this process holds, before a hard exit: the watchdog's os._exit skipped the atexit
    release and left `.lock` behind, naming this host, so a rerun of the job on another node was refused."""
    for lock in list(_HELD):
        lock.release()


class RunLockHeld(RuntimeError):
    """Another run holds (or may hold) the directory; str() is one line naming the holder."""


def process_index(config_process_id: int | None = None, environ=None) -> int:
    """This process's index in a multi-host job, without importing jax: the config's `mesh.process_id`,
    else JAX_PROCESS_ID (what `sharding.launch.distributed_args` passes to jax), else the launcher's rank in the
    order jax detects it: OMPI_COMM_WORLD_RANK under mpirun (OMPI_MCA_orte_hnp_uri set), then SLURM_PROCID. An
    mpirun inside an sbatch script leaves every rank SLURM_PROCID=0: read first, it made each rank process 0 here,
    all taking the lock and logging into run.log, while jax numbered them 0..n-1. Else 0."""
    if config_process_id is not None:
        return int(config_process_id)
    env = os.environ if environ is None else environ
    names = ("JAX_PROCESS_ID", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID") if env.get("OMPI_MCA_orte_hnp_uri") else \
        ("JAX_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return int(value)
    return 0


def _describe(holder: dict) -> str:
    if "raw" in holder:
        return f"an unknown holder (the file says {holder['raw']!r})"
    started = f", started {holder['started']}" if holder.get("started") else ""
    return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')}{started}"


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid namespace runs under `pid`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a live process of another user
        return True
    return True


class RunLock:
    """`<directory>/.lock`, held from `acquire()` to `release()` (also at interpreter exit).

        with RunLock(out_dir):        # raises RunLockHeld when another run has the directory
            ...
    """

    def __init__(self, directory: str, name: str = LOCK_NAME):
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, name)
        self.took_over: str | None = None  # the warning, when a dead holder's lock was taken over
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, *, warn: bool = True) -> "RunLock":
        """Take the lock or raise RunLockHeld. Taking over a dead holder's lock is logged as a warning
        (with warn=False only recorded in `took_over`, for a caller whose logging is not set up yet)."""
        if self._fd is not None:
            return self
        import fcntl
        os.makedirs(self.directory, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunLockHeld(f"run directory {self.directory} is in use by {_describe(holder)} "
                                      f"(lock {self.path})") from None
                raise RunLockHeld(f"cannot lock run directory {self.directory}: flock on {self.path} failed "
                                  f"({e.strerror}); this file system does not support it") from None
            # The holder before us may have deleted the file between our open and our flock (a clean
            # release): then we locked an orphaned inode, and must lock the file now at the path.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            self._take_over(fd)
            if self.took_over and warn:
                log.warning("%s", self.took_over)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        atexit.register(self.release)
        _HELD.append(self)
        return self

    def _take_over(self, fd: int) -> None:
        """We hold the flock; decide about whatever a previous holder left in the file, then sign it."""
        old = _read(fd)
        me = socket.gethostname()
        if old:
            host, pid = old.get("host"), old.get("pid")
            if host != me:
                raise RunLockHeld(
                    f"run directory {self.directory} is locked by {_describe(old)}, which cannot be checked "
                    f"from host {me}; if that run is over, delete {self.path} and start again")
            why = ("is no longer running" if not isinstance(pid, int) or not pid_alive(pid)
                   else "no longer holds it (its pid now names another process)")
            self.took_over = f"took over the lock on {self.directory}: its holder ({_describe(old)}) {why}"
        info = {"host": me, "pid": os.getpid(),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)

    def release(self) -> None:
        """Delete the file, then drop the lock (in this order: a newcomer that opened the old file checks
        that it is still the one at the path)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        atexit.unregister(self.release)
        if self in _HELD:
            _HELD.remove(self)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> dict:
    """The holder recorded in the lock file ({} when empty; the raw text when not ours)."""
    try:
        raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return {}
    if not raw:
        return {}
    try:
        got = json.loads(raw)
    except ValueError:
        got = None
    return got if isinstance(got, dict) else {"host": "?", "pid": "?", "raw": raw[:200]}


def lock_run_dir(out_dir: str, config_process_id: int | None = None, *, warn: bool = True) -> RunLock | None:
    """Take the run directory's lock in process 0 of the job (None in the others)."""
    if process_index(config_process_id) != 0:
        return None
    return RunLock(out_dir).acquire(warn=warn)
