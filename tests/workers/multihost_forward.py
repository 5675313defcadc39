"""One process of a 2-process CPU "cluster": python multihost_forward.py CKPT PORT PROCESS_ID OUT."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"  # -O0: see conftest.py
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import m3jax  # noqa: E402
from sharding.mesh import MeshConfig, build_mesh  # noqa: E402


def main(ckpt, port, process_id, out):
    cfg = MeshConfig(2, 2, 2, 1, coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                     process_id=int(process_id))
    mesh = build_mesh(cfg, seq_len=64)
    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    model = m3jax.from_pretrained(ckpt, mesh=mesh)
    ids = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (4, 64)).astype(np.int32)
    with jax.set_mesh(mesh.mesh):
        logits = jax.jit(lambda m, x: m(x))(model, ids)
    full = multihost_utils.process_allgather(logits, tiled=True)
    if jax.process_index() == 0:
        np.save(out, np.asarray(full))


if __name__ == "__main__":
    main(*sys.argv[1:])
