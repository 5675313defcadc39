"""Context-parallel attention: each device attends its own query shard over the keys of every shard.

Under a mesh whose context axis cuts the sequence, a query-tiled attention (a scan over query tiles, a
loop over key tiles) cannot be split well by the partitioner. A scan's iteration axis is never sharded, so
for flash attention it gathered every query tile onto every context device and computed all of them there
(4 context devices ran its forward and backward 3-5x slower than this module's path,
`scripts/bench_context_attention.py`); for the sparse layers' per-tile gathers it kept the split but
all-reduced the whole dK / dV buffers over the context axis at every query tile of the backward. Here the
attention runs inside `jax.shard_map` instead: device c holds queries [c S_l, (c+1) S_l) and all-gathers the
key-side arrays (keys, values, key padding, indexer keys) over the context axes, so it computes only its
own queries against the keys they can see, with its own loop bounds. The gather's transpose is a
reduce-scatter: in the backward each device sums its queries' contributions to dK / dV once.

Shard c's queries see keys [0, (c+1) S_l): where a query's work grows with its position (causal attention that
walks only the key tiles it can see: flash on full layers), the last of n contiguous shards does 2n - 1 times
the first's work. A caller that says so (`balance`) with `Layout.context_balance` on (the default) has the
shards' second halves swapped between mirror shards c and n - 1 - c inside the map (`mirror_second_halves`,
one collective permute of the query side in, one of the output back), so shard c attends for query halves 2c
and 2n - 1 - 2c: every shard sees the same number of causal (query, key) pairs, as MaxText's load-balanced
context parallelism. The attention paths are position-based (causality, the visited key tiles), so the swapped
queries carry their positions and nothing else changes. Paths whose work per query does not grow with its
position (a sparse layer's K selected blocks, masked scores over every key) gain nothing from it and pay the
permutes (a sparse layer's gathers, 2 shards: 0.88-0.92x fwd+bwd, BENCHMARKS.md session 30): they stay contiguous.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from sharding.layout import Layout

Q_AXES = ("act_batch", "act_seq", "act_heads", None)
KV_AXES = ("act_batch", "act_seq", "act_kv_heads", None)
ROW_AXES = ("act_batch", "act_seq")

Axes = tuple  # logical axis names of one array, one per dimension (None = not cut)


def mirror_second_halves(a: jax.Array, dim: int, axes: tuple[str, ...], n: int) -> jax.Array:
    """Inside `jax.shard_map` over `axes` (n shards of a sequence, in order): [first half; second half] of this
    shard's `a` along `dim` -> [first half; the second half of shard n - 1 - shard]. Its own inverse.

    With causal attention, half h of 2n sees (h + 1/2) half-shards of keys on average; shard c then holds
    halves 2c and 2(n - 1 - c) + 1: 2n in all, the same on every shard."""
    half = a.shape[dim] // 2
    first = jax.lax.slice_in_dim(a, 0, half, axis=dim)
    second = jax.lax.slice_in_dim(a, half, 2 * half, axis=dim)
    second = jax.lax.ppermute(second, axes, perm=[(c, n - 1 - c) for c in range(n)])
    return jnp.concatenate([first, second], axis=dim)


def context_parallel(fn: Callable, layout: Layout, local: Sequence[tuple[jax.Array, Axes]],
                     gathered: Sequence[tuple[jax.Array, Axes]], out_axes: Axes | tuple[Axes, ...],
                     balance: bool = False):
    """fn(*local shards, *gathered arrays) on every device of `layout`'s mesh (inside `jax.shard_map`).

    local: (array, logical axes) pairs each device gets its own shard of (the queries' side);
    gathered: (array, logical axes) pairs each device gets whole along their "act_seq" axis (gathered over
    the context axes inside the map; its other axes stay cut); out_axes: the logical axes of fn's output,
    or a tuple of them for a tuple of outputs. Every array's dimensions must divide into their shards.
    balance: fn's work per query grows with its position; with `layout.context_balance`, mirror shards swap the
    second halves of the local arrays and of the outputs (`mirror_second_halves`; not when a shard's length is
    odd).
    """
    ctx, n = layout.axes("act_seq"), layout.size("act_seq")
    n_local = len(local)
    seq_dims = [axes.index("act_seq") for _, axes in gathered]
    several = bool(out_axes) and isinstance(out_axes[0], tuple)
    outs = out_axes if several else (out_axes,)
    local_dims = [axes.index("act_seq") for _, axes in local]
    # Balanced when every local array and output is cut along the sequence in shards of an even length.
    balance = (balance and layout.context_balance and n > 1 and all("act_seq" in axes for axes in outs)
               and all(a.shape[d] // n % 2 == 0 for (a, _), d in zip(local, local_dims)))

    def body(*arrays):
        whole = [jax.lax.all_gather(a, ctx, axis=dim, tiled=True) for a, dim in zip(arrays[n_local:], seq_dims)]
        mine = arrays[:n_local]
        if not balance:
            return fn(*mine, *whole)
        out = fn(*(mirror_second_halves(a, d, ctx, n) for a, d in zip(mine, local_dims)), *whole)
        out = tuple(mirror_second_halves(o, axes.index("act_seq"), ctx, n)
                    for o, axes in zip(out if several else (out,), outs))
        return out if several else out[0]

    spec = lambda axes: layout.spec(axes, drop_trivial=True)  # noqa: E731
    in_specs = tuple(spec(axes) for _, axes in (*local, *gathered))
    out_specs = tuple(spec(a) for a in out_axes) if several else spec(out_axes)
    # check_vma off: fn's loops start from constant carries (zeros), which the varying-axes check rejects.
    # Without it, jax's transpose of the map sums an input's cotangent over the mesh axes the input is not cut
    # over (e.g. the indexer keys under tensor parallelism), as a replicated input needs; in exchange fn must
    # return the same value on every device of an axis an output is not cut over (the callers' outputs are
    # cut over every axis their dimensions map to, or computed from whole heads).
    return jax.shard_map(body, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        *(a for a, _ in local), *(a for a, _ in gathered))


def context_parallel_attention(attend: Callable, layout: Layout, q: jax.Array, k: jax.Array, v: jax.Array,
                               positions: jax.Array, key_valid: jax.Array | None, *,
                               local: Sequence[tuple[jax.Array, Axes]] = (),
                               gathered: Sequence[tuple[jax.Array, Axes]] = (),
                               out_axes: Axes | tuple[Axes, ...] = Q_AXES, balance: bool = False):
    """attend(q, k, v, positions, key_valid, *local, *gathered) on each device's query shard over the
    gathered keys.

    q [B, S, H, D], k / v [B, S, KV, D] (the keys of the same S slots, sharded like the queries),
    positions [B, S] int, key_valid [B, S] bool or None (all valid) -> [B, S, H, D], laid out like q.
    attend gets q [B_l, S_l, H_l, D], k / v [B_l, S, KV_l, D], positions [B_l, S_l], key_valid [B_l, S]:
    local batch rows and heads (tensor parallelism), local queries, every key slot; then the shards of the
    `local` (array, logical axes) pairs and the `gathered` ones whole along "act_seq" (`context_parallel`).
    out_axes: the logical axes of attend's output (a tuple of them for several outputs). balance: attend's work
    per query grows with its position (causal flash), so mirror shards share it (`context_parallel`).
    """
    b, s = q.shape[:2]
    if k.shape[1] != s:
        raise ValueError(f"context-parallel attention needs the keys of the queries' own slots: {s} queries, "
                         f"{k.shape[1]} key slots")
    positions = jnp.broadcast_to(positions, (b, s))
    key_valid = jnp.ones((b, s), bool) if key_valid is None else jnp.broadcast_to(key_valid, (b, s))
    if layout.mesh is None or layout.size("act_seq") == 1:
        return attend(q, k, v, positions, key_valid, *(a for a, _ in local), *(a for a, _ in gathered))
    n_local = 2 + len(local)

    def local_attend(q, positions, *rest):
        extra_local, (k, v, key_valid, *extra_gathered) = rest[:n_local - 2], rest[n_local - 2:]
        return attend(q, k, v, positions, key_valid, *extra_local, *extra_gathered)

    return context_parallel(local_attend, layout, [(q, Q_AXES), (positions, ROW_AXES), *local],
                            [(k, KV_AXES), (v, KV_AXES), (key_valid, ROW_AXES), *gathered], out_axes, balance)
