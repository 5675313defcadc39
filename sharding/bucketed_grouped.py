"""Bucketed grouped matmuls: one batched matmul over per-group buckets, the overflow through the tiled walk.

Rows [N, ...] are sorted by group as in `sharding.tiled_grouped` (group e holds rows [start_e, end_e), rows
past F = sum(sizes) are padding). Each group's first C rows (C = `bucket`, the rows a group holds under a
balanced load) are gathered into a [E, C, ...] bucket tensor and multiplied by their group's weight in one
batched matmul; the rows past a group's bucket (its overflow) go through the tiled walk, which skips each
group's first C rows (`tiled_matmul` / `tiled_mlp` with skip = C):

    executed rows = E * C + tile * sum_e ceil(max(n_e - C, 0) / tile)

Under a balanced load (n_e ~ C) that is ~F plus a few overflow tiles: the tiled walk alone, whose tiles start
at each group's first row, multiplies a whole tile for each group's partial last tile (~2F at C ~ tile), and
its steps are a loop (launches on a GPU, dispatches on CPU) where the bucket is one batched matmul. A skewed
load costs at most the tiled walk plus the E * C bucket rows. Bucket slots past a group's rows multiply
zeros; padding rows are never read: zero output, zero gradient. The bucket part is plain gathers and
einsums (their gradients are JAX's own), matmuls accumulating in fp32 and rounded to the operands' dtype
like `jax.lax.ragged_dot`.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from sharding.tiled_grouped import tiled_matmul, tiled_mlp

SLOT_MULTIPLE = 8  # bucket rows are rounded up to this (whole vector registers / MMA rows)


def bucket_rows(expected_rows: float) -> int:
    """The bucket size C for groups expected to hold `expected_rows` rows each (a balanced load), rounded
    up to SLOT_MULTIPLE rows."""
    return max(SLOT_MULTIPLE, SLOT_MULTIPLE * math.ceil(expected_rows / SLOT_MULTIPLE))


def overflow_tile(bucket: int, tile: int) -> int:
    """The overflow walk's rows per step: a balanced load overflows a bucket by a fraction of it, so a
    quarter-bucket tile (at most `tile`, at least SLOT_MULTIPLE) wastes less than a whole tile would."""
    return max(SLOT_MULTIPLE, min(tile, SLOT_MULTIPLE * math.ceil(bucket / 4 / SLOT_MULTIPLE)))


def _buckets(group_sizes: jax.Array, n_rows: int, bucket: int):
    """(source row of each bucket slot [E, C] clipped into the buffer, slot holds a row [E, C],
    flat slot of each buffer row [N], row sits in a bucket [N])."""
    e = group_sizes.shape[0]
    cum = jnp.cumsum(group_sizes)
    starts = cum - group_sizes
    slot = jnp.arange(bucket, dtype=jnp.int32)
    source = starts[:, None] + slot[None, :]
    held = (slot[None, :] < group_sizes[:, None]) & (source < n_rows)
    r = jnp.arange(n_rows, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, r, side="right"), e - 1).astype(jnp.int32)
    within = r - starts[group]
    in_bucket = (r < cum[-1]) & (within < bucket)
    return jnp.minimum(source, n_rows - 1), held, group * bucket + jnp.minimum(within, bucket - 1), in_bucket


def _dot(x, w, spec: str, dtype):
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(dtype)


def _gather_buckets(rows, source, held):
    return jnp.where(held[..., None], rows[source], 0)


def _scatter_buckets(out_buckets, flat_slot, in_bucket):
    """[E, C, out] bucket outputs -> [N, out] rows (zeros for rows outside every bucket)."""
    flat = out_buckets.reshape(-1, out_buckets.shape[-1])
    return jnp.where(in_bucket[:, None], flat[flat_slot], 0)


def bucketed_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array, bucket: int, tile: int) -> jax.Array:
    """out[r] = rows[r] @ W_e^T for rows [N, in], weights [E, out, in]; see the module docstring."""
    dtype = jnp.result_type(rows.dtype, weights.dtype)
    source, held, flat_slot, in_bucket = _buckets(group_sizes, rows.shape[0], bucket)
    y = _dot(_gather_buckets(rows, source, held), weights, "eci,eoi->eco", dtype)
    return _scatter_buckets(y, flat_slot, in_bucket) + tiled_matmul(rows, weights, group_sizes, tile, bucket)


def bucketed_mlp(rows: jax.Array, w_in: jax.Array, w_out: jax.Array, group_sizes: jax.Array,
                 act: Callable[[jax.Array], jax.Array], bucket: int, tile: int) -> jax.Array:
    """out[r] = act(rows[r] @ W_in_e^T) @ W_out_e^T for rows [N, in], w_in [E, H, in], w_out [E, out, A]
    (act row-wise, [.., H] -> [.., A]); the overflow through the fused tiled MLP."""
    dtype = jnp.result_type(rows.dtype, w_in.dtype, w_out.dtype)
    source, held, flat_slot, in_bucket = _buckets(group_sizes, rows.shape[0], bucket)
    h = _dot(_gather_buckets(rows, source, held), w_in, "eci,ehi->ech", dtype)
    y = _dot(act(h), w_out, "eca,eoa->eco", dtype)
    return _scatter_buckets(y, flat_slot, in_bucket) + tiled_mlp(rows, w_in, w_out, group_sizes, act, tile, bucket)
