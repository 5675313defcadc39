"""Progress of a long read or write as INFO lines, one per tenth of its bytes: the release's 852 GB take minutes to
load on every host, and as long to convert. Lines, not a bar, where the output is a file (a job log): a bar
redrawn with carriage returns would be one line there holding every redraw."""

from __future__ import annotations

import logging
import time


def redraws_in_place(stream) -> bool:
    """Whether a progress bar can be redrawn in place on `stream`: a terminal, or a Jupyter kernel's output (no
    terminal, but its cell redraws); not a file or pipe, nor a closed stream."""
    isatty = getattr(stream, "isatty", None)
    try:
        if isatty and isatty():
            return True
    except (OSError, ValueError):  # a closed or detached stream
        return False
    return type(stream).__module__.split(".")[0] == "ipykernel"


class Tenths:
    """Logs "`what`: N% of X GB `done` after T s" each time another tenth of `total` bytes is done."""

    def __init__(self, log: logging.Logger, what: str, done: str, total: int):
        self.log, self.what, self.done_words, self.total = log, what, done, max(total, 1)
        self.done = self.shown = 0
        self.t0 = time.perf_counter()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        tenth = min(10 * self.done // self.total, 10)
        if tenth > self.shown:
            self.shown = tenth
            self.log.info("%s: %d%% of %.1f GB %s after %.0f s", self.what, 10 * tenth, self.total / 1e9,
                          self.done_words, time.perf_counter() - self.t0)
