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

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from m3jax.model.decoder import ACT, lm_head_logits
from rl.generation.base import SamplingParams, token_logprobs, token_logprobs_and_entropy
from sharding.host_values import place_host_value
from sharding.layout import Layout
from sharding.train_step import batch_sharding, step_copier, step_copy_shardings
from sharding.widths import cut_micro_batch, micro_widths, on_host, padded_to

_INPUTS = ("input_ids", "attention_mask", "targets")


def chunked_token_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, temperature: float,
                           top_p: float = 1.0, top_k: int = 0, *, chunk_tokens: int, layout: Layout = Layout(),
                           head_axes: tuple | None = None, with_entropy: bool = False):
    """log p(target) [..., T] (fp32) from final hidden states [..., T, d] and the LM head [V, d]:

        logp[..., t] = log_softmax(sampling_logits(hidden[..., t, :] @ lm_head.T, temperature, top_p,
                                                   top_k))[targets[..., t]]

    i.e. `token_logprobs(lm_head_logits(hidden, lm_head), targets, ...)`, computed for at most
    `chunk_tokens` positions of every row at a time, so no [..., T, V] array is ever live. Forward: a
    `lax.map` over blocks keeps one block's logits. Backward (a custom VJP; it saves only its inputs): a
    scan recomputes each block's logits, back-propagates them to the block's hidden states, and adds the
    block's lm_head gradient, kept in fp32, to an fp32 sum rounded once to the head's dtype at the end,
    as the full path's single matmul rounds once. Values and hidden-state gradients are the full path's
    (the same ops per position); the lm_head gradient differs only in the order of its fp32 sum.
    Measured on a bf16 head against a float64 gradient of the same bf16 logits (64 blocks): the full path
    2.4e-3 mean relative error, this 1.6e-3; autodiff through the loop (each block's share rounded to
    bf16, summed in bf16) 7.1e-3. The fp32 sum is one [V, d] fp32 array, and only in the backward.

    Blocks are strided, position t = c * n + j in block j of n: on a layout that cuts the sequence over
    devices (`act_seq`), every block is spread over all of them as the sequence is, so each device works
    on every block and no block gathers positions across devices. T is padded up to n * ceil(T / n) (at
    most n - 1 padded positions, zero hidden states and target 0, dropped from the result). With
    T <= chunk_tokens there is one block: exactly the full-logits program, autodiff included.
    layout: where the block's logits live (the model's `layout`; logical axes only). head_axes: the head's
    logical axes (the model's parameter metadata): the fp32 gradient sum is placed as the head is.
    with_entropy: return (logp, H) [..., T] each, H the entropy of the sampling distribution at each position
    (`token_logprobs_and_entropy`), from the same block's logits and with its gradient.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r}: expected an integer >= 1")
    *lead, t, d = hidden.shape
    if tuple(targets.shape) != (*lead, t):
        raise ValueError(f"targets {targets.shape} do not match hidden {hidden.shape} without its last axis")
    rows = math.prod(lead)
    h = hidden.reshape(rows, t, d)
    y = targets.reshape(rows, t)

    sampling = (temperature, top_p, top_k)
    per_token = token_logprobs_and_entropy if with_entropy else token_logprobs
    n = -(-t // chunk_tokens)
    if n == 1:
        out = per_token(lm_head_logits(h, lm_head, layout), y, *sampling)
        return jax.tree.map(lambda a: a.reshape(*lead, t), out)
    c = -(-t // n)  # positions per block; n * c - t < n padded positions
    pad = n * c - t
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        y = jnp.pad(y, ((0, 0), (0, pad)))
    # [rows, c * n] -> [n, rows, c]: block j holds positions j, n + j, 2n + j, ...
    h = layout.constrain(h.reshape(rows, c, n, d).transpose(2, 0, 1, 3), (None, *ACT))
    y = y.reshape(rows, c, n).transpose(2, 0, 1)
    out = _blocks(sampling, layout, head_axes, per_token)(h, lm_head, y)  # [n, rows, c] (each)
    return jax.tree.map(lambda a: a.transpose(1, 2, 0).reshape(rows, n * c)[:, :t].reshape(*lead, t), out)


def _blocks(sampling: tuple, layout: Layout, head_axes, per_token=token_logprobs):
    """blocks(h [n, rows, c, d], w [V, d], y [n, rows, c]) -> per_token's output (logp, or (logp, H)), each
    [n, rows, c], block by block over the leading axis, with the backward of `chunked_token_logprobs`."""

    # XLA:CPU has no bf16 matmul: it upcasts the head, and loop-invariant code motion then hoists an fp32
    # copy of it out of the loop (at M3's 200,064 x 6144 head, 4.7 GB per copy, two in the forward: more
    # than the logits saved). Tying the head to the block in an optimization barrier keeps the upcast
    # inside the matmul. CPU only: elsewhere bf16 matmuls are native, and the barrier would also keep an
    # FSDP all-gather of the head from being hoisted out of the loop.
    tie = jax.lax.optimization_barrier if layout.backend == "cpu" else (lambda xw: xw)

    def block(h_blk, w, y_blk):
        h_blk, w = tie((h_blk, w))
        return per_token(lm_head_logits(h_blk, w, layout), y_blk, *sampling)

    @jax.custom_vjp
    def blocks(h, w, y):
        return jax.lax.map(lambda hy: block(hy[0], w, hy[1]), (h, y))

    def fwd(h, w, y):
        return blocks(h, w, y), (h, w, y)

    def bwd(res, ct):
        h, w, y = res
        acc = jnp.promote_types(w.dtype, jnp.float32)
        _, rows, c, _ = h.shape
        shards = _token_shards(layout, rows, c) if head_axes is not None else None

        def step(dw, xs):
            h_blk, y_blk, ct_blk = xs
            h_blk, w_blk = tie((h_blk, w))
            # the block's logits and their cotangent exactly as autodiff of the full path makes them
            logits, head_vjp = jax.vjp(lambda x: lm_head_logits(x, w_blk, layout), h_blk)
            dz = jax.vjp(lambda z: per_token(z, y_blk, *sampling), logits)[1](ct_blk)[0]
            if shards is not None:  # each batch shard adds its own tokens' share, summed over them after the scan
                dw = dw + jnp.einsum("arcv,arcd->avd", _by_shard(dz, shards), _by_shard(h_blk, shards),
                                     preferred_element_type=acc)
                return layout.constrain(dw, HEAD_PARTIALS), head_vjp(dz)[0]
            dw = dw + jnp.einsum("bsv,bsd->vd", dz, h_blk, preferred_element_type=acc)
            return (dw if head_axes is None else layout.constrain(dw, head_axes)), head_vjp(dz)[0]

        if shards is not None:
            dw0 = layout.constrain(jnp.zeros((shards, *w.shape), acc), HEAD_PARTIALS)
            dw, dh = jax.lax.scan(step, dw0, (h, y, ct))
            dw = layout.constrain(jnp.sum(dw, axis=0), head_axes)  # the one reduction over the batch shards
        else:
            dw0 = jnp.zeros(w.shape, acc)
            dw, dh = jax.lax.scan(step, dw0 if head_axes is None else layout.constrain(dw0, head_axes), (h, y, ct))
        return dh, dw.astype(w.dtype), None  # targets: integers, no cotangent

    blocks.defvjp(fwd, bwd)
    return blocks


# The head gradient's partial sums, one per batch shard [batch shards, V, d], each cut over the sequence's devices on
# d: a block's contribution is summed over the sequence shards where it is made (a reduce-scatter over `act_seq`:
# context parallelism, inside a node) and over the batch shards (data, across nodes) once, after the backward's
# scan. Constraining a [V, d] sum to the head's layout instead made the partitioner reduce the whole fp32 head over
# data at every block (at M3's shapes 8 blocks x 4.6 GB over the inter-node axis per micro-batch); keeping a whole
# [V, d] sum per device would cost 4.9 GB of fp32 where this keeps 1 / context of it.
HEAD_PARTIALS = ("act_batch", "act_vocab", "act_seq")


def _token_shards(layout: Layout, rows: int, c: int) -> int | None:
    """Batch shards of a [rows, c] block of positions when the layout cuts the batch and they divide its rows;
    None otherwise (the head gradient is then summed in its own layout, block by block)."""
    nb = layout.size("act_batch")
    if nb == 1 or rows % nb:
        return None
    return nb


def _by_shard(x: jax.Array, nb: int) -> jax.Array:
    """[rows, c, ...] -> [nb, rows / nb, c, ...]: the batch shards as the leading dimension (a reshape of the
    layout's own cut: no data moves)."""
    return x.reshape(nb, x.shape[0] // nb, *x.shape[1:])


def policy_logprobs(model, mb: dict, sampling: SamplingParams, chunk_tokens: int = 0, replay: bool = False,
                    return_routes: bool = False, replay_blocks: bool = False, return_block_ids: bool = False,
                    return_indexer_kl: bool = False, return_entropy: bool = False):
    """log p(mb["targets"]) [B, S] under `sampling`'s transform for one micro-batch (input_ids,
    attention_mask, targets [B, S]): the logprob pass and the GRPO loss both call this.
    chunk_tokens: 0 = full [B, S, V] logits; else `chunked_token_logprobs` with that many positions per
    block. replay: the MoE layers replay mb["routes"] [B, S, n_moe_layers, k] (the generator's expert ids;
    routing replay). return_routes: return (logp, the router's own top-k ids [B, S, n_moe_layers, k]).
    replay_blocks: the sparse layers attend over mb["block_ids"] [B, S, n_sparse_layers, Hi, K] (the
    generator's key blocks; indexer selection replay). return_block_ids: also return the indexer's own
    top-K block ids [B, S, n_sparse_layers, Hi, K] (last: (logp, [routes,] block ids)). return_indexer_kl:
    also return, last, the indexer alignment KL per position [B, S] (`m3jax.model.indexer_align`, averaged
    over the sparse layers). return_entropy: also return, second (right after logp), the entropy of the
    sampling distribution at each position [B, S] (`token_logprobs_and_entropy`, with its gradient)."""
    sp = sampling
    moe = {}
    if replay:
        moe["routes"] = mb["routes"]
    if return_routes:
        moe["return_routes"] = True
    if replay_blocks:
        moe["block_ids"] = mb["block_ids"]
    if return_block_ids:
        moe["return_block_ids"] = True
    if return_indexer_kl:
        moe["return_indexer_kl"] = True
    out = model(mb["input_ids"], attention_mask=mb["attention_mask"], hidden=bool(chunk_tokens), **moe)
    extra = ()
    if return_routes or return_block_ids or return_indexer_kl:
        out, *extra = out
    if not chunk_tokens:
        per_token = token_logprobs_and_entropy if return_entropy else token_logprobs
        logp = per_token(out, mb["targets"], sp.temperature, sp.top_p, sp.top_k)
    else:
        logp = chunked_token_logprobs(out, model.lm_head[...], mb["targets"], sp.temperature, sp.top_p, sp.top_k,
                                      chunk_tokens=chunk_tokens, layout=model.layout,
                                      head_axes=model.lm_head.get_metadata()["logical_axes"],
                                      with_entropy=return_entropy)
    out = (*logp, *extra) if return_entropy else (logp, *extra)  # logp, [entropy,] extras
    return out if len(out) > 1 else out[0]


def make_logprob_pass(graphdef, sampling: SamplingParams, layout: Layout = Layout(), chunk_tokens: int = 0,
                      replay: bool = False, indexer_replay: bool = False, widths: Sequence[int] = ()):
    """pass_(params, rest, batch) -> logp [micro-batches, batch, seq] for batch arrays
    [micro-batches, batch, seq] with input_ids, attention_mask and targets (micro-batches run in turn).
    chunk_tokens: positions per logits block (`policy_logprobs`; 0 = full logits).
    A batch with "routes" (the generator's MoE expert ids [micro-batches, batch, seq, n_moe_layers, k]) and/or
    "block_ids" (the generator's key blocks [micro-batches, batch, seq, n_sparse_layers, Hi, K]) gives
    (logp, {"routes": the trainer's own top-k ids, "block_ids": its indexer's own top-K blocks}, each the
    shape of the generator's, int32, present when the batch has them): the routes are replayed when
    `replay` (routing replay) and the blocks when `indexer_replay` (indexer selection replay), else only
    compared with (`rl.grpo.mismatch.route_mismatch_frac`, `selection_mismatch_frac`).
    widths: as `sharding.train_step.make_train_step`'s: each micro-batch runs cut to the smallest that holds
    its rows, and its outputs come back zero-padded at the positions past them."""

    @functools.partial(jax.jit, static_argnames=("with_routes", "with_blocks"))
    def run(params, rest, batch, with_routes=False, with_blocks=False):
        model = nnx.merge(graphdef, params, rest)

        def one(mb):
            out = policy_logprobs(model, mb, sampling, chunk_tokens, replay and with_routes, with_routes,
                                  indexer_replay and with_blocks, with_blocks)
            if not (with_routes or with_blocks):
                return out
            logp, *extra = out
            names = ("routes",) * with_routes + ("block_ids",) * with_blocks
            return logp, dict(zip(names, extra))

        return jax.lax.map(one, batch)

    copiers = {}  # the step copy's gather (`sharding.train_step.step_copier`), made at the first call

    def copy(params):
        """The weights every micro-batch of one pass reads: gathered once over the layout's `fsdp_step_axes`."""
        if "fn" not in copiers:
            copiers["fn"] = step_copier(None if layout.mesh is None else step_copy_shardings(layout, params))
        return copiers["fn"](params)

    def pass_(params, rest, batch):
        return one_pass(copy(params), rest, batch)

    def one_pass(params, rest, batch):
        with_routes, with_blocks = "routes" in batch, "block_ids" in batch
        batch = {k: batch[k] for k in _INPUTS + ("routes",) * with_routes + ("block_ids",) * with_blocks}
        flags = dict(with_routes=with_routes, with_blocks=with_blocks)
        if layout.mesh is None:
            return run(params, rest, batch, **flags)
        rows = np.shape(batch["input_ids"])[1]
        if problem := layout.batch_problem(rows + -rows % layout.size("act_batch"), np.shape(batch["input_ids"])[2]):
            raise ValueError(f"logprob pass batch: {problem}")  # jax's IndivisibleError named no setting
        extra = -rows % layout.size("act_batch")  # e.g. a handful of probe rows: pad, then drop
        if extra:
            batch = {k: np.pad(np.asarray(v), [(0, 0), (0, extra)] + [(0, 0)] * (np.ndim(v) - 2))
                     for k, v in batch.items()}
        spec = batch_sharding(layout).spec
        batch = {k: place_host_value(v, NamedSharding(layout.mesh, P(*spec[:np.ndim(v)]))) for k, v in batch.items()}
        with jax.set_mesh(layout.mesh):
            out = run(params, rest, batch, **flags)
        return jax.tree.map(lambda a: a[:, :rows], out) if extra else out

    pass_.jitted = run
    if not widths:
        return pass_

    def cut_pass(params, rest, batch):
        """Each micro-batch at its width (`sharding.widths`, one call each, so a step's mix of widths compiles
        one program per width), the outputs zero-padded back to the batch's positions."""
        full = np.shape(batch["input_ids"])[2]
        inputs = {k: on_host(batch[k]) for k in _INPUTS + ("routes", "block_ids") if k in batch}
        params = copy(params)
        outs = [one_pass(params, rest, {k: v[None] for k, v in cut_micro_batch(inputs, m, w).items()})
                for m, w in enumerate(micro_widths(np.asarray(batch["attention_mask"]), widths))]

        def stitch(*xs):  # on the host where this process holds the outputs (see `sharding.widths.on_host`)
            xs = [padded_to(on_host(x), full) for x in xs]
            return np.concatenate(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.concatenate(xs)

        return jax.tree.map(stitch, *outs)

    cut_pass.jitted = run
    return cut_pass
