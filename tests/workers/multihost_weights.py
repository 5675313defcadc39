"""One process of a 2-process CPU trainer pushing weights on the collective path, each process sending the
tensors its own devices hold (m3jax.hf.owned) through its own weight group:

    python multihost_weights.py CKPT PORT PROCESS_ID OUT

Process 0 also runs Ray and two stand-in engines of tests/test_weight_transfer_protocol.py: the dict engine
(receives everything) and an expert-parallel engine whose two workers hold half of the experts each and read
half of the embedding, the lm_head and the attention projections (three routes, so three groups per sender; the
boxes reach process 1 in the slices table process 0 agrees with it). It pushes versions 1 and 2 (the second reuses the groups) and writes
what each receiver applied to OUT.engine<i>.npz; every process writes the names and bytes it sent to
OUT.<process>.json.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"  # -O0: see conftest.py
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import m3jax  # noqa: E402
from m3jax.hf import layouts  # noqa: E402
from m3jax.hf.owned import owned_hf_tensors  # noqa: E402
from rl.generation.bucket_sender import RoutedSender  # noqa: E402
from rl.generation.multihost import JaxPeers, follow_push  # noqa: E402
from sharding.mesh import MeshConfig, build_mesh  # noqa: E402

BUCKET = 1 << 16


def main(ckpt, port, process_id, out):
    # data 2 spans the two processes: dense weights are FSDP-sharded across them, each expert sits on one device
    cfg = MeshConfig(2, 1, 4, 1, coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                     process_id=int(process_id))
    mesh = build_mesh(cfg, seq_len=64)
    model = m3jax.from_pretrained(ckpt, mesh=mesh)
    me, peers = jax.process_index(), JaxPeers()
    sent = {name: int(a.nbytes) for name, a in owned_hf_tensors(model, "released")}
    with open(f"{out}.{me}.json", "w") as f:
        json.dump(sent, f)
    if me == 0:
        import ray

        from rl.generation.collective import CollectiveTransport
        from tests.test_weight_transfer_protocol import DictEngine, RayExecutorEngine, row_halves

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        dtype = np.dtype(model.dtype)
        manifest = [(s.name, np.empty(s.shape, dtype)) for s in layouts.slots(model.cfg, "released")]
        half = model.cfg.num_local_experts // 2
        experts = (list(range(half)), list(range(half, model.cfg.num_local_experts)))
        boxes = row_halves({n: a.shape for n, a in manifest})  # and each worker its TP rank's half of some tensors
        engines = [ray.remote(DictEngine).remote(manifest),
                   ray.remote(RayExecutorEngine).remote(manifest, experts, boxes)]
        transport = CollectiveTransport(engines, BUCKET, timeout_s=120, peers=peers)
        stats = [transport.push(owned_hf_tensors(model, "released"), v) for v in (1, 2)]
        states = [s for e in engines for s in ray.get(e.states.remote())]  # the dict engine, then 2 workers
        assert [v for v, _ in states] == [2, 2, 2] and stats[1].setup_s == 0.0 and stats[1].senders == 2, stats
        assert len(transport.sender.routes) == 3  # everything, and each worker's half of the experts
        # each worker's group is sent its boxes, not the whole tensors: fewer bytes than those it wants whole
        from rl.generation.weight_routes import wants
        for g, route in enumerate(transport.sender.routes[1:], 1):
            whole = sum(a.nbytes for n, a in manifest if wants(route, n))
            cut_off = sum(a.nbytes for n, a in manifest if n in boxes[g - 1]) // 2
            assert stats[1].route_bytes[g] <= whole - cut_off + 64 * len(manifest), (g, stats[1].route_bytes, whole)
        for i, (_, applied) in enumerate(states):
            np.savez(f"{out}.engine{i}.npz", **applied)
        transport.close()
        ray.shutdown()
    else:
        sender = RoutedSender(BUCKET, timeout_s=120)
        for v in (1, 2):
            follow_push(sender, peers, owned_hf_tensors(model, "released"), v)
        assert sender.slices[0] == {} and sender.slices[1] and sender.slices[2]  # process 0's slices table arrived
        sender.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
