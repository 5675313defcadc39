"""Host values (a batch's numpy arrays, the same on every process) placed on a mesh that may span processes."""

from __future__ import annotations

import jax
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
