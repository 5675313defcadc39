"""Which trainer process sends which HF tensor: each sends what its own devices hold, none gathers all.

On a multi-host mesh `hf_tensors` gathers every tensor to every process. For a weight push that is the
wrong shape of work: every byte crosses the trainer's network P times and one process then sends it all.
Here each HF tensor gets one owner among the processes whose local devices together hold the whole of it
(an expert placed on that host, a replicated norm, a dense weight whose FSDP shards all sit on one host),
chosen to balance bytes; the owner cuts it from its local shards and nobody else touches it. Only a tensor
that no single process holds (a dense weight sharded across hosts) is still gathered, by every process, in
the same order (the gather is a collective), and sent by the least loaded one.

The plan depends only on shapes and shardings, which every process knows for every device, so all
processes compute the same owners without talking to each other.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import numpy as np
from flax import nnx

from m3jax.hf import layouts
from m3jax.hf.read_blocks import Region, region_of, slot_region
from m3jax.hf.tensors import hf_tensors, on_host_array



def covers(blocks: Sequence[Region], region: Region) -> bool:
    """Whether the blocks (a sharding's per-device index ranges: a grid, so distinct blocks are disjoint;
    replicas repeat a block) together hold every element of `region`."""
    volume = int(np.prod([b - a for a, b in region]))
    held = 0
    for block in set(blocks):
        held += int(np.prod([max(0, min(b, d) - max(a, c)) for (a, b), (c, d) in zip(region, block)]))
    return held == volume


def assign_owners(holders: Sequence[Sequence[int]], nbytes: Sequence[int], processes: int) -> list[int]:
    """owner[i] for tensor i: the holder (any process when it has none) with the fewest bytes assigned so
    far, ties to the lower index; greedy in tensor order, so every process computes the same list."""
    load = [0] * processes
    owners = []
    for held_by, size in zip(holders, nbytes):
        owner = min(held_by or range(processes), key=lambda p: (load[p], p))
        load[owner] += size
        owners.append(owner)
    return owners


def _blocks_by_process(value) -> dict[int, list[Region]]:
    """process -> the index blocks its devices hold of `value` (every device's, not only this process's)."""
    out: dict[int, list[Region]] = {}
    for device, idx in value.sharding.devices_indices_map(value.shape).items():
        block = region_of(idx, value.shape)
        out.setdefault(device.process_index, []).append(block)
    return out


def _overlaps(value, region: Region):
    """(where in `region`, the shard's data, which part of the shard) for each distinct block of this process's
    shards of `value` that overlaps `region` (a replica's block once)."""
    done = set()
    for shard in value.addressable_shards:
        block = region_of(shard.index, value.shape)
        if block in done:
            continue
        done.add(block)
        lo = [max(a, c) for (a, _), (c, _) in zip(region, block)]
        hi = [min(b, d) for (_, b), (_, d) in zip(region, block)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        yield (tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, region)), shard.data,
               tuple(slice(l - c, h - c) for l, h, (c, _) in zip(lo, hi, block)))


def _local_region(value, region: Region) -> np.ndarray:
    """`region` of `value` assembled from this process's shards (one copy of each distinct block)."""
    out = np.empty([b - a for a, b in region], dtype=value.dtype)
    for dst, data, src in _overlaps(value, region):
        out[dst] = np.asarray(data)[src]
    return out


def _local_region_on_device(value, region: Region):
    """`region` of `value` from this process's shards, left on the accelerator: the one shard's slice when a
    single shard holds it all (an expert on its GPU), else the pieces brought to the first one's device and
    written into one array there."""
    (dst, first), *rest = [(dst, data[src]) for dst, data, src in _overlaps(value, region)]
    shape = tuple(b - a for a, b in region)
    if not rest and tuple(first.shape) == shape:
        return first
    device = next(iter(first.devices()))
    out = jax.device_put(jax.numpy.zeros(shape, value.dtype), device).at[dst].set(first)
    for dst, piece in rest:
        out = out.at[dst].set(jax.device_put(piece, device))
    return out


def owned_hf_tensors(model, layout: str, process: int | None = None,
                     processes: int | None = None, on_host: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) for the tensors of `layout` that this process sends (see the module doc).
    Every process must drain it: tensors no process holds alone are gathered collectively, in order.
    on_host=False: what this process holds stays on its accelerator (JAX arrays, `_local_region_on_device`);
    only a tensor gathered from several hosts comes as a host array."""
    process = jax.process_index() if process is None else process
    processes = jax.process_count() if processes is None else processes
    if processes == 1:
        yield from hf_tensors(model, layout, on_host)
        return
    for slot, value, region, held_by, owner in owner_plan(model, layout, processes):
        if not held_by:  # spread over several hosts: a collective gather, on every process
            whole = on_host_array(value[slot.index] if slot.index else value)
            if owner == process:
                yield slot.name, whole.reshape(slot.shape)
        elif owner == process:
            if isinstance(value, np.ndarray):
                local = np.asarray(value[slot.index] if slot.index else value)
            else:
                local = _local_region(value, region) if on_host else _local_region_on_device(value, region)
            yield slot.name, local.reshape(slot.shape)


def owner_plan(model, layout: str, processes: int) -> list[tuple]:
    """(slot, parameter value, the slot's region of it, the processes holding all of it, its owner) for every
    HF tensor of `layout`, in slot order: the same list on every process (shapes and shardings only)."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    slots = list(layouts.slots(model.cfg, layout))
    values, holders, sizes = [], [], []
    for slot in slots:
        value = flat[slot.param].get_value()
        region = slot_region(slot.index, value.shape)
        if isinstance(value, np.ndarray):  # a host copy every process holds (`m3jax.hf.tensors.host_views` of a local array)
            held_by = list(range(processes))
        else:
            held_by = sorted(p for p, blocks in _blocks_by_process(value).items() if covers(blocks, region))
        values.append((value, region))
        holders.append(held_by)
        sizes.append(int(np.prod(slot.shape)) * np.dtype(value.dtype).itemsize)
    return [(slot, value, region, held_by, owner) for slot, (value, region), held_by, owner
            in zip(slots, values, holders, assign_owners(holders, sizes, processes))]
