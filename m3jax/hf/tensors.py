"""`hf_tensors`: the model's parameters as HF-named tensors, one at a time (what exports and weight pushes read)."""

from __future__ import annotations

import numpy as np
from flax import nnx

from m3jax.hf import layouts


def hf_tensors(model, layout: str = "native", on_host: bool = True):
    """Yield (HF name, host numpy array) for every tensor of `layout`, fetching one slice at a time.

    The one conversion path from m3jax parameters to HF names and shapes: saving and weight transfer
    both iterate this. on_host=False: each is a JAX array where the parameter lives (sliced and reshaped
    there; sharded like it), for a weight push whose buckets are on the accelerator (nothing via the host).
    """
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    for slot in layouts.slots(model.cfg, layout):
        value = flat[slot.param].get_value()
        value = value[slot.index] if slot.index else value
        yield slot.name, (on_host_array(value) if on_host else value).reshape(slot.shape)


def on_host_array(value) -> np.ndarray:
    """The whole array in host memory. An array spanning other hosts' devices (multi-host mesh) is
    gathered: a collective, so every process must iterate `hf_tensors` in the same order."""
    if getattr(value, "is_fully_addressable", True):
        return np.asarray(value)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def processes_where(flag: bool) -> list[int]:
    """The processes whose `flag` is set (an allgather of one flag: every process must call it, in step)."""
    from jax.experimental import multihost_utils
    return np.flatnonzero(np.asarray(multihost_utils.process_allgather(np.int32(flag)))).tolist()
