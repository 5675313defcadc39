"""What a start of `python -m m3jax.train` found in its run directory, so that a start refused for bad input (the
mesh, a prompt file, the model's weights, the export destination: found only once the run is being built) leaves
the directory as it was: a directory it created is removed again, and in an existing one its new entries go and
run.log is cut back to its former length. A run that trained a step, or crashed, keeps everything it wrote.

Pure Python, like rl.run_lock: it is set up before the heavy imports."""

from __future__ import annotations

import errno
import os
import shutil

from rl.run_lock import LOCK_NAME


class RunDirBefore:
    def __init__(self, out_dir: str, log_name: str):
        self.directory = os.path.abspath(out_dir)
        self.created = None  # the outermost directory this start will create (a parent of the run's, or itself)
        path = self.directory
        while not os.path.exists(path):
            self.created, path = path, os.path.dirname(path)
        self.entries = set() if self.created else set(_listdir(self.directory))
        self.log = os.path.join(self.directory, log_name)
        self.log_size = os.path.getsize(self.log) if os.path.isfile(self.log) else None

    def undo(self, owner: bool) -> None:
        """Remove what this start wrote. owner: this process holds the run's lock (process 0 of a job), and removes
        the new entries; another process only its own log. The lock file is the lock's own to remove (release)."""
        try:
            if self.log_size is None:
                os.unlink(self.log)
            else:
                os.truncate(self.log, self.log_size)
        except OSError:  # none written (a read-only directory), or already gone
            pass
        if not owner:
            return
        for name in set(_listdir(self.directory)) - self.entries - {LOCK_NAME}:
            path = os.path.join(self.directory, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def remove_created(self) -> None:
        """After the lock's release: the directories this start created, where they are empty (rmdir leaves one
        that another process wrote into since)."""
        if self.created is None:
            return
        path = self.directory
        while True:
            try:
                os.rmdir(path)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENAMETOOLONG):  # those were never made: os.makedirs stopped
                    return                                             # above them (a name too long for the disk)
            if path == self.created:
                return
            path = os.path.dirname(path)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
