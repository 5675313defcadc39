"""`python -m m3jax.train` on a run directory, or `--export` to a destination, that cannot be written (a read-only
or full filesystem): one `error:` line and exit 1, not a traceback."""

import errno
import os

import pytest

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


def test_a_run_directory_whose_name_is_too_long_leaves_no_directory(tmp_path, capsys):
    """os.makedirs made a/b/c before failing on the last name; the refusal left them (a helper's fuzz)."""
    out = tmp_path / "a" / "b" / "c" / ("x" * 300)
    assert train.main(["--config", CONFIG, f"run.out_dir={out}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: the run directory {out} cannot be written ([Errno 36] File name too long"), err
    assert os.listdir(tmp_path) == []


def test_an_export_to_a_full_disk(tmp_path, monkeypatch, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)

    def full(cfg, dst, step=None):
        raise OSError(errno.ENOSPC, f"{dst}: the checkpoint needs 0.48 GB and its filesystem has 0.07 GB free")
    monkeypatch.setattr("rl.policy.export_latest", full)
    assert train.main(["--config", CONFIG, f"run.out_dir={tmp_path / 'run'}", "--export", str(tmp_path / "ex")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: [Errno 28] {tmp_path / 'ex'}: the checkpoint needs 0.48 GB and its filesystem has " \
                      "0.07 GB free" and "Traceback" not in "\n".join(err)


@pytest.mark.slow  # a one-step tiny run to export (~20 s)
def test_an_export_reads_a_run_directory_it_cannot_write(tmp_path, monkeypatch, capsys):
    """A finished run on a read-only mount can still be exported: no lock, log, cache or checkpoint change in the
    run directory (checked on a real read-only tmpfs too, BENCHMARKS.md session 36)."""
    import subprocess
    import sys

    from safetensors.numpy import load_file
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-m", "m3jax.train", "--config", CONFIG, f"run.out_dir={run}",
                        "run.total_steps=1", "logging.progress_bar=false", "eval.at_start=false",
                        "eval.every_steps=0"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    before = sorted((os.path.relpath(os.path.join(d, f), run), os.stat(os.path.join(d, f)).st_mtime_ns)
                    for d, _, files in os.walk(run) for f in files)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(run / ".lock"))
    monkeypatch.setattr("rl.run_lock.lock_run_dir", read_only)
    assert train.main(["--config", CONFIG, f"run.out_dir={run}", "--export", str(tmp_path / "ex")]) == 0
    assert capsys.readouterr().out == f"exported step 1 to {tmp_path / 'ex'}\n"
    after = sorted((os.path.relpath(os.path.join(d, f), run), os.stat(os.path.join(d, f)).st_mtime_ns)
                   for d, _, files in os.walk(run) for f in files)
    assert after == before
    exported, saved = load_file(str(tmp_path / "ex" / "model.safetensors")), load_file(str(run / "export" /
                                                                                            "model.safetensors"))
    assert sorted(exported) == sorted(saved) and all((exported[k] == saved[k]).all() for k in saved)
