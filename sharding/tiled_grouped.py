"""Tiled grouped matmuls: a loop over (row tile, group) segments that stops after the filled rows.

Rows [N, ...] are sorted by group; group e holds rows [start_e, end_e), start_e = sum_{e' < e} sizes,
and rows from F = sum(sizes) to N are padding. Each group is cut into tiles of `tile` rows from its own
first row (start_e, start_e + tile, ...), so a tile never straddles two groups and only a group's last
tile is partial; each (group, tile) pair is a segment. A `jax.lax.while_loop` walks the live segments in
row order, multiplies the tile's rows by its group's weight and keeps only that group's rows, so

    executed rows = tile * #segments,   #segments = sum_e ceil(n_e / tile) <= ceil(F / tile) + E_nonempty - 1

whatever N is. Rows no segment covers (the padding; with `skip`, each group's first skip rows, which the
bucketed kernel multiplies instead) are never read: zero output, zero gradient.
Both ops have a custom VJP that walks the same segments (while_loop has no reverse-mode derivative).
Matmuls accumulate in fp32 and round to the operands' dtype, as `jax.lax.ragged_dot` does.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp


def segments(group_sizes: jax.Array, n_rows: int, tile: int, skip: int = 0):
    """(first row of segment, group of segment, group starts, group ends, live segments).

    skip: each group's first `skip` rows are left out (another kernel multiplies them: `sharding.bucketed_grouped`),
    so group e's walked rows start at start_e + min(n_e, skip).
    Group e is cut into ceil(n_e / tile) tiles from its first row start_e (ends clipped to N); segments are
    listed group-major, so they walk the rows in order. Tiles aligned to the group rather than to multiples
    of `tile` multiply a group's rows through its weight once (the waste is the last tile's tail only).
    Static bound on their number: ceil(N / tile) + E - 1 (sum_e ceil(n_e / t) <= ceil(F / t) + E - 1)."""
    e = group_sizes.shape[0]
    cum = jnp.cumsum(group_sizes)
    ends, starts = jnp.minimum(cum, n_rows), jnp.minimum(cum - group_sizes + jnp.minimum(group_sizes, skip), n_rows)
    count = (ends - starts + tile - 1) // tile
    bound = math.ceil(n_rows / tile) + e - 1
    group_of = jnp.repeat(jnp.arange(e, dtype=jnp.int32), count, total_repeat_length=bound)
    seg_start = jnp.cumsum(count) - count
    first_row = starts[group_of] + (jnp.arange(bound, dtype=jnp.int32) - seg_start[group_of]) * tile
    return first_row, group_of, starts, ends, jnp.sum(count)


def _varying_axes(*xs) -> tuple[str, ...]:
    """Mesh axes (inside `jax.shard_map`) any of xs varies over."""
    axes = set()
    for x in xs:
        t = jax.typeof(x)  # jax 0.10: aval.manual_axis_type.varying; later releases: aval.vma
        mat = getattr(t, "manual_axis_type", None)
        axes |= set(getattr(mat, "varying", None) or getattr(t, "vma", None) or ())
    return tuple(sorted(axes))


def same_varying(*xs):
    """xs, each marked varying over every mesh axis one of them varies over. A plain dot_general does this
    implicitly; under a custom VJP it must be explicit, so that the cotangent of an operand replicated
    over an axis (rows over the tensor axis, against width-sharded weights) is summed over that axis by
    the transpose of the cast, outside the kernel."""
    return tuple(vary_like(x, *xs) for x in xs)


def vary_like(x: jax.Array, *like) -> jax.Array:
    """x marked varying over the mesh axes `like` vary over (inside `jax.shard_map`): a kernel whose output type
    names no mesh axes (jax's Mosaic GPU kernels) computes a per-shard value all the same."""
    missing = tuple(a for a in _varying_axes(*like) if a not in _varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _zeros(shape, dtype, *like):
    """Zeros varying over the mesh axes of `like` (a loop carry inside `jax.shard_map` must have the
    varying axes of what the loop body writes into it)."""
    return vary_like(jnp.zeros(shape, dtype), *like)


def _walk(n: int, group_sizes, tile: int, skip: int, body_fn, init):
    """carry = body_fn(carry, row0, mask [tile], group) over the live segments (each group's rows after its
    first `skip`). row0 = the segment's first row, moved back to N - tile where the tile would run past N (the
    rows before the segment are masked off), so every slice is `tile` rows long and N needs no padding."""
    first_row, group_of, starts, ends, live = segments(group_sizes, n, tile, skip)
    local = jnp.arange(tile, dtype=jnp.int32)

    def body(state):
        s, carry = state
        first, g = first_row[s], group_of[s]
        row0 = jnp.minimum(first, n - tile)
        r = row0 + local
        mask = (r >= first) & (r < jnp.minimum(ends[g], first + tile))
        return s + 1, body_fn(carry, row0, mask, g)

    return jax.lax.while_loop(lambda state: state[0] < live, body, (jnp.int32(0), init))[1]


def _dot(x, w, contract: int, dtype):
    """x [T, k] . w [a, b] over w's axis `contract`, fp32 accumulation, rounded to dtype."""
    return jax.lax.dot_general(x, w, (((1,), (contract,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(dtype)


def _outer(c, x):
    """sum over tile rows of c[r]^T x[r]: c [T, a], x [T, b] -> [a, b] in fp32 (a weight gradient)."""
    return jax.lax.dot_general(c, x, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _slice(x, row0, tile):
    return jax.lax.dynamic_slice_in_dim(x, row0, tile)


def _put(out, row0, mask, y):
    """out[row0:row0+tile] = y on the masked rows (the others belong to another segment)."""
    old = jax.lax.dynamic_slice_in_dim(out, row0, y.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mask[:, None], y, old), row0, 0)


def _accumulate(dw, g, part):
    """dw[g] += part (fp32)."""
    return jax.lax.dynamic_update_index_in_dim(dw, jax.lax.dynamic_index_in_dim(dw, g, keepdims=False) + part, g, 0)


def _weight(w, g):
    return jax.lax.dynamic_index_in_dim(w, g, keepdims=False)


def _rows_by_weight(lhs, weights, group_sizes, tile, skip, contract: int):
    """out[r] = lhs[r] . W_e over W_e's axis `contract`: 1 (weights [E, out, in], lhs [N, in]: rows @ W_e^T)
    or 0 (lhs [N, out]: the input gradient cot @ W_e)."""
    dtype = jnp.result_type(lhs.dtype, weights.dtype)

    def body(out, row0, mask, g):
        return _put(out, row0, mask, _dot(_slice(lhs, row0, tile), _weight(weights, g), contract, dtype))

    init = _zeros((lhs.shape[0], weights.shape[2 - contract]), dtype, lhs, weights, group_sizes)
    return _walk(lhs.shape[0], group_sizes, tile, skip, body, init)


# ------------------------------------------------------------------------------------------- grouped matmul

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def tiled_matmul(rows, weights, group_sizes, tile: int, skip: int = 0):
    """out[r] = rows[r] @ W_e^T for rows [N, in], weights [E, out, in]; zeros past the filled rows, and on
    each group's first `skip` rows (left to another kernel).

    VJP over the same segments: d rows[r] = cot[r] @ W_e;  d W_e = sum_{r in e} cot[r]^T rows[r]."""
    return _rows_by_weight(rows, weights, group_sizes, tile, skip, 1)


def _matmul_fwd(rows, weights, group_sizes, tile, skip):
    return tiled_matmul(rows, weights, group_sizes, tile, skip), (rows, weights, group_sizes)


def _matmul_bwd(tile, skip, res, cot):
    rows, weights, group_sizes = res
    d_rows = _rows_by_weight(cot, weights, group_sizes, tile, skip, 0).astype(rows.dtype)

    def body(dw, row0, mask, g):
        c = jnp.where(mask[:, None], _slice(cot, row0, tile), 0)
        return _accumulate(dw, g, _outer(c, _slice(rows, row0, tile)))

    dw = _walk(rows.shape[0], group_sizes, tile, skip, body, _zeros(weights.shape, jnp.float32, rows, cot, weights))
    return d_rows, dw.astype(weights.dtype), None


tiled_matmul.defvjp(_matmul_fwd, _matmul_bwd)


# ---------------------------------------------------------------------------------------- fused grouped MLP

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def tiled_mlp(rows, w_in, w_out, group_sizes, act: Callable, tile: int, skip: int = 0):
    """out[r] = act(rows[r] @ W_in_e^T) @ W_out_e^T, rows [N, in], w_in [E, H, in], w_out [E, out, A];
    act: [tile, H] -> [tile, A], row-wise (a row's output depends on that row only). Zeros (and zero
    gradients) on each group's first `skip` rows, as on the padding.

    Fused per segment: the hidden [tile, H] lives one tile at a time, so nothing of size N x H is
    written, and the backward recomputes it (one more rows @ W_in^T per segment) instead of saving it:
        h = rows W_in^T, a = act(h), y = a W_out^T
        d a = cot W_out,  d W_out += cot^T a,  d h = act'(h)^T d a,  d W_in += d h^T rows,  d rows = d h W_in
    """
    dtype = jnp.result_type(rows.dtype, w_in.dtype, w_out.dtype)

    def body(out, row0, mask, g):
        a = act(_dot(_slice(rows, row0, tile), _weight(w_in, g), 1, dtype))
        return _put(out, row0, mask, _dot(a, _weight(w_out, g), 1, dtype))

    init = _zeros((rows.shape[0], w_out.shape[1]), dtype, rows, w_in, w_out, group_sizes)
    return _walk(rows.shape[0], group_sizes, tile, skip, body, init)


def _mlp_fwd(rows, w_in, w_out, group_sizes, act, tile, skip):
    return tiled_mlp(rows, w_in, w_out, group_sizes, act, tile, skip), (rows, w_in, w_out, group_sizes)


def _mlp_bwd(act, tile, skip, res, cot):
    rows, w_in, w_out, group_sizes = res
    dtype = jnp.result_type(rows.dtype, w_in.dtype, w_out.dtype)

    def body(carry, row0, mask, g):
        d_rows, dw_in, dw_out = carry
        x, wi, wo = _slice(rows, row0, tile), _weight(w_in, g), _weight(w_out, g)
        c = jnp.where(mask[:, None], _slice(cot, row0, tile), 0).astype(dtype)  # other segments' rows: 0
        a, act_vjp = jax.vjp(act, _dot(x, wi, 1, dtype))
        dh = act_vjp(_dot(c, wo, 0, a.dtype))[0]
        dw_out = _accumulate(dw_out, g, _outer(c, a))
        dw_in = _accumulate(dw_in, g, _outer(dh, x))
        return _put(d_rows, row0, mask, _dot(dh, wi, 0, rows.dtype)), dw_in, dw_out

    like = (rows, cot, w_in, w_out)
    init = (_zeros(rows.shape, rows.dtype, *like), _zeros(w_in.shape, jnp.float32, *like),
            _zeros(w_out.shape, jnp.float32, *like))
    d_rows, dw_in, dw_out = _walk(rows.shape[0], group_sizes, tile, skip, body, init)
    return d_rows, dw_in.astype(w_in.dtype), dw_out.astype(w_out.dtype), None


tiled_mlp.defvjp(_mlp_fwd, _mlp_bwd)
