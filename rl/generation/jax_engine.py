"""The embedded generation backend: batched prefill + KV-cache decode with the trainer's own model.

One jitted program per (batch, prompt width, max_new_tokens): prefill the right-padded prompts, then
a while-loop of single-token decode steps that stops when every row has emitted a stop token. Sparse
layers keep their indexer keys in the cache, so decoding selects blocks exactly as a full forward.
The engine holds a reference to the trainer's parameters (no copy): `set_weights` swaps it. It runs on
the model's own layout (`M3ForCausalLM.layout`): batch rows on the batch axes, sequences whole per
device, experts exchanged over the batch axes (`m3jax.model.decoder.decoding_layout`); a batch that
does not divide into the batch shards is padded with throw-away rows.

With `return_routes` the rollout carries the expert ids every MoE layer used for every prompt token
(prefill) and every sampled token (its decode step), int16 [N, W + T, n_moe_layers, k] laid out like the
training sequence prompt + response: n_moe_layers * k * 2 bytes per token (M3: 57 x 4 x 2 = 456 B), for
routing replay (`grpo.routing_replay`) and `moe/route_mismatch_frac`.

With `return_block_ids` it carries the key blocks every sparse layer's indexer selected, per index head, for
every prompt token (prefill) and sampled token (its decode step), int16 [N, W + T, n_sparse_layers, Hi, K]
(K = index_topk_blocks, -1 = none), laid out the same way: n_sparse_layers * Hi * K * 2 bytes per token
(M3 release: 57 x 4 x 16 x 2 = 7,296 B, 16x the routes), for indexer selection replay
(`grpo.indexer_replay`) and `indexer/selection_mismatch_frac`. A query at position < K * block_size keeps
every past block (nothing to select, so its selection cannot differ); dropping those entries from the
transfer is a compaction left for later.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharding.host_values import gather_to_every_process

from rl.generation.base import Rollout, SamplingParams, check_request, sampling_logits, token_logprobs


class JaxEngine:
    """`Generator` in the trainer's process: nothing is re-sent, restarted or transferred."""

    resent_rows = 0
    restarts = 0

    def __init__(self, graphdef, params, rest, *, pad_id: int = 0, return_routes: bool = False,
                 copy_weights: bool = False, return_block_ids: bool = False):
        """return_routes: fill `Rollout.routes` (the MoE expert ids of every prompt and sampled token).
        return_block_ids: fill `Rollout.block_ids` (the sparse layers' selected key blocks, likewise).
        copy_weights: keep a copy of the weights it is given (needed when it generates while the trainer
        updates them in place: `grpo.max_trajectory_age_steps` 1); otherwise it shares them."""
        self.graphdef, self.pad_id, self.return_routes = graphdef, pad_id, return_routes
        self.return_block_ids = return_block_ids
        self.copy_weights = copy_weights
        self.params, self.rest = self._own(params), self._own(rest)
        model = nnx.merge(graphdef, params, rest)  # a view: no parameter is copied
        self.layout, self.cfg = model.layout, model.cfg
        self.version = 0

    def _own(self, tree):
        return jax.tree.map(jnp.copy, tree) if self.copy_weights else tree

    def set_weights(self, params, version: int, rest=None) -> None:
        """Generate with these params (and non-trainable state) from now on; copied with copy_weights."""
        self.params, self.version = self._own(params), version
        if rest is not None:
            self.rest = self._own(rest)

    def generate(self, prompts: list[list[int]], params: SamplingParams, key: jax.Array,
                 prompt_width: int | None = None) -> Rollout:
        """prompt_width: pad prompts to this many slots (a fixed width compiles once for every batch).
        A bad request (`check_request`) raises ValueError before anything runs."""
        check_request(prompts, self.cfg.vocab_size, self.cfg.max_position_embeddings, params.max_new_tokens,
                      stop_token_ids=params.stop_token_ids)
        width = max(max(map(len, prompts)), prompt_width or 0)
        if width + params.max_new_tokens > self.cfg.max_position_embeddings:
            raise ValueError(f"prompt_width {width} + max_new_tokens {params.max_new_tokens}: expected at most the "
                             f"model's max_position_embeddings = {self.cfg.max_position_embeddings}")
        n = len(prompts)
        rows = n + (-n % self.layout.size("act_batch"))
        ids = np.full((rows, width), self.pad_id, np.int32)
        for row, p in enumerate(prompts):
            ids[row, :len(p)] = p
        lengths = np.array([len(p) for p in prompts] + [1] * (rows - n), np.int32)
        with contextlib.ExitStack() as stack:
            if self.layout.mesh is not None:
                stack.enter_context(jax.set_mesh(self.layout.mesh))
            out = _generate(self.graphdef, self.params, self.rest, jnp.asarray(ids), jnp.asarray(lengths), key,
                            params, self.pad_id, self.return_routes, self.return_block_ids,
                            jnp.asarray(np.arange(rows) < n))
        tokens, logprobs, n_new, truncated, *extra = (gather_to_every_process(a)[:n] for a in out)
        routes = extra.pop(0) if self.return_routes else None
        block_ids = extra.pop(0) if self.return_block_ids else None
        return Rollout([list(p) for p in prompts], tokens, logprobs, n_new, truncated, self.version, routes,
                       block_ids)

    def score(self, prompts: list[list[int]], responses: list[list[int]], params: SamplingParams
              ) -> list[list[np.ndarray]]:
        """One engine's logprobs of each response token (the `Generator.score` contract); a bad request
        (`check_request`) raises ValueError before anything runs."""
        check_request(prompts, self.cfg.vocab_size, self.cfg.max_position_embeddings, responses=responses)
        if not any(responses):  # nothing to score (a forward over no position would fail)
            return [[np.zeros(0, np.float32) for _ in prompts]]
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        width = max(lengths)
        rows = len(prompts) + (-len(prompts) % self.layout.size("act_batch"))
        ids = np.full((rows, width), self.pad_id, np.int32)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids[i, :lengths[i]] = list(p) + list(r)
        mask = (np.arange(width - 1)[None] < np.array(lengths + [1] * (rows - len(prompts)))[:, None] - 1)
        with contextlib.ExitStack() as stack:
            if self.layout.mesh is not None:
                stack.enter_context(jax.set_mesh(self.layout.mesh))
            lp = _score(self.graphdef, self.params, self.rest, jnp.asarray(ids), jnp.asarray(mask), params)
        lp = gather_to_every_process(lp)
        return [[lp[i, len(p) - 1:lengths[i] - 1] for i, p in enumerate(prompts)]]

    def shutdown(self) -> None:
        """Nothing to release: the engine holds references to the trainer's arrays only."""


@functools.partial(jax.jit, static_argnums=(0, 5))
def _score(graphdef, params, rest, ids, mask, sp: SamplingParams):
    model = nnx.merge(graphdef, params, rest)
    logits = model(ids[:, :-1], attention_mask=mask)
    return token_logprobs(logits, ids[:, 1:], sp.temperature, sp.top_p, sp.top_k)


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8, 9))
def _generate(graphdef, params, rest, ids, prompt_lengths, key, sp: SamplingParams, pad_id: int,
              return_routes: bool = False, return_block_ids: bool = False, live=None):
    # live: bool [B], False on rows that only pad the batch to its shards; those start done, so the decode
    # loop ends when the real rows do (a padding row sampled on would keep it going to max_new_tokens)
    model = nnx.merge(graphdef, params, rest)
    b, width = ids.shape
    max_len = width + sp.max_new_tokens
    cache = model.init_cache(b, max_len)
    valid = jnp.arange(max_len)[None] < prompt_lengths[:, None]
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
    asked = dict(return_routes=True) if return_routes else {}
    if return_block_ids:
        asked["return_block_ids"] = True
    logits, cache, *extra = model(ids, positions=positions, attention_mask=valid, cache=cache, **asked)
    real = jnp.arange(width)[None] < prompt_lengths[:, None]

    def record(prompt_ids, fill):  # int16: 2 bytes per id; the prompt's at their slots, the rest `fill`
        out = jnp.full((b, max_len, *prompt_ids.shape[2:]), fill, jnp.int16)
        mask = real.reshape(b, width, *(1,) * (prompt_ids.ndim - 2))
        return out.at[:, :width].set(jnp.where(mask, prompt_ids, fill).astype(jnp.int16))

    routes = record(extra.pop(0), 0) if return_routes else None
    blocks = record(extra.pop(0), -1) if return_block_ids else None
    last = logits[jnp.arange(b), prompt_lengths - 1]
    stops = jnp.asarray(sp.stop_token_ids or (-1,), jnp.int32)

    def pick(logits, key):
        z = sampling_logits(logits, sp.temperature, sp.top_p, sp.top_k)
        tok = jnp.argmax(z, -1) if sp.temperature == 0 else jax.random.categorical(key, z, axis=-1)
        return tok.astype(jnp.int32), jnp.take_along_axis(jax.nn.log_softmax(z, -1), tok[:, None], -1)[:, 0]

    def body(state):
        t, last, cache, key, tokens, logps, done, routes, blocks = state
        key, sub = jax.random.split(key)
        tok, logp = pick(last, sub)
        tok = jnp.where(done, pad_id, tok)
        tokens = tokens.at[:, t].set(tok)
        logps = logps.at[:, t].set(jnp.where(done, 0.0, logp))
        done = done | jnp.isin(tok, stops)
        pos = (prompt_lengths + t)[:, None]
        logits, cache, *step = model(tok[:, None], positions=pos, cache=cache, **asked)
        # the sampled token's routes and key blocks, at its place in prompt + response
        if routes is not None:
            routes = routes.at[jnp.arange(b), prompt_lengths + t].set(step.pop(0)[:, 0].astype(jnp.int16))
        if blocks is not None:
            blocks = blocks.at[jnp.arange(b), prompt_lengths + t].set(step.pop(0)[:, 0].astype(jnp.int16))
        return t + 1, logits[:, 0], cache, key, tokens, logps, done, routes, blocks

    def cond(state):
        t, done = state[0], state[6]
        return (t < sp.max_new_tokens) & ~jnp.all(done)

    init = (jnp.int32(0), last, cache, key, jnp.full((b, sp.max_new_tokens), pad_id, jnp.int32),
            jnp.zeros((b, sp.max_new_tokens), jnp.float32),
            jnp.zeros((b,), bool) if live is None else ~live, routes, blocks)
    t, _, _, _, tokens, logps, done, routes, blocks = jax.lax.while_loop(cond, body, init)
    is_stop = jnp.isin(tokens, stops)
    first_stop = jnp.where(is_stop.any(-1), jnp.argmax(is_stop, -1) + 1, sp.max_new_tokens)
    # left where the batch's shards are: every process reads them whole (`gather_to_every_process`), which on a
    # mesh over several hosts moves a chunk at a time, where a replicated output held all of it on every device
    return (tokens, logps, first_stop, ~is_stop.any(-1), *(() if routes is None else (routes,)),
            *(() if blocks is None else (blocks,)))


# The jitted program `JaxEngine.generate` runs: (graphdef, params, rest, ids [B, W], prompt_lengths [B], key,
# SamplingParams, pad_id, return_routes=False, return_block_ids=False, live=None), arguments 0 and 6-9 static.
# Public for tools that inspect what the engine compiles (`generate_program.lower(...).compile().as_text()`,
# as scripts/bench_generate.py --profile does).
generate_program = _generate
