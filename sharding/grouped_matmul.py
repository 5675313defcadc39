"""Grouped matmuls whose cost can follow the filled rows, not the buffer they sit in; kernel choice.

    grouped_matmul   out[r] = rows[r] @ W_e(r)^T                     rows [N, in], weights [E, out, in]
    grouped_mlp      out[r] = act(rows[r] @ W_in_e(r)^T) @ W_out_e(r)^T   (an expert MLP, fused when tiled)
for r < F = sum(group_sizes), e(r) = the group holding row r (rows sorted by group); rows F..N-1 are
padding: zero output, zero gradient. Weights in the HF [out, in] layout.

Kernels (`kernel=`):
  ragged_dot  `jax.lax.ragged_dot_general`, the oracle (today's path; grouped_mlp = two ragged dots
              with `act` between). XLA:CPU lowers it densely (rows expanded to a masked [E, N, in]
              tensor: E x N rows multiplied) and jaxlib 0.10.x's CUDA lowering is a dense matmul too, so
              its cost follows the buffer N, not F.
  tiled       `sharding.tiled_grouped`: a while_loop over (row tile, group) segments that stops after
              the last filled tile, custom VJP over the same segments:
                  executed rows <= tile * (ceil(F / tile) + E - 1)             (`executed_rows`)
              grouped_mlp is fused: its hidden [N, H] is never materialised (one tile at a time) and
              the backward recomputes it per tile (+ one rows @ W_in^T: 11/9 of the three matmuls'
              6 x 3 units of FLOPs for a SwiGLU expert with H = 2A).
  bucketed    `sharding.bucketed_grouped`: each group's first C rows (`bucket`: the rows a group holds under a
              balanced load) in one batched matmul over [E, C] buckets, the rest through the tiled walk
              (skipping the buckets' rows, a quarter-bucket tile):
                  executed rows = E * C + tile' * sum_e ceil(max(n_e - C, 0) / tile')
              ~F under a balanced load, where the tiled walk's group-aligned tiles multiply ~2F at C ~ tile.
  pallas      `sharding.pallas_grouped`: Pallas kernels on the Triton backend (forward, input and weight
              gradients under a custom VJP), a program per (row tile, output tile) looping over its groups,
              tiles past the filled rows multiplying nothing: executed rows as tiled's. For GPUs; off a GPU
              Pallas's interpreter runs it (the tests). Never run on a GPU yet.
  mosaic      `sharding.mosaic_grouped`: jax's Mosaic GPU kernels (`ragged_dot_mgpu` for the forward and the input
              gradient, `transposed_ragged_dot_mgpu` for the weight gradient) under a custom VJP; Hopper only,
              bf16 / fp16, widths multiples of 128; executed rows as tiled's at a 128-row tile. Refused off a
              GPU: Mosaic GPU neither lowers there nor runs in Pallas's interpreter. Never run on a GPU yet.
  auto        bucketed on CPU (measured: scripts/bench_grouped_matmul.py, BENCHMARKS.md sessions 11 and 27);
              ragged_dot on GPU/TPU when the model is built directly. The trainer does not leave it there: off a
              CPU it times the kernels the device runs at the run's shapes and builds the model with the
              fastest (`m3jax.model.expert_tuning`; `moe_kernel: tune` does so on CPU too).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from sharding.bucketed_grouped import bucket_rows, bucketed_matmul, bucketed_mlp, overflow_tile
from sharding.layout import on_gpu, platform
from sharding.tiled_grouped import same_varying, tiled_matmul, tiled_mlp

KERNELS = ("auto", "ragged_dot", "tiled", "bucketed", "pallas", "mosaic")
DEFAULT_TILE = 128

# rows [N, in] against per-group weights [E, out, in]: contract `in` with the last weight axis.
ROWS_BY_GROUP = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def resolve_kernel(kernel: str = "auto", backend: str | None = None) -> str:
    """The concrete kernel for `kernel` on `backend` (the platform the program is built for, a layout's
    `backend`; default: jax's default backend)."""
    if kernel == "tune":
        raise ValueError("moe_kernel 'tune' is chosen by timing the kernels before the model is built "
                         "(m3jax.model.expert_tuning.tune_moe_kernel, which the trainer runs): build the model with "
                         f"its result, one of {', '.join(KERNELS)}")
    if kernel not in KERNELS:
        raise ValueError(f"grouped matmul kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    if kernel == "mosaic" and not on_gpu(backend):
        raise ValueError(f"grouped matmul kernel 'mosaic' (jax's Mosaic GPU kernels, Hopper only) cannot run on "
                         f"{platform(backend)!r}: Mosaic GPU lowers for GPUs alone; use bucketed or tiled there")
    if kernel != "auto":
        return kernel
    return "bucketed" if platform(backend) == "cpu" else "ragged_dot"


def _tile(tile: int, n: int) -> int:
    if tile < 1:
        raise ValueError(f"tile={tile}: expected >= 1")
    return min(tile, n)


def _bucket(expected_rows: float | None, n: int, groups: int, tile: int) -> tuple[int, int]:
    """The bucketed kernel's (C, overflow walk tile): C the rows each group is expected to hold (default: the
    buffer split evenly, right where every row of the buffer is real, as on one device)."""
    bucket = bucket_rows(n / groups if expected_rows is None else expected_rows)
    return bucket, _tile(overflow_tile(bucket, tile), n)


def grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array, *, kernel: str = "auto",
                   tile: int = DEFAULT_TILE, backend: str | None = None,
                   expected_rows: float | None = None) -> jax.Array:
    """rows [N, in] (sorted by group) x weights [E, out, in] -> [N, out]; see the module docstring.
    backend: the platform the program is built for (`Layout.backend`; default jax's): resolves "auto", and
    whether the Pallas kernel is compiled for a GPU or interpreted.
    expected_rows: the rows each group holds under a balanced load (the bucketed kernel's bucket; default
    N / E, right when the buffer has no padding; an expert-parallel receive pool must pass it)."""
    kernel = resolve_kernel(kernel, backend)
    if kernel == "ragged_dot" or rows.shape[0] == 0:
        return jax.lax.ragged_dot_general(rows, weights, group_sizes, ROWS_BY_GROUP)
    rows, weights, group_sizes = same_varying(rows, weights, group_sizes.astype(jnp.int32))
    if kernel == "pallas":
        from sharding.pallas_grouped import pallas_grouped_matmul
        return pallas_grouped_matmul(rows, weights, group_sizes, backend=backend)
    if kernel == "mosaic":
        from sharding.mosaic_grouped import mosaic_grouped_matmul
        return mosaic_grouped_matmul(rows, weights, group_sizes)
    if kernel == "bucketed":
        bucket, walk_tile = _bucket(expected_rows, rows.shape[0], weights.shape[0], tile)
        return bucketed_matmul(rows, weights, group_sizes, bucket, walk_tile)
    return tiled_matmul(rows, weights, group_sizes, _tile(tile, rows.shape[0]))


def grouped_mlp(rows: jax.Array, w_in: jax.Array, w_out: jax.Array, group_sizes: jax.Array,
                act: Callable[[jax.Array], jax.Array], *, kernel: str = "auto", tile: int = DEFAULT_TILE,
                backend: str | None = None, expected_rows: float | None = None) -> jax.Array:
    """act(rows @ W_in_e^T) @ W_out_e^T per group: rows [N, in], w_in [E, H, in], w_out [E, out, A],
    act [.., H] -> [.., A] row-wise (a row's output depends on that row alone). -> [N, out].
    backend, expected_rows: as `grouped_matmul`'s."""
    kernel = resolve_kernel(kernel, backend)
    if kernel not in ("tiled", "bucketed") or rows.shape[0] == 0:
        h = grouped_matmul(rows, w_in, group_sizes, kernel=kernel, tile=tile, backend=backend)
        return grouped_matmul(act(h), w_out, group_sizes, kernel=kernel, tile=tile, backend=backend)
    rows, w_in, w_out, group_sizes = same_varying(rows, w_in, w_out, group_sizes.astype(jnp.int32))
    if kernel == "bucketed":
        bucket, walk_tile = _bucket(expected_rows, rows.shape[0], w_in.shape[0], tile)
        return bucketed_mlp(rows, w_in, w_out, group_sizes, act, bucket, walk_tile)
    return tiled_mlp(rows, w_in, w_out, group_sizes, act, _tile(tile, rows.shape[0]))


def executed_rows(filled: float, groups: int, kernel: str, buffer_rows: float | None = None,
                  tile: int = DEFAULT_TILE, bucket: float | None = None) -> float:
    """Rows a grouped matmul multiplies (each through one group's weight) for `filled` real rows in a
    buffer of `buffer_rows` (default: filled) with `groups` groups:

        tiled       tile * min(ceil(F / tile), ceil(N / tile)) + tile * (G - 1)   (an upper bound: each of
                    the G groups cut into tiles from its first row ends in a partial tile)
        bucketed    G * C + the tiled bound of the overflow's max(F - G * C, 0) rows on the overflow tile
                    (C = `bucket`, default the balanced bucket of F / G rows): a balanced load, F <= G * C;
                    a skewed one adds up to the tiled walk's rows
        pallas      tiled's bound at `sharding.pallas_grouped`'s row block (64; a power of two >= 16 under
                    a buffer of fewer rows), mosaic at `sharding.mosaic_grouped.BLOCK_M` (128): a program per
                    row tile loops over the groups its rows belong to, so a group's partial tile costs a tile
        dense       G * N   a dense lowering of ragged_dot (every group against the whole zero-padded buffer)
        grouped     F       an ideal grouped-GEMM kernel
    """
    n = filled if buffer_rows is None else buffer_rows
    if kernel in ("pallas", "mosaic"):
        return executed_rows(filled, groups, "tiled", n, tile=_kernel_row_block(kernel, n))
    if kernel == "tiled":
        return float(tile * (min(math.ceil(filled / tile), math.ceil(n / tile)) + groups - 1))
    if kernel == "bucketed":
        c = bucket_rows(filled / groups) if bucket is None else bucket
        over = max(filled - groups * c, 0)
        return float(groups * c + (executed_rows(over, groups, "tiled", tile=overflow_tile(c, tile)) if over else 0))
    if kernel == "dense":
        return float(groups * n)
    if kernel == "grouped":
        return float(filled)
    raise ValueError(f"kernel {kernel!r}: expected tiled, bucketed, pallas, mosaic, dense or grouped")


def _kernel_row_block(kernel: str, buffer_rows: float) -> int:
    """The rows per tile of the pallas or mosaic kernel for a buffer of `buffer_rows` rows."""
    if kernel == "mosaic":
        from sharding.mosaic_grouped import BLOCK_M
        return BLOCK_M
    from sharding.pallas_grouped import BLOCK, block_for  # imports Pallas: only when asked
    return block_for(int(buffer_rows), BLOCK)
