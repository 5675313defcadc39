"""Sparse layers' forward passes on jax's shipped Pallas paged-attention kernel (GPU); gradients as `gather`.

A sparse layer's query attends to the key blocks its index head selected. That is paged attention, as vLLM
serves these layers: each (batch row, query, head unit) is one "sequence" whose pages are its selected blocks
of its kv head, sorted ascending (the own block last, unselected entries past the end), and whose length is
the number of slots it may see. The model's rule (`m3jax.model.sparse._kept_slots`: slot j of a selected block
is kept iff key_valid[j], j < S_k and j <= position) is such a prefix of the sorted pages whenever the row's
key_valid is a prefix (right padding, and a decode step's written cache slots): then a slot is kept iff
j < min(position + 1, length), a threshold on the key index, and in ascending blocks the kept slots come
first. That form is checked at run time (`lax.cond`, else the `gather` path runs), so the output is the model's
for every input. A query that sees no slot gets the mean of v over all S_k slots, as the other paths give.

Only the forward runs here: under differentiation the custom VJP's forward and backward are the `gather`
path's own (replaying the same block ids), so training is unchanged and this serves the passes that take no
gradient (the trainer's old-policy and reference logprobs). The kernel takes no softmax scale: D^-0.5 goes
in as its per-key scales, which multiply the fp32 logits (scaling q in bf16 would round once more).

Off a GPU nothing here runs (`applies`), except in the tests, which run the kernel in Pallas's interpreter;
its speed against `gather` waits for `scripts/gpu_check.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.model.fused_attention import FUSED_DTYPES
from sharding.layout import on_gpu

PAGE_HEADS = 16  # the kernel's block_h: query heads per program (it pads a unit's heads to a multiple)


def interpret(backend: str | None = None) -> bool | None:
    """Pallas's interpreter (True), the GPU kernel (False), or None where this path does not run, on `backend`
    (the platform the program is built for; default jax's)."""
    return False if on_gpu(backend) else None


def applies(q: jax.Array, n_ctx: int, backend: str | None = None) -> bool:
    """Whether a sparse layer's forward can run paged (static): a GPU, 16-bit, no context sharding (a decode
    step over cache slots included)."""
    return interpret(backend) is not None and q.dtype in FUSED_DTYPES and n_ctx == 1


def paged_form(key_valid: jax.Array | None) -> jax.Array:
    """Whether every row's key_valid [B, S_k] is a prefix (a scalar bool): the kept slots are then a prefix of
    each query's sorted pages (module docstring)."""
    if key_valid is None:
        return jnp.asarray(True)
    lengths = jnp.sum(key_valid, axis=-1, dtype=jnp.int32)
    return jnp.all(key_valid == (jnp.arange(key_valid.shape[1])[None, :] < lengths[:, None]))


def page_tables(ids: jax.Array, positions: jax.Array, lengths: jax.Array, block_size: int, n_blocks: int,
                kv_of: np.ndarray, idx_of: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(pages [B, S, U, K] int32 into the [B, KV, nb] page pool, ascending, unselected entries last; seen
    slots [B, S, U] int32) for ids [B, S, Hi, K] (-1 = none), positions [B, S], key lengths [B]."""
    b = ids.shape[0]
    unit = jnp.asarray(ids)[:, :, idx_of]  # [B, S, U, K]
    blocks = jnp.sort(jnp.where(unit < 0, n_blocks, unit), axis=-1)
    threshold = jnp.minimum(positions + 1, lengths[:, None])[:, :, None, None]  # keys < it are seen
    seen = jnp.clip(threshold - blocks * block_size, 0, block_size).sum(-1).astype(jnp.int32)
    base = (jnp.arange(b)[:, None] * len(np.unique(kv_of)) + jnp.asarray(kv_of)[None, :]) * n_blocks  # [B, U]
    pages = base[:, None, :, None] + jnp.minimum(blocks, n_blocks - 1)
    return pages.astype(jnp.int32), seen


def paged_attention_forward(q, k, v, positions, key_valid, ids, block_size: int, scale: float, kv_of, idx_of,
                            interpret_kernel: bool):
    """o [B, S, H, D] of queries q [B, S, H, D] at `positions` over the pages of k/v [B, S_k, KV, D] their units
    selected; the form of the module docstring assumed (the caller checks it)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    b, s, h, d = q.shape
    sk, kvh, u = k.shape[1], k.shape[2], len(kv_of)
    n_blocks = -(-sk // block_size)
    lengths = jnp.full((b,), sk, jnp.int32) if key_valid is None else jnp.sum(key_valid, -1, dtype=jnp.int32)
    pages, seen = page_tables(ids, positions, lengths, block_size, n_blocks, kv_of, idx_of)

    def pool(a):  # [B, S_k, KV, D] -> [1, B * KV * nb, bs, D]
        a = jnp.pad(a, ((0, 0), (0, n_blocks * block_size - sk), (0, 0), (0, 0)))
        return a.reshape(b, n_blocks, block_size, kvh, d).transpose(0, 3, 1, 2, 4).reshape(1, -1, block_size, d)

    heads = h // u
    k_pages = pool(k)
    # the kernel takes no softmax scale; its per-key scales multiply the fp32 logits, as the other paths scale
    scales = jnp.full(k_pages.shape[:3], scale, jnp.float32)
    o = paged_attention(q.reshape(b * s * u, heads, d), k_pages, pool(v), pages.reshape(b * s * u, -1),
                        seen.reshape(-1), scales, block_h=PAGE_HEADS, pages_per_compute_block=1, k_splits=1,
                        interpret=interpret_kernel)
    o = o.reshape(b, s, u, heads, d)
    # a query that sees nothing: the mean of v over every slot, as the masked softmax of all-equal logits
    mean_v = jnp.mean(v.astype(jnp.float32), axis=1).astype(o.dtype)[:, jnp.asarray(kv_of)]  # [B, U, D]
    mean_v = mean_v[:, None, :, None, :]
    o = jnp.where((seen == 0)[..., None, None], mean_v, o)
    return o.reshape(b, s, h, d)


def paged_sparse_attention(q, k, v, positions, key_valid, ids, cfg, kv_of, idx_of, gather, backend: str | None = None):
    """The sparse layer's attention over the blocks `ids` [B, S, Hi, K] selected: the paged kernel where the
    mask has its form, else gather(q, k, v, ids, positions, key_valid) (the `gather` path replaying ids, a
    function of its arguments alone), which also gives the VJP. backend: the platform the program is built
    for (default jax's): the kernel is compiled for a GPU there, interpreted elsewhere."""
    kernel = functools.partial(paged_attention_forward, block_size=cfg.index_block_size,
                               scale=cfg.head_dim ** -0.5, kv_of=kv_of, idx_of=idx_of,
                               interpret_kernel=interpret(backend) is not False)  # called directly off a GPU: interpreted

    @jax.custom_vjp
    def attend(q, k, v, ids, positions, key_valid):
        def paged(q, k, v, ids, positions, key_valid):
            return kernel(q, k, v, positions, key_valid, ids).astype(q.dtype)

        return jax.lax.cond(paged_form(key_valid), paged, gather, q, k, v, ids, positions, key_valid)

    def fwd(q, k, v, ids, positions, key_valid):
        return jax.vjp(lambda q, k, v: gather(q, k, v, ids, positions, key_valid), q, k, v)

    attend.defvjp(fwd, lambda vjp, g: (*vjp(g), None, None, None))
    return attend(q, k, v, ids, positions, key_valid)
