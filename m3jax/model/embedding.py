"""The token embedding lookup, whose gradient sums a token's contributions in fp32.

    x[b, s] = embed[ids[b, s]]          d embed[v] = sum over positions with ids == v of d x[b, s]

jax's transpose of a gather is a scatter-add in the table's dtype: in a bf16 model each repeat of a token added
its contribution to a bf16 running sum, so the most frequent tokens' rows (chat-template tokens, newlines: thousands
a micro-batch) came out tens of percent off (12.7 % for a token at 30 % of 2,048 positions, an audit; torch's CUDA
embedding backward sums in fp32). Here the sum is fp32 and rounded once. The fp32 [vocab, d] buffer lives only in
the backward, as the chunked logprob pass's lm_head gradient does. An fp32 table keeps jax's own program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def embed_tokens(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table [vocab, d], ids [...] int -> [..., d]: table[ids], as `jnp.take(table, ids, axis=0)`."""
    if table.dtype == jnp.float32:
        return jnp.take(table, ids, axis=0)
    return _fp32_summed_take(table.shape, jnp.dtype(table.dtype))(table, ids)


@functools.cache
def _fp32_summed_take(shape: tuple[int, ...], dtype):
    @jax.custom_vjp
    def take(table, ids):
        return jnp.take(table, ids, axis=0)

    def forward(table, ids):
        return jnp.take(table, ids, axis=0), ids

    def backward(ids, grad):
        with jax.named_scope("embed_tokens_grad"):  # what the compiled step's collectives are named after
            rows = jnp.zeros(shape, jnp.float32).at[ids].add(grad.astype(jnp.float32), mode="drop")
            return rows.astype(dtype), None

    take.defvjp(forward, backward)
    return take
