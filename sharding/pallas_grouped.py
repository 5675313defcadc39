"""Grouped matmuls as Pallas kernels on the Triton backend (GPU): work follows the filled rows.

rows [N, K] sorted by group, group g holding rows [start_g, end_g) with end_g = sizes_0 + .. + sizes_g and
F = end_{G-1} <= N (rows F.. are padding: zero output, zero gradient), weights [G, O, K] (HF's [out, in]):

    forward   out[r] = rows[r] @ W_g(r)^T          grid (row tile, output tile)
    d rows    d_rows[r] = d_out[r] @ W_g(r)        the same kernel reading W untransposed
    d W       dW_g = sum_{r in g} d_out[r]^T rows[r]   grid (group, output tile, input tile)

A (row tile, output tile) program loops over the groups its rows belong to (one, except where a group ends
inside the tile) and over the contracted dimension in blocks, masking the rows of other groups; a program
whose tile starts at or after F stores zeros and does no matmul. So the executed rows are at most
bm * (ceil(F / bm) + G - 1), as for `sharding.tiled_grouped` (`sharding.grouped_matmul.executed_rows`), and
never the buffer's N. A dW program loops over its group's row tiles only: a group without rows costs a store.

Off a GPU the kernels run in Pallas's interpreter (`interpret`): exact, slow, for the tests, and not inside a
shard_map (jax 0.10.2's interpreter mixes its unvarying program ids with the operands' varying mesh axes),
so an expert-parallel model on CPU refuses it. On CPU the Triton lowering itself is checked by exporting
for CUDA, also inside the expert-parallel shard_map (tests/test_pallas_grouped.py); the compiled kernel's
speed and its figure against ragged_dot and the tiled kernel wait for `scripts/gpu_check.py` (check 5).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from sharding.layout import on_gpu, platform

_INTERPRETED_WARN_MACS = 1 << 24  # an interpreted matmul this large takes seconds: say so
BLOCK = 64  # rows, output columns and contracted elements per block (smaller for narrower operands)
NUM_WARPS, NUM_STAGES = 4, 2


def block_for(dim: int, block: int) -> int:
    """A power of two >= 16 (Triton's dot), at most `block`, no wider than the dimension needs."""
    b = 16
    while b < block and b < dim:
        b *= 2
    return b


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _compiler_params():
    return plt.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _out_shape(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """The kernel's output type, varying (inside `jax.shard_map`) over the mesh axes its operands vary over
    (`sharding.grouped_matmul` makes them all vary alike first)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=getattr(jax.typeof(like), "manual_axis_type", None))


def _bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return ends - group_sizes.astype(jnp.int32), ends


def tile_groups(starts: jax.Array, ends: jax.Array, n: int, bm: int) -> tuple[jax.Array, jax.Array]:
    """(first, stop) per row tile of `bm` rows of a buffer of n: the groups [first, stop) whose rows overlap
    the tile (an empty group inside that range costs a loop step, no matmul); empty past the filled rows."""
    lo = jnp.arange(0, n, bm, dtype=jnp.int32)
    first = jnp.searchsorted(ends, lo, side="right").astype(jnp.int32)  # the first group ending after lo
    stop = jnp.searchsorted(starts, lo + bm, side="left").astype(jnp.int32)  # groups starting before the end
    return first, jnp.where(lo < ends[-1], jnp.maximum(stop, first), first)


def _rows_kernel(x: jax.Array, w: jax.Array, starts, ends, transpose_w: bool, bm: int, bn: int, bk: int,
                 interpret: bool) -> jax.Array:
    """out[r] = x[r] @ W_g(r)^T (transpose_w: w [G, O, K]) or x[r] @ W_g(r) (w [G, K, O]); x [N, K], every
    dimension a multiple of its block."""
    n, kdim = x.shape
    o = w.shape[1] if transpose_w else w.shape[2]
    first, stop = tile_groups(starts, ends, n, bm)

    def kernel(first_ref, stop_ref, starts_ref, ends_ref, x_ref, w_ref, o_ref):
        i, j = pl.program_id(0), pl.program_id(1)
        r0 = i * bm
        row = r0 + jnp.arange(bm)

        def group(g, acc):
            mine = ((row >= starts_ref[g]) & (row < ends_ref[g]))[:, None]

            def contract(kb, acc):  # (an empty group's loop below is empty)
                xb = jnp.where(mine, x_ref[pl.ds(r0, bm), pl.ds(kb * bk, bk)], 0)
                if transpose_w:
                    return acc + plt.dot(xb, w_ref[g, pl.ds(j * bn, bn), pl.ds(kb * bk, bk)], trans_b=True)
                return acc + plt.dot(xb, w_ref[g, pl.ds(kb * bk, bk), pl.ds(j * bn, bn)])

            # int32 bounds, explicitly: with a Python 0 and a jnp.where of Python ints, Triton's scf.for got two
            # integer types and refused the kernel (compiled for an H200 without a GPU, session 25)
            steps = jnp.where(ends_ref[g] > starts_ref[g], jnp.int32(kdim // bk), jnp.int32(0))
            return jax.lax.fori_loop(jnp.int32(0), steps, contract, acc)

        acc = jax.lax.fori_loop(first_ref[i], stop_ref[i], group, jnp.zeros((bm, bn), jnp.float32))
        o_ref[pl.ds(r0, bm), pl.ds(j * bn, bn)] = acc.astype(o_ref.dtype)

    return pl.pallas_call(kernel, grid=(n // bm, o // bn), out_shape=_out_shape((n, o), x.dtype, x),
                          interpret=interpret, compiler_params=None if interpret else _compiler_params(),
                          name="grouped_rows")(first, stop, starts, ends, x, w)


def _weights_kernel(d_out: jax.Array, x: jax.Array, starts, ends, groups: int, bm: int, bn: int, bk: int,
                    interpret: bool, dtype) -> jax.Array:
    """dW_g = sum over group g's rows of d_out[r]^T x[r] -> [G, O, K]; d_out [N, O], x [N, K]."""
    n, o = d_out.shape
    kdim = x.shape[1]

    def kernel(starts_ref, ends_ref, d_ref, x_ref, w_ref):
        g, j, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        s, e = starts_ref[g], ends_ref[g]

        def tile(t, acc):
            r0 = t * bm
            mine = ((r0 + jnp.arange(bm) >= s) & (r0 + jnp.arange(bm) < e))[:, None]
            db = jnp.where(mine, d_ref[pl.ds(r0, bm), pl.ds(j * bn, bn)], 0)
            xb = jnp.where(mine, x_ref[pl.ds(r0, bm), pl.ds(kk * bk, bk)], 0)
            return acc + plt.dot(db, xb, trans_a=True)

        acc = jax.lax.fori_loop(s // bm, jnp.where(e > s, (e + bm - 1) // bm, s // bm), tile,
                                jnp.zeros((bn, bk), jnp.float32))
        w_ref[g, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)] = acc.astype(w_ref.dtype)

    return pl.pallas_call(kernel, grid=(groups, o // bn, kdim // bk),
                          out_shape=_out_shape((groups, o, kdim), dtype, x),
                          interpret=interpret, compiler_params=None if interpret else _compiler_params(),
                          name="grouped_weights")(starts, ends, d_out, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmul(rows, weights, group_sizes, block: int, interpret: bool):
    return _forward(rows, weights, group_sizes, block, interpret)


def _forward(rows, weights, group_sizes, block, interpret):
    n, kdim = rows.shape
    o = weights.shape[1]
    bm, bn, bk = block_for(n, block), block_for(o, block), block_for(kdim, block)
    starts, ends = _bounds(group_sizes)
    x = _pad_to(_pad_to(rows, 0, bm), 1, bk)
    w = _pad_to(_pad_to(weights, 1, bn), 2, bk)
    return _rows_kernel(x, w, starts, ends, True, bm, bn, bk, interpret)[:n, :o]


def _fwd(rows, weights, group_sizes, block, interpret):
    return _forward(rows, weights, group_sizes, block, interpret), (rows, weights, group_sizes)


def _bwd(block, interpret, res, d_out):
    rows, weights, group_sizes = res
    n, kdim = rows.shape
    g, o, _ = weights.shape
    bm, bn, bk = block_for(n, block), block_for(o, block), block_for(kdim, block)
    starts, ends = _bounds(group_sizes)
    d = _pad_to(_pad_to(d_out.astype(rows.dtype), 0, bm), 1, bn)
    x = _pad_to(_pad_to(rows, 0, bm), 1, bk)
    w = _pad_to(_pad_to(weights, 1, bn), 2, bk)
    # d rows: contract the output dimension (now blocks of bn) with W_g [O, K] read as is
    d_rows = _rows_kernel(d, w, starts, ends, False, bm, bk, bn, interpret)[:n, :kdim]
    d_w = _weights_kernel(d, x, starts, ends, g, bm, bn, bk, interpret, weights.dtype)[:, :o, :kdim]
    return d_rows, d_w, None


_matmul.defvjp(_fwd, _bwd)


def pallas_grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array, *, block: int = BLOCK,
                          interpret: bool | None = None, backend: str | None = None) -> jax.Array:
    """rows [N, K] (sorted by group) x weights [G, O, K] -> [N, O], rows past sum(group_sizes) zero; equal to
    `jax.lax.ragged_dot_general` with `sharding.grouped_matmul.ROWS_BY_GROUP` up to the summation order.
    interpret: run Pallas's interpreter (default: when `backend`, the platform the program is built for,
    default jax's, is not a GPU)."""
    backend = platform(backend)
    if interpret is None:
        interpret = not on_gpu(backend)
    varying = getattr(getattr(jax.typeof(rows), "manual_axis_type", None), "varying", None)
    if interpret and varying:
        raise ValueError(f"moe_kernel=pallas off a GPU runs Pallas's interpreter, which jax "
                         f"{jax.__version__} cannot run inside a shard_map over mesh axes ({', '.join(sorted(varying))}: "
                         f"the expert-parallel exchange); use moe_kernel=tiled (or auto) on {backend}")
    if interpret and rows.shape[0] * weights.shape[1] * weights.shape[2] > _INTERPRETED_WARN_MACS:
        logging.getLogger(__name__).warning(
            "moe_kernel=pallas on %s runs Pallas's interpreter (for tests): a [%d, %d] x [%d, %d, %d] grouped matmul "
            "will be slow; moe_kernel=bucketed (what auto runs on a CPU) is the fast kernel off a GPU", backend,
            *rows.shape, *weights.shape)
    return _matmul(rows, weights, group_sizes.astype(jnp.int32), block, interpret)
