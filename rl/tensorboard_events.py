"""TensorBoard's event file for the run's metrics, written as metrics.jsonl is: one row at a time, flushed at once.

tensorboardX's SummaryWriter queues events for a thread that writes them to disk up to `flush_secs` (120 s) later: a
run killed hard (SIGKILL, the OOM killer, a lost node) lost its last steps from TensorBoard for good while
metrics.jsonl kept them, the resumed checkpoint's step among them, which the resumed run does not log again (an
audit: steps 1-4 of a 6-step run gone). Here each row is one event, written and flushed by the caller's thread (no
fsync, as metrics.jsonl), so TensorBoard holds what metrics.jsonl holds. The file format is TensorBoard's own
(tensorboardX's protos and record framing); the file is named by the nanosecond and this process, so two writers
never share one (tensorboardX's are named by the second).
"""

from __future__ import annotations

import importlib
import os
import socket
import struct
import time


def _tensorboardx():
    """tensorboardX's protos and record checksum without torch: tensorboardX imports torch at load when it is installed
    (the cpu extras install it for the HF reference), only so that it can log torch tensors, which a run never does;
    that import was 1.6 s of every trainer process's start (-X importtime, 2026-12-01). Unless torch is loaded
    already, the import of tensorboardX sees it as absent."""
    import sys
    if "torch" not in sys.modules and "tensorboardX" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
        try:
            importlib.import_module("tensorboardX")
        finally:
            del sys.modules["torch"]
    from tensorboardX.proto import event_pb2, summary_pb2
    from tensorboardX.record_writer import masked_crc32c
    return event_pb2, summary_pb2, masked_crc32c


class EventFile:
    """One event file in `logdir`. `purge_step` (as tensorboardX's): TensorBoard hides every event of the directory's
    earlier files at a step >= it, the steps a resumed run logs again."""

    def __init__(self, logdir: str, purge_step: int | None = None):
        self._event, self._summary, self._crc = _tensorboardx()
        os.makedirs(logdir, exist_ok=True)
        # TensorBoard reads a directory's files in the order of their names: the nanosecond first sorts them by
        # their start (after a tensorboardX file of the same second: "." sorts before a digit)
        name = f"events.out.tfevents.{time.time_ns()}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "ab")
        Event, SessionLog = self._event.Event, self._event.SessionLog
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # the two events tensorboardX writes for it
            self._write(Event(wall_time=time.time(), step=purge_step, file_version="brain.Event:2"))
            self._write(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self._file.flush()

    def _write(self, event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))  # TFRecord framing: little-endian
        self._file.write(header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event of `values` at `step`, each tagged with its own key: tensorboardX's add_scalar would rename
        val/pass@1 to val/pass_1 (it keeps TF node-name characters only; a tag may hold any)."""
        summary = self._summary.Summary(value=[self._summary.Summary.Value(tag=k, simple_value=v)
                                               for k, v in values.items()])
        self._write(self._event.Event(wall_time=time.time(), step=step, summary=summary))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
