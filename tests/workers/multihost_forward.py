"""One process of a 2-process CPU "cluster": python multihost_forward.py CKPT PORT PROCESS_ID OUT [--refused].

--refused: the load must raise CheckpointError; the process prints its message and exits 0 (3 if it loaded).
--export DIR: also write the loaded model to DIR with `m3jax.save_pretrained` (every process, as on a cluster);
--export-fails-on P: process P's disk is full (its writes raise ENOSPC);
--export-released DIR SRC: also write it in the released layout, carrying SRC's vision tower.
--tune DIR: only choose the expert kernel by timing (timings faked per process, process 0's favouring tiled,
process 1's ragged_dot, bucketed second for both), recording it in DIR; print the choice and how many timings this
process ran. Then for other shapes where tiled fails on process 1, and where nothing runs on process 1: print the
choice, or what each process raised."""

import logging
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"  # -O0: see conftest.py
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import m3jax  # noqa: E402
from sharding.mesh import MeshConfig, build_mesh  # noqa: E402


def main(ckpt, port, process_id, out, *flags):
    cfg = MeshConfig(2, 2, 2, 1, coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                     process_id=int(process_id))
    mesh = build_mesh(cfg, seq_len=64)
    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    logging.basicConfig(level=logging.INFO)  # the load's line of bytes read, for the test to check
    if "--tune" in flags:
        return tune(mesh, flags[flags.index("--tune") + 1], int(process_id))
    if "--refused" in flags:
        try:
            m3jax.from_pretrained(ckpt, mesh=mesh)
        except m3jax.CheckpointError as e:
            print(f"REFUSED: {e}", flush=True)
            return 0
        return 3
    model = m3jax.from_pretrained(ckpt, mesh=mesh)
    if "--export-fails-on" in flags and int(process_id) == int(flags[flags.index("--export-fails-on") + 1]):
        from m3jax.hf.safetensors_io import StreamingWriter

        def full(self, name, array):
            raise OSError(28, "No space left on device")
        StreamingWriter.write = full
    if "--export" in flags:
        m3jax.save_pretrained(model, flags[flags.index("--export") + 1], max_shard_size="200KB")
    if "--export-released" in flags:  # DIR SRC: the released layout, carrying SRC's vision tower (process 0 writes it)
        at = flags.index("--export-released")
        m3jax.save_pretrained(model, flags[at + 1], layout="released", max_shard_size="200KB", carry_from=flags[at + 2])
    ids = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (4, 64)).astype(np.int32)
    with jax.set_mesh(mesh.mesh):
        logits = jax.jit(lambda m, x: m(x))(model, ids)
    full = multihost_utils.process_allgather(logits, tiled=True)
    if jax.process_index() == 0:
        np.save(out, np.asarray(full))


def tune(mesh, directory, process_id):
    from m3jax import tiny
    from m3jax.model import expert_tuning
    from sharding import kernel_tuning
    timed = []
    fake = [{"tiled": 1.0, "ragged_dot": 6.0, "bucketed": 3.0}, {"ragged_dot": 1.0, "tiled": 6.0, "bucketed": 3.0}]

    def time_expert_kernels(*args, **kwargs):
        timed.append(args[1])
        return kernel_tuning.Timings(fake[process_id], {}, {})
    expert_tuning.time_expert_kernels = time_expert_kernels
    cfg = tiny.m3_config()
    work = expert_tuning.expert_work(cfg, mesh, 2, 64, "float32")
    choice = expert_tuning.tune_moe_kernel(cfg, work, os.path.join(directory, expert_tuning.RECORD_FILE))
    print(f"TUNED: {choice} after {len(timed)} timings", flush=True)
    fake[:] = [{"tiled": 1.0, "ragged_dot": 2.0}, {"ragged_dot": 2.0}]  # tiled failed on process 1
    choice = expert_tuning.tune_moe_kernel(cfg, expert_tuning.expert_work(cfg, mesh, 1, 64, "float32"))
    print(f"RAN EVERYWHERE: {choice}", flush=True)
    fake[:] = [{"tiled": 1.0}, {}]  # nothing runs on process 1: it must still join the gather the other waits in
    try:
        expert_tuning.tune_moe_kernel(cfg, expert_tuning.expert_work(cfg, mesh, 1, 32, "float32"))
    except RuntimeError as e:
        print(f"NO KERNEL: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
