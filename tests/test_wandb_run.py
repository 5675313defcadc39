"""The W&B mirror of the metrics (`logging.wandb_project`, rl/wandb_run.py): what reaches wandb.init and log, the run
id kept across a resume, the config's refusal without the package, and a real offline run of the tiny trainer."""

import glob
import importlib.machinery
import importlib.util
import math
import os
import sys
import types

import pytest

from rl.observe import RunLogger
from rl.wandb_run import ID_FILE, run_id, scalars


class FakeRun:
    def __init__(self, **kwargs):
        self.init, self.rows, self.finished = kwargs, [], False

    def log(self, row, step):
        self.rows.append((step, row))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    runs = []

    def init(**kwargs):
        runs.append(FakeRun(**kwargs))
        return runs[-1]

    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # what the config's find_spec("wandb") reads
    module.init = init
    module.Settings = dict  # what open_run hands to init as settings
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def _cfg(tmp_path, *overrides):
    from rl.config import load_config
    from tests.tiny_runs import TINY
    return load_config(str(TINY), [f"run.out_dir={tmp_path}", "logging.wandb_project=m3jax-tests", *overrides])


def test_the_logger_mirrors_each_row_and_a_resume_continues_the_same_run(tmp_path, fake_wandb):
    from rl.wandb_run import open_run
    cfg = _cfg(tmp_path, "logging.wandb_entity=lab", "logging.wandb_mode=offline", "run.name=exp1")
    logger = RunLogger(str(tmp_path), tensorboard=False, progress_bar=False, open_wandb=lambda: open_run(str(tmp_path),
                                                                                                        cfg))
    logger.log(0, {"val/pass@1": 0.0}, advance=False)
    logger.log(1, {"reward/mean": 0.5, "loss": float("nan"), "note": "text", "time/step": 0.1})
    logger.close()
    (run,) = fake_wandb
    rid = (tmp_path / ID_FILE).read_text().strip()
    assert len(rid) == 12 and set(rid) <= set("0123456789abcdef")
    assert {k: run.init[k] for k in ("project", "entity", "mode", "name", "id", "resume", "dir")} == {
        "project": "m3jax-tests", "entity": "lab", "mode": "offline", "name": "exp1", "id": rid, "resume": "allow",
        "dir": str(tmp_path)}
    assert run.init["config"]["grpo"]["group_size"] == cfg.grpo.group_size  # the resolved config
    assert run.rows[0] == (0, {"val/pass@1": 0.0})
    step, row = run.rows[1]
    assert step == 1 and set(row) == {"reward/mean", "loss", "time/step"} and math.isnan(row["loss"])
    assert run.finished
    # the next start in this directory (a resume) continues the same W&B run
    RunLogger(str(tmp_path), tensorboard=False, progress_bar=False, open_wandb=lambda: open_run(str(tmp_path),
                                                                                              cfg)).close()
    assert fake_wandb[1].init["id"] == rid


def test_run_id_is_made_once_and_scalars_keep_numbers(tmp_path):
    made = iter(["a1", "b2"])
    assert run_id(str(tmp_path), lambda: next(made)) == "a1"
    assert run_id(str(tmp_path), lambda: next(made)) == "a1"
    assert os.listdir(tmp_path) == [ID_FILE]  # no temporary file left
    assert scalars({"a": 1.0, "b": "x", "c": [1.0], "d": float("inf")}) == {"a": 1.0, "d": float("inf")}


def test_the_config_refuses_the_option_without_the_package(tmp_path, monkeypatch):
    from rl.config import ConfigError
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="logging.wandb_project.*wandb package is not installed"):
        _cfg(tmp_path)
    with pytest.raises(ConfigError, match="logging.wandb_mode"):
        _cfg(tmp_path, "logging.wandb_mode=local")


@pytest.mark.slow  # two short runs of the tiny trainer with the real wandb, offline
def test_an_offline_run_and_its_resume_write_one_wandb_run(tmp_path, capfd):
    pytest.importorskip("wandb", reason="the wandb package (the cpu extra) is not installed")
    from rl.config import load_config
    from rl.trainer import GRPOTrainer
    from tests.tiny_runs import TINY

    def run(steps):
        cfg = load_config(str(TINY), [f"run.out_dir={tmp_path}", "grpo.prompts_per_step=4", "grpo.group_size=4",
                                      "grpo.micro_batch_size=16", "logging.tensorboard=false",
                                      "logging.progress_bar=false", "logging.plot=false", "eval.every_steps=0",
                                      "checkpoint.every_steps=1", "checkpoint.export_hf_at_end=false",
                                      f"run.total_steps={steps}", "logging.wandb_project=m3jax-tests",
                                      "logging.wandb_mode=offline"])
        GRPOTrainer(cfg).run()

    run(1)
    run(2)  # resumes from the step-1 checkpoint
    rid = (tmp_path / ID_FILE).read_text().strip()
    files = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / f"run-{rid}.wandb")))
    assert len(files) == 2 and all(os.path.getsize(f) > 0 for f in files)  # one W&B run id, written twice
    assert "Run history" not in "".join(capfd.readouterr())  # W&B's closing tables stay off the terminal
