"""Host values (a batch's numpy arrays, the same on every process) placed on a mesh that may span processes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def place_host_value(value, sharding: jax.sharding.Sharding) -> jax.Array:
    """`value` as a global array on `sharding`, each process copying only the slices its own devices hold.

    Every process must pass the same value (the trainer's batches are: each host draws or receives the same rows).
    jax.device_put of a host value onto a sharding over several processes first gathers the whole value from every
    process onto every process to check that (`multihost_utils.assert_equal`): a collective and a compiled program
    per array, and process-count copies of it on each host (the routes of a routing-replay batch are gigabytes).
    A jax array not yet placed (uncommitted: an eager op's result, e.g. a step count) is a host value here too; one
    placed, or a sharding within this process, goes through jax.device_put."""
    if (isinstance(value, jax.Array) and value.committed) or sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _sum_over_processes(tree):
    return jax.tree.map(lambda x: jnp.sum(x, axis=0, dtype=x.dtype), tree)


def _first_devices():
    """A mesh of one device per process (the first of each, the same on every process), and this process's."""
    firsts = {}
    for d in jax.devices():  # the same list, in the same order, on every process
        firsts.setdefault(d.process_index, d)
    mesh = jax.sharding.Mesh(np.array([firsts[p] for p in range(jax.process_count())]), ("processes",))
    return mesh, firsts[jax.process_index()]


def _summed_over_processes(tree, mesh, mine):
    """Each leaf (a numpy array) summed over the processes, as numpy on every process: stacked [processes, ...] on
    one device per process and summed over that axis (x + 0 is x, but -0.0 + 0.0 is +0.0, as in jax's broadcast)."""
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("processes"))

    def stacked(x):
        return jax.make_array_from_single_device_arrays((mesh.size, *x.shape), rows, [jax.device_put(x[None], mine)])

    summed = jax.jit(_sum_over_processes, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(
        jax.tree.map(stacked, tree))
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), summed)


GATHER_CHUNK_BYTES = 256 << 20  # what `gather_to_every_process` moves at a time: its device memory, twice


def gather_to_every_process(array: jax.Array, chunk_bytes: int = GATHER_CHUNK_BYTES) -> np.ndarray:
    """The whole of `array` (a global array, possibly over several processes) as numpy on every process; a
    collective that every process calls, in the same order. Within one process: np.asarray.

    Replicating the array first (jax.lax.with_sharding_constraint to P(), or multihost_utils.process_allgather)
    holds all of it on every device at once: the JAX engine's key-block ids of a 32-node batch are 30 GB. Here each
    process copies the slices it owns (the first device holding an index owns it) to its host, and the rows along
    axis 0 are summed over one device per process `chunk_bytes` at a time, each process's unowned entries zero, so
    a device holds two chunks at most. Exact for integers and booleans; -0.0 arrives as +0.0."""
    if array.is_fully_addressable:
        return np.asarray(array)
    if array.ndim == 0:  # a scalar over several processes is replicated
        return np.asarray(array.addressable_data(0))
    owner = {}
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, array.shape))
        if key not in owner or device.id < owner[key].id:
            owner[key] = device
    owned = []  # (((start, stop) per axis), its values) of the slices this process owns
    for shard in array.addressable_shards:
        key = tuple(s.indices(n)[:2] for s, n in zip(shard.index, array.shape))
        if owner[key] == shard.device:
            owned.append((key, np.asarray(shard.data)))
    rows = array.shape[0]
    row_bytes = max(1, array.dtype.itemsize * int(np.prod(array.shape[1:])))
    per = max(1, min(rows, chunk_bytes // row_bytes))  # every chunk this many rows (one program), the last one padded
    mesh, mine = _first_devices()
    out = np.empty(array.shape, array.dtype)
    for start in range(0, rows, per):
        mine_here = np.zeros((per, *array.shape[1:]), array.dtype)
        for ((lo, hi), *rest), host in owned:
            a, b = max(lo, start), min(hi, start + per)
            if a < b:
                mine_here[(slice(a - start, b - start), *(slice(*r) for r in rest))] = host[a - lo:b - lo]
        out[start:start + per] = _summed_over_processes(mine_here, mesh, mine)[:rows - start]
    return out


def broadcast_from_first_process(tree):
    """Process 0's value of each leaf of `tree` on every process, as numpy arrays. Every process passes a tree of the
    same shapes and dtypes (the others' values are ignored) and must call this, in the same order: a collective.

    Each leaf is stacked [processes, ...] with zeros but on process 0 and summed over that axis (what
    `jax.experimental.multihost_utils.broadcast_one_to_all` does, so the same bits, -0.0 included), on one device
    per process: jax's own puts the value on every local device and sums over all of them, 8 copies in and 8 out on
    a host of 8 GPUs (a routing-replay rollout's routes are 1.9 GB at the 32-node recipe's batch)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    mesh, mine = _first_devices()
    sent = jax.tree.map(np.asarray, tree) if jax.process_index() == 0 else jax.tree.map(
        lambda x: np.zeros_like(np.asarray(x)), tree)
    return _summed_over_processes(sent, mesh, mine)
