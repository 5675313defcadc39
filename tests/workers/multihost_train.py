"""One host of a 2-process CPU "cluster" launched the way every host of a real job is:

    JAX_COORDINATOR_ADDRESS=... JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i \\
        python multihost_train.py OUT --config CONFIG [k=v ...]

runs `python -m m3jax.train --config CONFIG [k=v ...]` in this process (the trainer joins the job from
the launcher's environment when it builds its mesh), then writes OUT.<process index>.json with the
job's size, which process owns each data row of the mesh and the shapes of the arrays jax compared across
the processes (`record_compared_values`), and exits with the command's status.

With M3JAX_TEST_POOL=fake (and generation.backend=vllm) process 0's vLLM pool is `FakeEnginePool`: no vLLM, the
multi-host wrapper and everything around it as in a real job.

M3JAX_TEST_METRICS_FAIL=<step>: process 0's write of that step's metrics row fails (ENOSPC); 0: its opening of them.

M3JAX_TEST_SAVE_FAILS=<process>[:<step>]: that process's write of checkpoint <step> (of every checkpoint without it)
fails (a disk full on that host only), the way a failed TensorStore commit does, whether the save is synchronous or
async.
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


class FakeEnginePool:
    """What rl.generation.multihost.ProcessZeroPool uses of a VLLMPool, without engines: each response is drawn from
    the prompt, the request key and the weight version (tokens in [3, vocab), logprob -1 each)."""

    def __init__(self, vocab_size):
        self.vocab_size, self.version, self.resent_rows, self.restarts = vocab_size, 0, 0, 0

    def generate(self, prompts, params, key, prompt_width=None):
        import numpy as np
        from rl.generation.base import Rollout
        seed = int(np.asarray(jax.random.key_data(key)).sum()) + self.version
        t = params.max_new_tokens
        rows = [np.random.default_rng([seed, *p]).integers(3, self.vocab_size, t) for p in prompts]
        return Rollout([list(p) for p in prompts], np.stack(rows).astype(np.int32), np.full((len(rows), t), -1.0,
                       np.float32), np.full(len(rows), t, np.int32), np.ones(len(rows), bool), self.version)

    def push(self, tensors, version):
        from rl.generation.transfer import TransferStats
        count = sum(1 for _ in tensors)
        self.version = version
        return TransferStats(version, 0, 0, count, 0.0, 0.0, 0.0, 0.0)

    def shutdown(self):
        pass


def fake_generator(cfg, graphdef, state, *, pad_id, run_dir):
    from rl.generation.multihost import ProcessZeroPool
    zero = jax.process_index() == 0
    vocab = cfg.model.m3_config().vocab_size
    return ProcessZeroPool(FakeEnginePool(vocab) if zero else None, graphdef, is_zero=zero)


def fail_saves(process: int, step: int | None = None) -> None:
    """Process `process`'s write of checkpoint `step` (None: of each) ends in ENOSPC once its other writes have: a
    failing commit future, which a synchronous save waits for in its handler and an async one in orbax's thread."""
    import errno

    import orbax.checkpoint as ocp

    class DiskFull:
        def result(self, timeout=None):
            raise OSError(errno.ENOSPC, "No space left on device (test)")

    write = ocp.CompositeCheckpointHandler.async_save

    async def async_save(self, directory, *args, **kwargs):
        futures = await write(self, directory, *args, **kwargs)
        if jax.process_index() == process and step in (None, int(directory.name.split(".")[0])):
            return [*(futures or []), DiskFull()]
        return futures
    ocp.CompositeCheckpointHandler.async_save = async_save


def fail_metrics(step: int) -> None:
    """Process 0's write of step `step`'s metrics row ends in ENOSPC (its disk full); the other processes write none.
    Step 0: the opening of the run's outputs (RunLogger's) fails."""
    import errno

    from rl.observe import RunLogger

    write, start = RunLogger.log, RunLogger.__init__

    def init(self, run_dir, **kwargs):
        if step == 0 and jax.process_index() == 0:
            raise OSError(errno.ENOSPC, "No space left on device (test)", "metrics.jsonl")
        start(self, run_dir, **kwargs)
    RunLogger.__init__ = init

    def log(self, at, metrics, advance=True):
        if at == step and jax.process_index() == 0:
            raise OSError(errno.ENOSPC, "No space left on device (test)", "metrics.jsonl")
        return write(self, at, metrics, advance)
    RunLogger.log = log


def record_compared_values() -> list:
    """The shapes of the values jax compares across the processes (`multihost_utils.assert_equal`, which
    jax.device_put runs on a host value placed over several processes: every process gathers the whole value from
    every other), scalars left out (the few agreements and step counts)."""
    from jax.experimental import multihost_utils
    compared, check = [], multihost_utils.assert_equal

    def assert_equal(value, *args, **kwargs):
        if int(getattr(value, "size", 1)) > 1:
            compared.append(list(value.shape))
        return check(value, *args, **kwargs)
    multihost_utils.assert_equal = assert_equal
    return compared


def main(out, flag, config, *overrides):
    assert flag == "--config"
    compared = record_compared_values()
    if os.environ.get("M3JAX_TEST_POOL") == "fake":
        from rl.generation import backends
        backends.make_generator = fake_generator
    if os.environ.get("M3JAX_TEST_METRICS_FAIL"):
        fail_metrics(int(os.environ["M3JAX_TEST_METRICS_FAIL"]))
    if os.environ.get("M3JAX_TEST_SAVE_FAILS"):
        fail_saves(*map(int, os.environ["M3JAX_TEST_SAVE_FAILS"].split(":")))
    rc = train.main([flag, config, *overrides])
    # not when refused before it joined the job, nor when its config was refused (it joined to say so)
    if jax.distributed.is_initialized() and rc != 2:
        mesh = build_mesh(load_config(config, list(overrides)).mesh.to_mesh_config())
        owners = [sorted({d.process_index for d in row.flat}) for row in mesh.mesh.devices]
        with open(f"{out}.{jax.process_index()}.json", "w") as f:
            json.dump({"rc": rc, "processes": jax.process_count(), "devices": len(jax.devices()),
                       "data_row_owners": owners, "compared_across_hosts": compared}, f)
    sys.exit(rc)  # the command's exit status


if __name__ == "__main__":
    main(*sys.argv[1:])
