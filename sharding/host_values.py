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


def broadcast_from_first_process(tree):
    """Process 0's value of each leaf of `tree` on every process, as numpy arrays. Every process passes a tree of the
    same shapes and dtypes (the others' values are ignored) and must call this, in the same order: a collective.

    Each leaf is stacked [processes, ...] with zeros but on process 0 and summed over that axis (what
    `jax.experimental.multihost_utils.broadcast_one_to_all` does, so the same bits, -0.0 included), on one device
    per process: jax's own puts the value on every local device and sums over all of them, 8 copies in and 8 out on
    a host of 8 GPUs (a routing-replay rollout's routes are 1.9 GB at the 32-node recipe's batch)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    firsts = {}
    for d in jax.devices():  # the same list, in the same order, on every process
        firsts.setdefault(d.process_index, d)
    mesh = jax.sharding.Mesh(np.array([firsts[p] for p in range(jax.process_count())]), ("processes",))
    mine, rows = firsts[jax.process_index()], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("processes"))

    def stacked(x):
        x = np.asarray(x)
        local = (x if jax.process_index() == 0 else np.zeros_like(x))[None]
        return jax.make_array_from_single_device_arrays((len(firsts), *x.shape), rows, [jax.device_put(local, mine)])

    summed = jax.jit(_sum_over_processes, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(
        jax.tree.map(stacked, tree))
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), summed)
