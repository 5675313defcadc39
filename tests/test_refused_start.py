"""A start of `python -m m3jax.train` refused for bad input found while the run is built (the mesh, the prompt
file, the model, the export destination) leaves the run directory as it found it: one it created is gone again,
an existing one keeps its entries and run.log its length. It left <out_dir>/run.log (and checkpoints/) behind."""

import os

import pytest

from m3jax import train
from rl.data import DatasetError
from rl.refused_start import RunDirBefore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")


def refuse(monkeypatch):
    def bad_prompts(cfg, **kwargs):
        os.makedirs(os.path.join(cfg.run.out_dir, "checkpoints"), exist_ok=True)  # as the trainer's build does
        raise DatasetError("p.jsonl", "missing field 'answer' (the answer)", row=3)
    monkeypatch.setattr("rl.trainer.GRPOTrainer", bad_prompts)


def test_a_refused_start_removes_the_directory_it_created(tmp_path, monkeypatch, capsys):
    refuse(monkeypatch)
    out = tmp_path / "runs" / "tiny"
    assert train.main(["--config", CONFIG, f"run.out_dir={out}"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "error: p.jsonl, row 3: missing field 'answer' (the answer)"
    assert os.listdir(tmp_path) == []  # runs/ too: this start created it


def test_a_refused_start_leaves_an_existing_directory_as_it_was(tmp_path, monkeypatch, capsys):
    refuse(monkeypatch)
    (tmp_path / "run.log").write_text("an earlier run's log\n")
    (tmp_path / "notes.txt").write_text("mine")
    assert train.main(["--config", CONFIG, f"run.out_dir={tmp_path}"]) == 1
    assert "missing field 'answer'" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "run.log"]
    assert (tmp_path / "run.log").read_text() == "an earlier run's log\n"


def test_a_refused_start_in_another_process_removes_only_its_own_log(tmp_path):
    (tmp_path / "run").mkdir()
    before = RunDirBefore(str(tmp_path / "run"), "run.1.log")
    (tmp_path / "run" / "run.1.log").write_text("x")
    (tmp_path / "run" / "checkpoints").mkdir()
    before.undo(owner=False)
    before.remove_created()
    assert os.listdir(tmp_path / "run") == ["checkpoints"]  # process 0's to remove


@pytest.mark.parametrize("exists", [False, True])
def test_the_lock_file_is_left_to_the_lock(tmp_path, exists):
    run = tmp_path / "run"
    if exists:
        run.mkdir()
    before = RunDirBefore(str(run), "run.log")
    run.mkdir(exist_ok=True)
    (run / ".lock").write_text("held")
    (run / "run.log").write_text("x")
    before.undo(owner=True)
    assert os.listdir(run) == [".lock"]
    before.remove_created()  # the lock still there: nothing removed
    assert run.is_dir()


def test_a_start_refused_after_the_checkpointer_opened_waits_for_its_cleanup_before_the_undo(tmp_path, monkeypatch,
                                                                                            capfd):
    """The checkpointer removes unfinished saves in a background thread (orbax's cleanup_tmp_directories). A start
    refused after it opened (here: a mesh larger than the machine) removed the run directory under that thread, which
    then printed a 40-line traceback after the error line (seen once in a loaded suite run; delayed here)."""
    import asyncio
    import threading

    from orbax.checkpoint._src.path import async_path, temporary_paths
    listing = async_path.iterdir

    async def slow_listing(path, *args, **kwargs):
        # between the thread's check that the directory exists and its listing: the undo, unless waited for
        await asyncio.sleep(1.0)
        return await listing(path, *args, **kwargs)

    monkeypatch.setattr(temporary_paths.async_path, "iterdir", slow_listing)
    before = set(threading.enumerate())
    out = tmp_path / "run"
    assert train.main(["--config", CONFIG, f"run.out_dir={out}", "mesh.data=2", "grpo.micro_batch_size=128"]) == 1
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=10)
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: mesh data x context"), err
    assert not out.exists()
