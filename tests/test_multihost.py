"""Two CPU processes joined with jax.distributed (from MeshConfig) run the sharded model like one."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np

import m3jax
from tests import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_process_mesh_equals_single_device(tmp_path):
    ckpt = ref.save(ref.build_model(ref.tiny_config("release_like"), seed=3), str(tmp_path / "ckpt"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
