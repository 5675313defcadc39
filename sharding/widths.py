"""Micro-batches cut to the width their rows need (padding-free compute for rows of mixed lengths).

A step's batch is [micro-batches, rows, S] with every row padded to S positions; rows that end early leave
the rest to padding, which the forward and backward still compute. Given a set of widths, micro-batch m runs
at w_m = min{w in widths : w >= n_m} (S when no width is that large), where n_m is the longest row's number of
real positions (its `attention_mask` sum; right padding, so they are positions 0 .. n_m - 1). Causal attention
means no real position reads past n_m, so the cut changes no value beyond the sums' order. (Under context
parallelism a cut also moves positions between context shards, which changes what a MoE capacity factor drops,
each device bounding its own assignments: the run's config refuses widths with both.)

Which fields are cut: arrays of rank >= 3 ([micro, rows, S, ...]: tokens, masks, logprobs, routes) along axis 2;
rank-2 ones ([micro, rows]: advantages) are per row and only indexed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def micro_widths(attention_mask: np.ndarray, widths: Sequence[int]) -> list[int]:
    """w_m for every micro-batch of attention_mask [micro, rows, S] (see the module docstring)."""
    full = attention_mask.shape[-1]
    longest = attention_mask.reshape(attention_mask.shape[0], -1, full).sum(-1).max(-1)
    fits = sorted(w for w in widths if w < full)
    return [next((w for w in fits if w >= n), full) for n in longest.tolist()]


def cut_micro_batch(batch: dict, m: int, width: int) -> dict:
    """Micro-batch m of `batch` ([rows, ...] arrays) with its position axis cut to `width`."""
    return {k: v[m, :, :width] if np.ndim(v) >= 3 else v[m] for k, v in batch.items()}


def on_host(x):
    """x as a numpy array when this process holds all of it, else x (a multi-host global array). Cutting and
    padding then run on the host: eagerly on a sharded jax array, each cut or pad reshards its position axis
    across the context shards (collective programs of their own, dispatched between the step's)."""
    import jax

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x
    return np.asarray(x)


def padded_to(x, full: int):
    """x [..., rows, w, ...] (positions on axis 2 of a [micro, rows, S, ...] layout) zero-padded back to `full`."""
    import jax.numpy as jnp

    extra = full - x.shape[2]
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, extra)
    return jnp.pad(x, pad) if not isinstance(x, np.ndarray) else np.pad(x, pad)


def check_widths(widths: Sequence[int], multiple: int, what: str = "widths") -> None:
    """Each width a positive multiple of `multiple` (context shards x the model's block size), increasing."""
    if any(int(w) != w or w < 1 for w in widths):
        raise ValueError(f"{what} = {list(widths)}: every width must be a positive integer")
    if list(widths) != sorted(set(widths)):
        raise ValueError(f"{what} = {list(widths)}: must be strictly increasing")
    bad = [w for w in widths if w % multiple]
    if bad:
        raise ValueError(f"{what} = {list(widths)}: {bad} not a multiple of {multiple} (mesh.context x the model's "
                         "index block size: each context shard holds whole blocks)")
