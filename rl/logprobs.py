"""The logprob pass: per-token log-probabilities of given targets under the current (or reference)
weights, through the same model and sampling transform as the loss, on the run's layout.

Used for `logp_old`, the KL reference and the engines' probe checks. It runs under the layout's mesh
with the batch placed as the train step places it, so it lowers to the same expert-parallel program
as the update (a pass outside the mesh would gather every expert onto every device).

`chunked_token_logprobs` computes the same logprobs from the model's final hidden states a block of
positions at a time (rematerialised in the backward pass), so neither the pass nor the loss holds the
[tokens, vocab] logits (200,064 columns at M3 scale); `model.logprob_chunk_tokens` selects it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from m3jax.model.decoder import ACT, lm_head_logits
from rl.generation.base import SamplingParams, token_logprobs
from sharding.layout import Layout
from sharding.train_step import batch_sharding

_INPUTS = ("input_ids", "attention_mask", "targets")


def chunked_token_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, temperature: float,
                           top_p: float = 1.0, top_k: int = 0, *, chunk_tokens: int,
                           layout: Layout = Layout()) -> jax.Array:
    """log p(target) [..., T] (fp32) from final hidden states [..., T, d] and the LM head [V, d]:

        logp[..., t] = log_softmax(sampling_logits(hidden[..., t, :] @ lm_head.T, temperature, top_p,
                                                   top_k))[targets[..., t]]

    i.e. `token_logprobs(lm_head_logits(hidden, lm_head), targets, ...)`, computed for at most
    `chunk_tokens` positions of every row at a time: a `lax.map` over blocks whose body is
    `jax.checkpoint`ed, so the forward keeps only one block's [..., chunk, V] logits live and the backward
    recomputes each block's logits instead of saving them (what it keeps per block is the hidden block).
    Values and gradients (w.r.t. hidden and lm_head) are today's full-logits ones; only the order of the
    lm_head gradient's sum over positions changes (block by block).

    Blocks are strided, position t = c * n + j in block j of n: on a layout that cuts the sequence over
    devices (`act_seq`), every block is spread over all of them as the sequence is, so each device works
    on every block and no block gathers positions across devices. T is padded up to n * ceil(T / n) (at
    most n - 1 padded positions, zero hidden states and target 0, dropped from the result). With
    T <= chunk_tokens there is one block and this is exactly the full-logits computation.
    layout: where the block's logits live (the model's `layout`; logical axes only).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r}: expected an integer >= 1")
    *lead, t, d = hidden.shape
    if tuple(targets.shape) != (*lead, t):
        raise ValueError(f"targets {targets.shape} do not match hidden {hidden.shape} without its last axis")
    rows = math.prod(lead)
    h = hidden.reshape(rows, t, d)
    y = targets.reshape(rows, t)

    n = -(-t // chunk_tokens)
    if n == 1:
        logits = lm_head_logits(h, lm_head, layout)
        return token_logprobs(logits, y, temperature, top_p, top_k).reshape(*lead, t)

    def block(w32, h_blk, y_blk):  # [rows, c, d], [rows, c] -> [rows, c]
        return token_logprobs(lm_head_logits(h_blk, w32.astype(lm_head.dtype), layout), y_blk, temperature,
                              top_p, top_k)

    c = -(-t // n)  # positions per block; n * c - t < n padded positions
    pad = n * c - t
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        y = jnp.pad(y, ((0, 0), (0, pad)))
    # [rows, c * n] -> [n, rows, c]: block j holds positions j, n + j, 2n + j, ...
    h = layout.constrain(h.reshape(rows, c, n, d).transpose(2, 0, 1, 3), (None, *ACT))
    y = y.reshape(rows, c, n).transpose(2, 0, 1)
    remat_block = jax.checkpoint(block, prevent_cse=False)  # inside a loop CSE cannot undo the remat
    # The loop sums its blocks' lm_head gradients in the dtype of what it closes over. Closing over an
    # fp32 copy (the round trip to a bf16 head inside the block is exact: same logits) sums a bf16 head's
    # gradient in fp32 and rounds it once, as the full path's single matmul does. Measured on a bf16 head
    # against a float64 gradient of the same bf16 logits (64 blocks): full path 2.4e-3 mean relative
    # error, this 1.9e-3; summing in bf16 instead 7.1e-3.
    w32 = lm_head.astype(jnp.promote_types(lm_head.dtype, jnp.float32))
    out = jax.lax.map(lambda hy: remat_block(w32, *hy), (h, y))  # [n, rows, c]
    return out.transpose(1, 2, 0).reshape(rows, n * c)[:, :t].reshape(*lead, t)


def policy_logprobs(model, mb: dict, sampling: SamplingParams, chunk_tokens: int = 0) -> jax.Array:
    """log p(mb["targets"]) [B, S] under `sampling`'s transform for one micro-batch (input_ids,
    attention_mask, targets [B, S]): the logprob pass and the GRPO loss both call this.
    chunk_tokens: 0 = full [B, S, V] logits; else `chunked_token_logprobs` with that many positions per
    block."""
    sp = sampling
    if not chunk_tokens:
        logits = model(mb["input_ids"], attention_mask=mb["attention_mask"])
        return token_logprobs(logits, mb["targets"], sp.temperature, sp.top_p, sp.top_k)
    hidden = model(mb["input_ids"], attention_mask=mb["attention_mask"], hidden=True)
    return chunked_token_logprobs(hidden, model.lm_head[...], mb["targets"], sp.temperature, sp.top_p, sp.top_k,
                                  chunk_tokens=chunk_tokens, layout=model.layout)


def make_logprob_pass(graphdef, sampling: SamplingParams, layout: Layout = Layout(), chunk_tokens: int = 0):
    """pass_(params, rest, batch) -> logp [micro-batches, batch, seq] for batch arrays
    [micro-batches, batch, seq] with input_ids, attention_mask and targets (micro-batches run in turn).
    chunk_tokens: positions per logits block (`policy_logprobs`; 0 = full logits)."""

    @jax.jit
    def run(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        return jax.lax.map(lambda mb: policy_logprobs(model, mb, sampling, chunk_tokens), batch)

    def pass_(params, rest, batch):
        batch = {k: batch[k] for k in _INPUTS}
        if layout.mesh is None:
            return run(params, rest, batch)
        rows = np.shape(batch["input_ids"])[1]
        extra = -rows % layout.size("act_batch")  # e.g. a handful of probe rows: pad, then drop
        if extra:
            batch = {k: np.pad(np.asarray(v), [(0, 0), (0, extra), (0, 0)]) for k, v in batch.items()}
        spec = batch_sharding(layout).spec
        batch = {k: jax.device_put(v, NamedSharding(layout.mesh, P(*spec[:np.ndim(v)]))) for k, v in batch.items()}
        with jax.set_mesh(layout.mesh):
            out = run(params, rest, batch)
        return out[:, :rows] if extra else out

    pass_.jitted = run
    return pass_
