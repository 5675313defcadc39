"""Multi-host: two CPU processes joined with jax.distributed run the sharded model like one (from
MeshConfig), and a GRPO step launched from the YAML config with the launcher's environment only."""

import os
import socket
import subprocess
import sys

import json

import jax
import numpy as np
import pytest
from flax import nnx

import m3jax
from sharding.mesh import MeshConfig, distributed_args
from tests import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_mesh_equals_single_device(tmp_path):
    ckpt = ref.save(ref.build_model(ref.tiny_config("release_like"), seed=3), str(tmp_path / "ckpt"))
    port = free_port()
    out = tmp_path / "logits.npy"
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/workers/multihost_forward.py"), ckpt,
                               str(port), str(i), str(out)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    model = m3jax.from_pretrained(ckpt)
    ids = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (4, 64)).astype(np.int32)
    want = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
    got = np.load(out)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5


@pytest.mark.parametrize("mesh, env, want", [
    (MeshConfig(), {}, None),
    (MeshConfig(coordinator_address="h0:1234", num_processes=16, process_id=3), {"JAX_PROCESS_ID": "9"},
     {"coordinator_address": "h0:1234", "num_processes": 16, "process_id": 3}),  # the config wins
    (MeshConfig(), {"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "16", "JAX_PROCESS_ID": "5"},
     {"coordinator_address": "h0:1234", "num_processes": 16, "process_id": 5}),
    (MeshConfig(), {"SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16"}, {}),  # srun step: jax detects the rest
    (MeshConfig(), {"SLURM_NTASKS": "16"}, None),  # a batch script run once: no peers to wait for
    (MeshConfig(), {"OMPI_COMM_WORLD_SIZE": "2"}, {}),
])
def test_distributed_args_from_config_then_environment(mesh, env, want):
    assert distributed_args(mesh, env) == want


def test_two_hosts_train_from_the_yaml_config(tmp_path):
    """Every host runs `python -m m3jax.train` with the same config; only the launcher's environment
    differs. One GRPO step, then the run's checkpoint, metrics, HF export and curves, written once."""
    port = free_port()
    run = tmp_path / "run"
    overrides = ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2", "grpo.prompts_per_step=4", "grpo.group_size=2",
                 "grpo.micro_batch_size=2", "run.total_steps=1", f"run.out_dir={run}", "logging.progress_bar=false"]
    out = str(tmp_path / "out")
    procs = []
    for i in range(2):
        env = {**os.environ, "PYTHONPATH": ROOT, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}
        env.pop("XLA_FLAGS", None)
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/workers/multihost_train.py"), out,
                                       "--config", os.path.join(ROOT, "configs/tiny.yaml"), *overrides], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    done = [[line for line in log.splitlines() if line.startswith("done:")] for log in logs]
    assert done[0] and done[0] == done[1]  # one global step: the same last reward on both hosts
    for i in range(2):
        host = json.load(open(f"{out}.{i}.json"))
        assert host == {"rc": 0, "processes": 2, "devices": 8, "data_row_owners": [[0], [1]]}  # a data row per host
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]  # written by process 0 only (step 0: the evaluation of the initial policy)
    assert (run / "checkpoints" / "1").is_dir() and (run / "curves.png").exists()
    exported = m3jax.from_pretrained(str(run / "export"))
    assert all(np.isfinite(np.asarray(v)).all() for _, v in nnx.to_flat_state(nnx.state(exported)))
