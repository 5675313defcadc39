"""How many bytes of the HF checkpoint each trainer host reads at load (`m3jax.from_pretrained` on a recipe's mesh),
computed from the layout, not timed: each host reads the blocks its devices hold (`m3jax.hf.read_blocks`).

The mesh is built on simulated CPU devices (as many as the recipe's mesh), hosts being consecutive groups of
--devices-per-host devices in jax's device order, as on a cluster. Printed per host: the bytes of its blocks, and
the bytes of whole rows wherever a block cuts a tensor's rows (an FSDP split of a dense weight's columns narrower
than a page makes the reader touch every page of those rows: an upper bound on what the disk serves).

    .venv/bin/python scripts/checkpoint_reads.py --config configs/recipes/m3-32node.yaml --model release
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", choices=("config", "release"), default=None)
    ap.add_argument("--layout", choices=("native", "released"), default="released", help="the checkpoint's layout")
    ap.add_argument("--devices-per-host", type=int, default=8)
    args = ap.parse_args()
    from m3jax.plan.job import load_job  # starts no jax backend: XLA reads the flags below at the first
    job = load_job(args.config, [], args.model)
    model_cfg, mesh = job.model, job.mesh
    n = math.prod(mesh.shape)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from m3jax.hf import layouts
    from m3jax.hf.read_blocks import region_of, slot_region
    from m3jax.model.decoder import M3ForCausalLM
    from sharding.mesh import build_mesh

    layout = build_mesh(mesh, None)
    abstract = nnx.eval_shape(lambda: M3ForCausalLM(model_cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), layout=layout))
    slots = collections.defaultdict(list)
    for s in layouts.slots(model_cfg, args.layout):
        slots[s.param].append(s)
    exact, rows_read, total = collections.Counter(), collections.Counter(), 0
    for p, var in nnx.to_flat_state(nnx.state(abstract)):
        value = var.get_value()
        shape, item = value.shape, np.dtype(value.dtype).itemsize
        held = collections.defaultdict(set)  # host -> the distinct blocks its devices hold
        for device, index in layout.sharding(var.get_metadata()["logical_axes"]).devices_indices_map(shape).items():
            held[device.id // args.devices_per_host].add(region_of(index, shape))
        for slot in slots[p]:
            k, whole = len(slot.index), slot_region(slot.index, shape)
            total += math.prod(b - a for a, b in whole) * item
            row_bytes = math.prod(shape[k + 1:]) * item
            for host, blocks in held.items():
                rows, cuts, mine = set(), False, 0
                for block in blocks:
                    part = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(block, whole)]
                    if any(hi <= lo for lo, hi in part):
                        continue
                    mine += math.prod(hi - lo for lo, hi in part) * item
                    rows.update(range(*part[k]) if len(shape) > k else (0,))
                    cuts = cuts or part[k + 1:] != list(whole[k + 1:])
                exact[host] += mine
                rows_read[host] += len(rows) * row_bytes if cuts else mine
    per = sorted(exact.values())
    print(f"{args.config}: mesh {mesh.shape} on {n} devices, {len(per)} hosts of {args.devices_per_host}; "
          f"checkpoint ({args.layout}, bf16 text model) {total / 1e9:.1f} GB")
    print(f"read per host: its blocks {per[0] / 1e9:.1f}-{per[-1] / 1e9:.1f} GB (all hosts together "
          f"{sum(per) / 1e9:.1f} GB); whole rows where a block cuts them: up to "
          f"{max(rows_read.values()) / 1e9:.1f} GB. Before session 32 every host read all {total / 1e9:.1f} GB.")


if __name__ == "__main__":
    main()
