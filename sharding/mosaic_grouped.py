"""Grouped matmuls on Hopper GPUs through jax's own Mosaic GPU kernels, under one custom VJP.

rows [N, K] sorted by group (group g holds rows [start_g, end_g), rows F = end_{G-1}.. are padding: zero output,
zero gradient), weights [G, O, K] (HF's [out, in]):

    forward   out[r] = rows[r] @ W_g(r)^T          ragged_dot_mgpu(rows, W, transpose_rhs=True)
    d rows    d_rows[r] = d_out[r] @ W_g(r)        ragged_dot_mgpu(d_out, W)
    d W       dW_g = sum_{r in g} d_out[r]^T rows[r]   transposed_ragged_dot_mgpu(d_out, rows)

`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` walks (row tile, output tile) blocks over the groups' rows
only (G - 1 + ceil(F / block_m) row tiles, as `sharding.tiled_grouped`), one persistent program per SM, WGMMA
with fp32 accumulation; it writes no row past F, so the padding rows' output (and input gradient) are set to
zero here. `transposed_ragged_dot_mgpu` contracts each group's rows into its [O, K] block, loading whole
BLOCK_K-row blocks of both operands and masking the output gradient at a group's edges by a multiply, so the one
padding block it can read (rows F.. F + BLOCK_K) of each is zeroed first. Inside the expert-parallel
`jax.shard_map` the kernels' outputs are typed unvarying; each is made to vary as its operands do.

What the kernels take (`check_shapes`, run at model construction and before the kernels are called): Hopper
(sm_90a) only; both operands of one dtype, bf16 or fp16; K and O multiples of 128 (their blocks). Mosaic GPU
lowers neither on a CPU nor in Pallas's interpreter: off a GPU this kernel is refused
(`sharding.grouped_matmul.resolve_kernel`). Its algebra (which kernel computes which product, what is zeroed)
is tested on CPU with the kernels replaced by their contracts (`reference_kernels`, through the `kernels`
argument); the kernels themselves were compiled for an H200 without one and await a Hopper GPU
(`scripts/gpu_check.py` check 5).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from sharding.tiled_grouped import vary_like

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64  # rows, output columns, contracted elements per WGMMA block
MAX_CONCURRENT_STEPS = 4  # the kernels' pipeline depth over the contracted dimension
GRID_BLOCK_N = 1  # output tiles a program walks together
DTYPES = (jnp.bfloat16, jnp.float16)


class Kernels(NamedTuple):
    """ragged_dot(lhs [N, K], rhs, group_sizes, transpose_rhs) -> [N, O] with rhs [G, O, K] when transpose_rhs
    else [G, K, O], rows past sum(group_sizes) unspecified; transposed(lhs [N, M], rhs [N, K], group_sizes) ->
    [G, M, K], group g's rows contracted."""
    ragged_dot: Callable
    transposed: Callable


@functools.lru_cache(maxsize=1)
def mosaic_kernels() -> Kernels:
    """jax's Mosaic GPU kernels at this module's block sizes (imported when called: they need jax's GPU
    Pallas modules, which import on a CPU but lower only for a Hopper GPU)."""
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    from jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu import transposed_ragged_dot

    blocks = dict(block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K, max_concurrent_steps=MAX_CONCURRENT_STEPS,
                  grid_block_n=GRID_BLOCK_N)
    return Kernels(
        lambda lhs, rhs, sizes, transpose_rhs: ragged_dot(lhs, rhs, group_sizes=sizes, transpose_rhs=transpose_rhs,
                                                          **blocks),
        lambda lhs, rhs, sizes: transposed_ragged_dot(lhs, rhs, group_sizes=sizes, **blocks))


def reference_kernels() -> Kernels:
    """The kernels' contracts, at their least forgiving, in plain jax: what the CPU tests run this module's VJP on.
    ragged_dot through `jax.lax.ragged_dot`, its rows past the groups NaN (the kernel never writes them); the
    weight gradient reading, for each group, the rows of rhs in the BLOCK_K-aligned span around the group against
    lhs multiplied by 0 outside the group (the kernel loads whole BLOCK_K-row blocks and masks its lhs at a group's
    edges by a multiply: a non-finite row of either in the span poisons the group's gradient)."""
    def ragged_dot(lhs, rhs, sizes, transpose_rhs):
        w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs  # [G, K, O]
        out = jax.lax.ragged_dot(lhs, w, sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)
        filled = jnp.arange(lhs.shape[0])[:, None] < jnp.sum(sizes)
        return jnp.where(filled, out, jnp.nan)

    def transposed(lhs, rhs, sizes):
        ends = jnp.cumsum(sizes)
        starts = ends - sizes
        r = jnp.arange(lhs.shape[0])[None, :]
        member = (r >= starts[:, None]) & (r < ends[:, None])  # [G, N]
        span = (r >= starts[:, None] // BLOCK_K * BLOCK_K) & (r < -(-ends[:, None] // BLOCK_K) * BLOCK_K) \
            & (sizes[:, None] > 0)
        # the kernel reads the span alone, and masks its lhs there by a multiply: NaN x 0 stays NaN
        lhs_g = jnp.where(span[..., None], lhs[None] * member[..., None].astype(lhs.dtype), 0)
        rhs_g = jnp.where(span[..., None], rhs[None], 0)
        return jnp.einsum("gnm,gnk->gmk", lhs_g, rhs_g, preferred_element_type=jnp.float32).astype(lhs.dtype)

    return Kernels(ragged_dot, transposed)


def check_shapes(rows: jax.Array, weights: jax.Array) -> None:
    """Raise ValueError naming what the Mosaic GPU kernels cannot take (module docstring)."""
    problems = []
    if rows.dtype != weights.dtype or not any(rows.dtype == d for d in DTYPES):
        problems.append(f"rows {rows.dtype} and weights {weights.dtype} must be one dtype of bfloat16 / float16")
    out_dim, in_dim = weights.shape[1:]
    for name, dim, block in (("input width K", in_dim, BLOCK_K), ("input width K", in_dim, BLOCK_N),
                             ("output width O", out_dim, BLOCK_N * GRID_BLOCK_N), ("output width O", out_dim, BLOCK_M)):
        if dim % block:
            problems.append(f"{name} {dim} must be a multiple of {block}")
    if problems:
        raise ValueError(f"moe_kernel=mosaic on rows {tuple(rows.shape)} x weights {tuple(weights.shape)}: "
                         + "; ".join(dict.fromkeys(problems)))


def _padding_zeroed(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jnp.where(jnp.arange(x.shape[0])[:, None] < jnp.sum(group_sizes), x, 0).astype(x.dtype)


def _block_after_filled_zeroed(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x with rows [F, F + BLOCK_K) zeroed, F = sum(group_sizes): the only padding rows the weight-gradient kernel
    reads (the last group's last block), which need not be finite; one block rewritten, not the buffer."""
    n, filled = x.shape[0], jnp.sum(group_sizes)
    if n <= BLOCK_K:
        return _padding_zeroed(x, group_sizes)
    start = jnp.minimum(filled, n - BLOCK_K)
    window = jax.lax.dynamic_slice_in_dim(x, start, BLOCK_K)
    window = jnp.where((start + jnp.arange(BLOCK_K))[:, None] < filled, window, 0).astype(x.dtype)
    return jax.lax.dynamic_update_slice_in_dim(x, window, start, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(rows, weights, group_sizes, kernels: Kernels):
    # inside the expert-parallel shard_map the kernels' outputs are typed unvarying: each is made to vary as its
    # operands do (`grouped_matmul` made those vary alike), which the custom VJP's types require
    out = vary_like(kernels.ragged_dot(rows, weights, group_sizes, True), rows, weights)
    return _padding_zeroed(out, group_sizes)


def _grouped_fwd(rows, weights, group_sizes, kernels):
    return _grouped(rows, weights, group_sizes, kernels), (rows, weights, group_sizes)


def _grouped_bwd(kernels, res, d_out):
    rows, weights, group_sizes = res
    # the weight-gradient kernel reads the block of padding after F of both its operands; the input gradient's
    # rows are independent (those past F are zeroed after), so it reads the same zeroed d_out: one buffer, which
    # XLA can rewrite in place
    d_out = _block_after_filled_zeroed(d_out.astype(rows.dtype), group_sizes)
    d_rows = vary_like(kernels.ragged_dot(d_out, weights, group_sizes, False), rows)
    d_weights = kernels.transposed(d_out, _block_after_filled_zeroed(rows, group_sizes), group_sizes)
    return _padding_zeroed(d_rows, group_sizes), vary_like(d_weights.astype(weights.dtype), weights), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def mosaic_grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                          kernels: Kernels | None = None) -> jax.Array:
    """out[r] = rows[r] @ W_g(r)^T: rows [N, K] sorted by group, weights [G, O, K], group_sizes [G] int ->
    [N, O] in rows' dtype, rows past sum(group_sizes) zero (and zero gradient). kernels: default jax's Mosaic GPU
    kernels (Hopper), whose limits `check_shapes` enforces; `reference_kernels()` in tests, without them."""
    if kernels is None:
        check_shapes(rows, weights)
        kernels = mosaic_kernels()
    return _grouped(rows, weights, group_sizes.astype(jnp.int32), kernels)
