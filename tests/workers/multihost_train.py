"""One host of a 2-process CPU "cluster" launched the way every host of a real job is:

    JAX_COORDINATOR_ADDRESS=... JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i \\
        python multihost_train.py OUT --config CONFIG [k=v ...]

runs `python -m m3jax.train --config CONFIG [k=v ...]` in this process (the trainer joins the job from
the launcher's environment when it builds its mesh), then writes OUT.<process index>.json with the
job's size and which process owns each data row of the mesh.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"  # 4 "GPUs" per host; -O0: see conftest.py
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

from m3jax import train  # noqa: E402
from rl.config import load_config  # noqa: E402
from sharding.mesh import build_mesh  # noqa: E402


def main(out, flag, config, *overrides):
    assert flag == "--config"
    rc = train.main([flag, config, *overrides])
    mesh = build_mesh(load_config(config, list(overrides)).mesh.to_mesh_config())
    owners = [sorted({d.process_index for d in row.flat}) for row in mesh.mesh.devices]
    with open(f"{out}.{jax.process_index()}.json", "w") as f:
        json.dump({"rc": rc, "processes": jax.process_count(), "devices": len(jax.devices()),
                   "data_row_owners": owners}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
