"""One host of a 2-process CPU "cluster" running a GRPO step from the YAML config:

    JAX_COORDINATOR_ADDRESS=... JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i python multihost_train.py OUT CONFIG [k=v ...]

exactly what every host of a real launch runs, less the loop: the trainer joins the job from the
launcher's environment when it builds its mesh. Writes OUT.<process index>.json with the step's
metrics and which process owns each row of the mesh.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # 4 "GPUs" per host
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

from rl.config import load_config  # noqa: E402
from rl.trainer import GRPOTrainer  # noqa: E402


def main(out, config, *overrides):
    trainer = GRPOTrainer(load_config(config, list(overrides)))
    metrics = trainer.step(0)
    owners = [sorted({d.process_index for d in row.flat}) for row in trainer.mesh.devices]
    timing = ("time/", "throughput/")  # differ between hosts; everything else is one global step
    with open(f"{out}.{jax.process_index()}.json", "w") as f:
        json.dump({"processes": jax.process_count(), "devices": len(jax.devices()), "data_row_owners": owners,
                   "metrics": {k: float(v) for k, v in metrics.items() if not k.startswith(timing)}}, f)

if __name__ == "__main__":
    main(*sys.argv[1:])
