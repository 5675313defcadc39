"""Run settings that were never checked: run.out_dir with a ~ (a literal ./~ directory was made),
run.compilation_cache where no directory can be made (JAX warned at every compile and ran on), mesh.process_id
without a multi-host job (the log went to run.5.log and nobody took the run's lock)."""

import os

import pytest

from m3jax import train
from rl.config import load_config
from tests.test_run_config import TINY

JOB_ENV = ("JAX_NUM_PROCESSES", "JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID", "SLURM_STEP_NUM_TASKS",
           "OMPI_COMM_WORLD_SIZE", "JAX_COMPILATION_CACHE_DIR")


@pytest.fixture
def single(monkeypatch):
    for k in JOB_ENV:
        monkeypatch.delenv(k, raising=False)


def test_a_tilde_in_out_dir_and_the_cache_is_the_home_directory():
    cfg = load_config(TINY, ["run.out_dir=~/runs/${name}", "run.compilation_cache=~/xla"], check_paths=False)
    assert cfg.run.out_dir == os.path.expanduser("~/runs/tiny") and not cfg.run.out_dir.startswith("~")
    assert cfg.run.compilation_cache == os.path.expanduser("~/xla")


def test_a_cache_directory_that_cannot_be_made_is_refused(tmp_path, single, capsys):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "run"
    assert train.main(["--config", str(TINY), f"run.out_dir={out}", f"run.compilation_cache={tmp_path}/afile/c"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"config error: run.compilation_cache = {tmp_path}/afile/c: {tmp_path}/afile/c cannot "
                              "be created (Not a directory); expected a directory"), err
    assert not out.exists()  # refused before the first step: the run directory it made is gone again


def test_a_process_id_without_a_job_is_refused(tmp_path, single, capsys):
    out = tmp_path / "run"
    assert train.main(["--config", str(TINY), f"run.out_dir={out}", "mesh.process_id=5"]) == 2
    assert "mesh.process_id = 5 in a single-process run" in capsys.readouterr().err
    assert not out.exists()


def test_a_process_id_of_a_launched_job_is_left_to_it(monkeypatch, single):
    cfg = load_config(TINY, ["mesh.process_id=3"], check_paths=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    assert train._process_problem(cfg.mesh) is None


def test_draw_ahead_with_the_jax_engine_in_a_multi_host_job_is_refused(monkeypatch, single):
    """A two-host run with grpo.max_trajectory_age_steps 1 died in gloo at the first overlap of a draw and a step
    ("distributed collective mismatch"); with the JAX engine, whose generation spans every process, refused before
    the job starts. The vLLM pool's draw runs on process 0 alone (rl.shared_draw): allowed."""
    cfg = load_config(TINY, ["grpo.max_trajectory_age_steps=1"], check_paths=False)
    assert train._ahead_problem(cfg, {}) is None  # one process: allowed
    for env in ({"SLURM_STEP_NUM_TASKS": "2"}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}):
        assert 'grpo.max_trajectory_age_steps = 1 with generation.backend = "jax" in a multi-host job' in \
            train._ahead_problem(cfg, env)
    assert train._ahead_problem(load_config(TINY, [], check_paths=False), {"SLURM_STEP_NUM_TASKS": "2"}) is None
    vllm = load_config(TINY, ["grpo.max_trajectory_age_steps=1", "generation.backend=vllm"], check_paths=False)
    assert train._ahead_problem(vllm, {"SLURM_STEP_NUM_TASKS": "2"}) is None


@pytest.mark.parametrize("overrides, env, missing", [
    (["mesh.num_processes=2", "mesh.data=2", "grpo.micro_batch_size=128"], {},
     "coordinator_address (mesh.coordinator_address or $JAX_COORDINATOR_ADDRESS) and process_id (mesh.process_id or "
     "$JAX_PROCESS_ID) are not set"),
    (["mesh.coordinator_address=h0:1234"], {}, "num_processes (mesh.num_processes or $JAX_NUM_PROCESSES) and "),
    ([], {"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "2"},
     "process_id (mesh.process_id or $JAX_PROCESS_ID) is not set"),
])
def test_a_job_described_in_part_is_one_error_before_jax_starts(tmp_path, single, monkeypatch, capsys, overrides, env,
                                                                 missing):
    """Each of these stopped the process with jax's ValueError traceback ("coordinator_address should be defined",
    "Number of processes must be defined", "The process id of the current process must be defined")."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    assert train.main(["--config", str(TINY), f"run.out_dir={out}", *overrides]) == 2
    err = capsys.readouterr().err
    assert "config error:\na multi-host job is described (" in err and missing in err, err
    assert not out.exists()
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")  # an srun step gives jax the rest itself: left to it
    assert train._process_problem(load_config(TINY, overrides, check_paths=False).mesh) is None
