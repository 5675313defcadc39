"""The M3 causal LM in Flax NNX: embedding, scanned decoder stacks, final norm, untied LM head.

Layers are grouped into stacks of consecutive layers with the same (attention, MLP) kind; each stack
holds its parameters with a leading "layers" axis and runs as one `jax.lax.scan` with
rematerialisation, so compile time does not grow with depth. Parameters carry logical axis names
(`logical_axes` metadata) that the layout's rules map onto its mesh; nothing here names a mesh axis.
The model keeps the `Layout` it was built for, so its activations and expert exchange follow that
placement whatever mesh context it is later called under.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from flax import nnx

from m3jax.config import ConfigError, M3Config
from m3jax.model.attention import IMPLS as ATTENTION_IMPLS, SPARSE_IMPLS
from m3jax.model.attention import attention_block
from m3jax.model.embedding import embed_tokens
from m3jax.model.inputs import check_inputs
from m3jax.model.kv_cache import LayerCache
from m3jax.model.mlp import dense_mlp
from m3jax.model.moe import moe_block
from m3jax.model.norms import rms_norm
from m3jax.model.remat import REMAT_POLICIES, remat_policy_fn  # noqa: F401 (REMAT_POLICIES: public here too)
from m3jax.model.rope import rope_cos_sin
from m3jax.model.specs import MOE_MLP, SPARSE_ATTENTION, ParamSpec, layer_param_specs, top_param_specs
from sharding.grouped_matmul import resolve_kernel
from sharding.layout import Layout, as_layout
from sharding.rules import mesh_axes_of

ACT = ("act_batch", "act_seq", "act_embed")
LOGITS = ("act_batch", "act_seq", "act_vocab")
class Buffer(nnx.Variable):
    """Non-trainable state saved with the checkpoint (the router's correction bias)."""


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype, sharding: NamedSharding | None) -> jax.Array:
    """0.02 x jax.random.normal's fp32 draw, cast to `dtype`, computed on `sharding` (None: jax's default device): the
    partitioner gives each device the elements of its own shard, and jax's partitionable threefry makes them the
    whole draw's. One program per weight shape (the scale and the cast as eager ops were two more each). The barrier
    keeps XLA from fusing the scale into the sampler, which moved 6.5 % of the elements by 1 ulp of fp32: apart,
    they are the bits the eager ops gave."""
    x = 0.02 * lax.optimization_barrier(jax.random.normal(key, shape, jnp.float32))
    x = x.astype(dtype)
    return x if sharding is None else lax.with_sharding_constraint(x, sharding)


def _make(spec: ParamSpec, dtype, key, layout: Layout) -> nnx.Variable:
    """A parameter made on its shards of `layout` (its logical axes' sharding): no device ever holds the whole of a
    cut weight, which for a release-sized model is more than a device has. The values are the one-device draw's,
    bit for bit (tests/test_initialised_state.py)."""
    dt = jnp.float32 if spec.fp32 else jnp.dtype(dtype)
    sharding = layout.sharding(spec.axes)
    value = jnp.zeros(spec.shape, dt, device=sharding) if spec.init == "zeros" else \
        _normal(key, spec.shape, dt, sharding)
    cls = Buffer if spec.buffer else nnx.Param
    return cls(value, logical_axes=spec.axes)


def decoding_layout(layout: Layout) -> Layout:
    """The layout for decoding (and its prefill): a step's single token cannot be cut over the context
    axis, so sequences stay whole per device, and the experts exchange only over the axes that then
    hold distinct tokens (the batch axes). Heads and batch stay placed as in training."""
    batch_axes = mesh_axes_of("act_batch", layout.rules)
    experts = tuple(a for a in mesh_axes_of("experts", layout.rules) if a in batch_axes)
    return layout.with_rule("act_seq", None).with_rule("experts", experts)


def lm_head_logits(x: jax.Array, lm_head: jax.Array, layout: Layout = Layout()) -> jax.Array:
    """Logits [B, S, vocab] = x [B, S, d] @ lm_head [vocab, d].T, in the operands' dtype (no upcast: a
    bf16 model gives bf16 logits), placed on `LOGITS`. The model's forward and the chunked logprob pass
    (`rl.logprobs`, a block of positions at a time) both use this, so their logits are the same numbers."""
    return layout.constrain(jnp.einsum("bsd,vd->bsv", x, lm_head), LOGITS)


class LayerStack(nnx.Module):
    """Consecutive decoder layers of one kind, parameters stacked on a leading "layers" axis."""

    def __init__(self, cfg: M3Config, attn_kind: str, mlp_kind: str, layer_ids, *, dtype, rngs: nnx.Rngs,
                 remat: bool = True, moe_capacity_factor: float | None = None, moe_exchange: str | None = None,
                 attention_query_chunk: int = 0, layout: Layout = Layout(), moe_kernel: str = "auto",
                 attention_impl: str = "auto", sparse_attention: str = "gather", remat_policy: str = "full",
                 scan_layers: bool = True):
        self.cfg, self.attn_kind, self.mlp_kind, self.layout = cfg, attn_kind, mlp_kind, layout
        self.remat_policy, self.scan_layers = remat_policy, scan_layers
        self.attention_impl, self.sparse_attention = attention_impl, sparse_attention
        self.layer_ids = tuple(layer_ids)
        self.remat, self.attention_query_chunk = remat, attention_query_chunk
        self.moe_capacity_factor, self.moe_exchange, self.moe_kernel = moe_capacity_factor, moe_exchange, moe_kernel
        n = len(self.layer_ids)
        self.param_names = tuple(layer_param_specs(cfg, attn_kind, mlp_kind))
        for name, spec in layer_param_specs(cfg, attn_kind, mlp_kind).items():
            stacked = dataclasses.replace(spec, shape=(n, *spec.shape), axes=("layers", *spec.axes))
            setattr(self, name, _make(stacked, dtype, rngs.params(), layout))

    def __call__(self, x, cos, sin, positions, key_valid, cache=None, layout: Layout | None = None,
                 routes=None, return_routes: bool = False, block_ids=None, return_block_ids: bool = False,
                 return_recall: bool = False, return_indexer_kl: bool = False, return_moe_counts: bool = False):
        """Run the stack; with `cache` (this stack's stacked KV / index-key cache) also return it updated.
        layout: overrides the stack's own (decoding keeps whole sequences on each device).
        routes [n_layers, B, S, k] (MoE stacks): replay these expert ids, layer by layer. return_routes:
        also return the ids each MoE layer used, [n_layers, B, S, k] int32 (after the cache).
        block_ids [n_layers, B, S, Hi, K] (sparse stacks): replay these key blocks, layer by layer.
        return_block_ids: also return the indexer's own block ids of each sparse layer, [n_layers, B, S, Hi,
        index_topk_blocks] int32 (after the routes; `attention_block`).
        return_recall (sparse stacks, no cache): also return each layer's indexer recall, [n_layers] fp32
        (`m3jax.model.recall.indexer_recall`). return_indexer_kl (sparse stacks, no cache): also return each
        layer's per-query indexer alignment KL, [n_layers, B, S] fp32 (`m3jax.model.indexer_align`).
        return_moe_counts (MoE stacks, no cache): also return, last, each layer's [kept, real] (token, expert)
        assignments of real tokens, [n_layers, 2] int32 (`sharding.expert.routed_experts`)."""
        cfg, layout = self.cfg, layout or self.layout
        sparse, moe = self.attn_kind == SPARSE_ATTENTION, self.mlp_kind == MOE_MLP
        return_routes = return_routes and moe
        return_block_ids = return_block_ids and sparse
        return_recall = return_recall and sparse
        return_indexer_kl = return_indexer_kl and sparse
        return_moe_counts = return_moe_counts and moe and cache is None
        params = {name: getattr(self, name)[...] for name in self.param_names}

        def layer(x_cache, p_index_routes):
            x, stacked = x_cache
            p, index, layer_routes, *layer_blocks = p_index_routes
            layer_cache = None if stacked is None else LayerCache(stacked, index)
            h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
            blocks = dict(block_ids=layer_blocks[0], return_block_ids=return_block_ids) if layer_blocks else {}
            if return_recall:
                blocks["return_recall"] = True
            if return_indexer_kl:
                blocks["return_indexer_kl"] = True
            attn = attention_block(p, h, cos, sin, positions, key_valid, cfg, sparse, layer_cache,
                                   self.attention_query_chunk, layout, self.attention_impl,
                                   self.sparse_attention, **blocks)
            attn = attn if isinstance(attn, tuple) else (attn,)
            align = attn[-1] if return_indexer_kl else None
            attn = attn[:-1] if return_indexer_kl else attn
            recall = attn[-1] if return_recall else None
            attn = attn[:-1] if return_recall else attn
            block_used = attn[-1] if return_block_ids else None
            if layer_cache is not None:
                stacked = attn[1].stacked
            x = x + attn[0]
            h = rms_norm(x, p["post_norm"], cfg.rms_norm_eps)
            ids = None
            if moe:
                # Decoding drops nothing: a step's few tokens per device would be capped by another bound
                # than the training forward's (and vLLM/HF, where rollouts also come from, are dropless).
                capacity = None if layer_cache is not None else self.moe_capacity_factor
                y = moe_block(p, h, cfg, layout, capacity, self.moe_exchange, self.moe_kernel,
                              routes=layer_routes, return_routes=return_routes,
                              token_valid=None if layer_cache is not None else key_valid,
                              return_counts=return_moe_counts)
                if return_moe_counts:
                    *y, counts = y
                    y = tuple(y) if len(y) > 1 else y[0]
                if return_routes:
                    y, ids = y
                x = x + y
            else:
                x = x + dense_mlp(h, p["mlp_gate_up"], p["mlp_down"], cfg.swiglu_alpha, cfg.swiglu_limit,
                                  layout.num_devices == 1)
            return (layout.constrain(x, ACT), stacked), ((ids,) + ((block_used,) if layer_blocks else ())
                                                         + ((recall,) if return_recall else ())
                                                         + ((align,) if return_indexer_kl else ())
                                                         + ((counts,) if return_moe_counts else ()))

        if self.remat and cache is None:
            # Inside a loop XLA cannot merge the recomputation with the forward; unrolled, it could (jax's
            # checkpoint docs), so an unrolled stack keeps jax's barrier against that.
            layer = jax.checkpoint(layer, prevent_cse=not self.scan_layers,
                                   policy=remat_policy_fn(self.remat_policy))
        # The decode cache is carried, not scanned over: each layer writes its new slots into it in place
        # (`m3jax.model.kv_cache`).
        xs = (params, jnp.arange(len(self.layer_ids)), routes if moe else None)
        if sparse and (block_ids is not None or return_block_ids):  # else today's program
            xs += (block_ids,)
        (x, cache), (used, *blocks_used) = jax.lax.scan(layer, (x, cache), xs, unroll=not self.scan_layers)
        moe_counts = (blocks_used.pop(),) if return_moe_counts else ()
        aligns = (blocks_used.pop(),) if return_indexer_kl else ()
        recalls = (blocks_used.pop(),) if return_recall else ()
        out = (x,) if cache is None else (x, cache)
        out = out + ((used,) if return_routes else ()) + ((blocks_used[0],) if return_block_ids else ()) + recalls
        out += aligns + moe_counts
        return out if len(out) > 1 else out[0]

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        cfg, n = self.cfg, len(self.layer_ids)
        kv = (n, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        cache = {"k": jnp.zeros(kv, dtype), "v": jnp.zeros(kv, dtype)}
        if self.attn_kind == SPARSE_ATTENTION:
            cache["index_k"] = jnp.zeros((n, batch, max_len, cfg.index_head_dim), dtype)
        return cache


class M3ForCausalLM(nnx.Module):
    """MiniMax-M3 language model: input_ids [B, S] -> logits [B, S, vocab] (in the param dtype)."""

    def __init__(self, cfg: M3Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, remat: bool = True,
                 moe_capacity_factor: float | None = None, moe_exchange: str | None = None,
                 attention_query_chunk: int = 0, layout=None, moe_kernel: str = "auto",
                 attention_impl: str = "auto", sparse_attention: str = "gather", remat_policy: str = "full",
                 scan_layers: bool = True):
        """remat: rematerialise each layer in the backward pass. remat_policy: what a rematerialised layer
        keeps for its backward, "full" (its input and the integer decisions) | "save_dots" (also the token-sized
        projection outputs) | "save_dots_experts" (and the routed experts' output rows; `REMAT_POLICIES`).
        moe_capacity_factor: bound on each device's expert receive buffer, x the balanced load
        (`sharding.expert.receive_rows`; one device included); overflowing (token, expert) pairs are dropped
        (contribute zero), padding (attention_mask 0) takes no capacity, and a decode step (cache) drops nothing;
        None = dropless.
        moe_exchange: "padded" | "ragged" | "ragged_emulated"; None = ragged on GPU/TPU, padded on CPU.
        moe_kernel: the experts' grouped matmul, "auto" | "ragged_dot" | "tiled" | "bucketed" | "pallas" |
        "mosaic" (`sharding.grouped_matmul`; auto = bucketed on CPU, ragged_dot elsewhere; mosaic: Hopper GPUs,
        bf16 / fp16, expert widths multiples of 128, refused here otherwise).
        attention_query_chunk: local queries per attention scores block (0 = all at once).
        attention_impl: "dense" (masked scores blocks) | "flash" (online softmax over key tiles, no
        [queries, keys] block; `m3jax.model.flash`) on full layers, and on sparse ones with "masked"; "cudnn"
        (full layers on cuDNN's fused attention where it applies, `m3jax.model.fused_attention`, else as
        "auto" off a GPU); "auto" (default): cudnn on a GPU, elsewhere flash from
        `m3jax.model.attention.FLASH_MIN_KEYS` keys on, dense below.
        sparse_attention: "paged" (gather, with its passes that take no gradient on jax's Pallas paged-attention
        kernel on a GPU, `m3jax.model.paged_sparse`) | "gather" (sparse layers read only the key blocks the indexer
        kept, `m3jax.model.sparse`) | "masked" (the indexer's selection as a mask on attention_impl's attention).
        scan_layers: run each stack of same-kind layers as one loop over its stacked weights (the program and
        its compile time do not grow with depth) or, False, unrolled: one copy of the layer per layer, with no
        per-layer slicing of the stacked weights and no stacked residuals. Same values. On CPU, for the tiny
        release-like model, unrolled runs fwd+bwd without remat 4-6 % faster and with remat 0-13 % slower; the
        JAX engine's decode runs as fast either way (BENCHMARKS.md, session 28).
        layout: the `sharding.layout.Layout` (or a jax Mesh with the default rules) the model runs on;
        None = one device. Parameters are initialised on the layout's shardings, each device drawing only its
        own shards."""
        if isinstance(attention_query_chunk, bool) or not isinstance(attention_query_chunk, int) \
                or attention_query_chunk < 0:
            raise ValueError(f"attention_query_chunk={attention_query_chunk!r}: expected an integer >= 0")
        cf = moe_capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float, np.floating))
                               or not math.isfinite(cf) or cf <= 0):
            raise ValueError(f"moe_capacity_factor={moe_capacity_factor!r}: expected None (dropless) or a finite "
                             "number > 0")
        if not isinstance(scan_layers, bool):
            raise ValueError(f"scan_layers={scan_layers!r}: expected true or false")
        try:  # a ConfigError: the commands print it as one line naming the option
            if resolve_kernel(moe_kernel, as_layout(layout).backend) == "mosaic" and cfg.num_local_experts:
                # what the Mosaic GPU kernels cannot take, said before any weight exists (an unknown name and a
                # platform they do not run on are refused by resolve_kernel)
                from sharding.mosaic_grouped import check_shapes
                i, d = cfg.intermediate_size, cfg.hidden_size
                for w in ((cfg.num_local_experts, 2 * i, d), (cfg.num_local_experts, d, i)):
                    check_shapes(jax.ShapeDtypeStruct((1, w[2]), dtype), jax.ShapeDtypeStruct(w, dtype))
        except ValueError as e:
            raise ConfigError(f"moe_kernel={moe_kernel!r}: {e}") from None
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={attention_impl!r}: expected one of {ATTENTION_IMPLS}")
        if sparse_attention not in SPARSE_IMPLS:
            raise ValueError(f"sparse_attention={sparse_attention!r}: expected one of {SPARSE_IMPLS}")
        remat_policy_fn(remat_policy)  # fail at construction on an unknown policy name
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg, self.dtype, self.layout = cfg, jnp.dtype(dtype), as_layout(layout)
        for name, spec in top_param_specs(cfg).items():
            setattr(self, name, _make(spec, dtype, rngs.params(), self.layout))
        self.stacks = nnx.List([
            LayerStack(cfg, attn, mlp, ids, dtype=dtype, rngs=rngs, remat=remat,
                       moe_capacity_factor=moe_capacity_factor, moe_exchange=moe_exchange,
                       attention_query_chunk=attention_query_chunk, layout=self.layout, moe_kernel=moe_kernel,
                       attention_impl=attention_impl, sparse_attention=sparse_attention,
                       remat_policy=remat_policy, scan_layers=scan_layers)
            for attn, mlp, ids in cfg.segments()
        ])

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, cache: list | None = None, hidden: bool = False,
                 routes: jax.Array | None = None, return_routes: bool = False,
                 block_ids: jax.Array | None = None, return_block_ids: bool = False,
                 return_indexer_recall: bool = False, return_indexer_kl: bool = False,
                 return_moe_counts: bool = False):
        """Logits [B, S, vocab] for input_ids [B, S].

        positions [B, S] default to 0..S-1: the tokens' RoPE positions (HF's position_ids). Without a cache the
        causal mask and the indexer's blocks follow the tokens' slots 0..S-1, as in HF, so a left-padded row may
        count its positions from its first real token. attention_mask [B, S_keys] (1 = real token).
        cache (from `init_cache`): decode mode; the tokens' keys are written at slots = positions and
        (logits, updated cache) is returned. attention_mask then covers the cache's S_max slots. Positions must be
        below S_max (init_cache's max_len): refused where they are known, NaN logits where traced.
        hidden: return the final hidden states [B, S, d] (after the final norm) in place of the logits;
        `lm_head_logits(h, self.lm_head[...], self.layout)` turns them into the logits (the chunked
        logprob pass does so a block of positions at a time, never holding [B, S, vocab]).
        routes [B, S, n_moe_layers, k] (routing replay): the MoE layers use these expert ids (in MoE-layer
        order) with weights recomputed from the live router (`m3jax.model.moe.replay_route`).
        return_routes: also return the router's own top-k expert ids of every MoE layer, [B, S,
        n_moe_layers, k] int32, as the last element: (out, routes) or (out, cache, routes). Without replay
        these are the ids used; with replay, the ids the router would have chosen (`moe_block`).
        block_ids [B, S, n_sparse_layers, Hi, K] (indexer selection replay): each sparse layer (in
        sparse-layer order) attends over these key blocks (-1 = none) instead of its indexer's top-K, with
        every attention impl and in decode mode. return_block_ids: also return the indexer's own top-K
        block ids of every sparse layer, [B, S, n_sparse_layers, Hi, index_topk_blocks] int32 (-1 = none,
        and padding when the keys hold fewer blocks), as the last element (after routes): without replay
        the blocks used; with replay, those the indexer would have chosen.
        return_indexer_recall (no cache): also return, last, each sparse layer's indexer recall for the batch,
        [n_sparse_layers] fp32 (`indexer_recall`).
        return_indexer_kl (no cache): also return, last, the indexer alignment KL of every query averaged over
        the sparse layers, [B, S] fp32 (`m3jax.model.indexer_align`; model.indexer_loss_coef trains on it).
        return_moe_counts (no cache): also return, last, per MoE layer (in MoE-layer order) the batch's (token,
        expert) assignments of real tokens and those an expert ran, [n_moe_layers, 2] int32 (kept, real); real -
        kept were dropped by model.moe_capacity_factor (`moe_assignment_counts`).
        """
        cfg = self.cfg
        layout = self.layout if cache is None else decoding_layout(self.layout)
        n_sparse = self.num_sparse_layers
        b, s = check_inputs(cfg, input_ids, positions, attention_mask, cache, routes, block_ids,
                            num_moe_layers=sum(len(st.layer_ids) for st in self.stacks if st.mlp_kind == MOE_MLP),
                            num_sparse_layers=n_sparse)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if cache is None and layout.mesh is not None:  # the first constraint below raised jax's IndivisibleError
            if problem := layout.batch_problem(b, s):
                raise ValueError(problem)
        key_valid = None if attention_mask is None else attention_mask.astype(bool)
        x = layout.constrain(embed_tokens(self.embed[...], input_ids), ACT)
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
        # what the attention masks and the indexer's blocks follow: a token's slot (its cache slot in decode mode).
        # Taking the positions for the slots, a left-padded row with positions from its first real token (HF's
        # convention) had each token see the pad slots before it and not its own (logits 26 off, an audit).
        slots = positions if cache is not None else jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if return_indexer_recall and cache is not None:
            raise ValueError("return_indexer_recall needs the whole sequence (no decode cache)")
        if return_moe_counts and cache is not None:  # a decode step drops nothing
            raise ValueError("return_moe_counts needs the whole sequence (no decode cache)")
        if return_indexer_kl and (cache is not None or not n_sparse):
            raise ValueError("return_indexer_kl needs the whole sequence (no decode cache) and sparse layers; "
                             f"this call has cache={cache is not None}, {n_sparse} sparse layers")
        new_cache, used, blocks_used, recalls, aligns, moe_counts, first, first_sparse = [], [], [], [], [], [], 0, 0
        for i, stack in enumerate(self.stacks):
            n_moe = len(stack.layer_ids) if stack.mlp_kind == MOE_MLP else 0
            n_sp = len(stack.layer_ids) if stack.attn_kind == SPARSE_ATTENTION else 0
            stack_routes = None
            if routes is not None and n_moe:
                stack_routes = jnp.moveaxis(routes[:, :, first:first + n_moe].astype(jnp.int32), 2, 0)
            first += n_moe
            extra = dict(routes=stack_routes, return_routes=return_routes) if (routes is not None or return_routes) \
                else {}
            if (block_ids is not None or return_block_ids) and n_sp:
                extra.update(return_block_ids=return_block_ids, block_ids=None if block_ids is None else
                             jnp.moveaxis(block_ids[:, :, first_sparse:first_sparse + n_sp].astype(jnp.int32), 2, 0))
            first_sparse += n_sp
            if return_indexer_recall and n_sp:
                extra["return_recall"] = True
            if return_indexer_kl and n_sp:
                extra["return_indexer_kl"] = True
            if return_moe_counts and n_moe:
                extra["return_moe_counts"] = True
            out = stack(x, cos, sin, slots, key_valid, None if cache is None else cache[i], layout=layout, **extra)
            out = out if isinstance(out, tuple) else (out,)
            x = out[0]
            if cache is not None:
                new_cache.append(out[1])
            if return_moe_counts and n_moe:
                moe_counts.append(out[-1])
                out = out[:-1]
            if return_indexer_kl and n_sp:
                aligns.append(out[-1].sum(0))
                out = out[:-1]
            if return_indexer_recall and n_sp:
                recalls.append(out[-1])
                out = out[:-1]
            if return_block_ids and n_sp:
                blocks_used.append(jnp.moveaxis(out[-1], 0, 2))
                out = out[:-1]
            if return_routes and n_moe:
                used.append(jnp.moveaxis(out[-1], 0, 2))
        x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        out = x if hidden else lm_head_logits(x, self.lm_head[...], layout)
        if cache is not None:  # traced positions outside the cache: NaN, not logits computed without their own key
            out = jnp.where(((positions >= 0) & (positions < cache[0]["k"].shape[2]))[..., None], out, jnp.nan)
        result = (out,) if cache is None else (out, new_cache)
        if return_routes:
            k = cfg.num_experts_per_tok
            result += (jnp.concatenate(used, axis=2) if used else jnp.zeros((b, s, 0, k), jnp.int32),)
        if return_block_ids:
            result += (jnp.concatenate(blocks_used, axis=2) if blocks_used else
                       jnp.zeros((b, s, 0, cfg.index_n_heads, cfg.index_topk_blocks), jnp.int32),)
        if return_indexer_recall:
            result += (jnp.concatenate(recalls) if recalls else jnp.zeros((0,), jnp.float32),)
        if return_indexer_kl:
            result += (sum(aligns) / n_sparse,)
        if return_moe_counts:
            result += (jnp.concatenate(moe_counts) if moe_counts else jnp.zeros((0, 2), jnp.int32),)
        return result if len(result) > 1 else result[0]

    def indexer_recall(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                       positions: jax.Array | None = None) -> jax.Array:
        """[n_sparse_layers] fp32: per sparse layer (in sparse-layer order), the share of its full attention's
        probability mass (causal + padding softmax, no indexer mask) that lies in the key blocks its own
        indexer selects, averaged over query heads and real tokens (attention_mask) of the batch
        (`m3jax.model.recall.indexer_recall`). One forward of the model as it runs, plus per sparse layer
        one full-attention pass a tile of queries at a time; no logits."""
        return self(input_ids, positions, attention_mask, hidden=True, return_indexer_recall=True)[-1]

    def moe_assignment_counts(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                              positions: jax.Array | None = None, routes: jax.Array | None = None) -> jax.Array:
        """[n_moe_layers, 2] int32: per MoE layer (in MoE-layer order), the batch's (token, expert) assignments
        of real tokens (attention_mask; every token where dropless) and, first, how many of them an expert ran:
        (kept, real). Under model.moe_capacity_factor, real - kept are the assignments the receive buffers
        dropped (they add nothing to their token's output), as the training forward on this batch drops them.
        routes [B, S, n_moe_layers, k]: of these expert ids (routing replay). One forward; no logits."""
        return self(input_ids, positions, attention_mask, hidden=True, routes=routes, return_moe_counts=True)[-1]

    @property
    def num_moe_layers(self) -> int:
        """MoE layers, the third axis of `routes` / `return_routes`."""
        return sum(len(st.layer_ids) for st in self.stacks if st.mlp_kind == MOE_MLP)

    @property
    def num_sparse_layers(self) -> int:
        """Sparse-attention layers, the third axis of `block_ids` / `return_block_ids`."""
        return sum(len(st.layer_ids) for st in self.stacks if st.attn_kind == SPARSE_ATTENTION)

    def init_cache(self, batch: int, max_len: int) -> list:
        """Empty decode cache: per stack, keys/values (and indexer keys) for max_len slots."""
        return [stack.init_cache(batch, max_len, self.dtype) for stack in self.stacks]
