"""`python -m m3jax.train` on a run directory, or `--export` to a destination, that cannot be written (a read-only
or full filesystem): one `error:` line and exit 1, not a traceback."""

import errno
import os

from m3jax import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")


def test_a_run_directory_that_cannot_be_written(tmp_path, monkeypatch, capsys):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "run" / ".lock"))
    monkeypatch.setattr("rl.run_lock.lock_run_dir", read_only)
    assert train.main(["--config", CONFIG, f"run.out_dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: the run directory {tmp_path / 'run'} cannot be written ([Errno 30] Read-only file "
                   f"system: '{tmp_path / 'run' / '.lock'}')\n")


def test_an_export_to_a_full_disk(tmp_path, monkeypatch, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)

    def full(cfg, dst):
        raise OSError(errno.ENOSPC, f"{dst}: the checkpoint needs 0.48 GB and its filesystem has 0.07 GB free")
    monkeypatch.setattr("rl.policy.export_latest", full)
    assert train.main(["--config", CONFIG, f"run.out_dir={tmp_path / 'run'}", "--export", str(tmp_path / "ex")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: [Errno 28] {tmp_path / 'ex'}: the checkpoint needs 0.48 GB and its filesystem has " \
                      "0.07 GB free" and "Traceback" not in "\n".join(err)
