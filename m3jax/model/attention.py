"""M3 attention: per-head QK norm, partial RoPE, GQA; optional block-sparse mask from the indexer.

With `query_chunk` > 0 the scores are formed for `query_chunk` local queries at a time (a scan with a
rematerialised body), so one chunk's [chunk, S_k] scores, masks and indexer scores live instead of the
whole [S_local, S_k] block; the maths per query is unchanged.

With impl="flash" (`m3jax.model.flash`) no scores block is held at all: an online softmax walks key tiles,
and query_chunk is unused. impl="cudnn" runs full layers on cuDNN's fused flash attention where it applies
(`m3jax.model.fused_attention`), else what "auto" would run without it. impl="auto" (the default) is cudnn
on a GPU, elsewhere flash from FLASH_MIN_KEYS keys on and dense below, and dense for a decode step's few
queries (`resolve_impl`).

Sparse layers read only the key blocks the indexer kept (sparse_impl="gather", `m3jax.model.sparse`),
whatever impl the full layers use; sparse_impl="masked" runs them as masks on impl's full attention
(the reference the gathered path is tested against).

Indexer selection replay (`grpo.indexer_replay`): a sparse layer given block_ids [B, S, Hi, K] attends over
those key blocks instead of the indexer's (every impl: the gathered path reads them, the masked paths
turn them into the block mask); return_block_ids gives the indexer's own ids, padded with -1 to
K = index_topk_blocks (without replay: the blocks used).
"""

import functools

import jax
import jax.numpy as jnp

from m3jax.model import context_shards
from m3jax.model.flash import flash_attention
from m3jax.model.fused_attention import applies as fused_applies, fused_attention, implementation as fused_impl
from m3jax.model.indexer import block_ids_to_mask, block_mask_to_tokens, select_key_blocks, topk_key_blocks
from m3jax.model.indexer_align import indexer_alignment_kl
from m3jax.model.kv_cache import LayerCache
from m3jax.model.norms import rms_norm
from m3jax.model.paged_sparse import applies as paged_applies, paged_sparse_attention
from m3jax.model.projections import project_in, project_out
from m3jax.model.recall import indexer_recall
from m3jax.model.rope import apply_rope
from m3jax.model.softmax import softmax
from m3jax.model.sparse import head_units, one_device_path, select_blocks, sparse_layer_attention
from m3jax.model.tiles import _from_chunks, _to_chunks, causal_keep  # noqa: F401  (their home before tiles.py)
from sharding.layout import Layout

_MASKED = jnp.finfo(jnp.float32).min
IMPLS = ("auto", "dense", "flash", "cudnn")
# "auto" runs flash from this many keys on. Flash runs faster at every length measured on CPU (one M3-width
# layer, scripts/bench_attention.py: 1.5x at 256 keys, 2.0x at 512, 2.7x at 1024, forward), but it compiles
# slower (the tiny model's fwd+bwd: 24.7 s against 16.4 s at S = 64); below 512 keys a layer takes a few ms
# either way, so short runs (tests, the CPU demo) keep the faster compile. The rule is on the scores block
# [queries, keys] flash avoids: a decode step's one query a row holds no block worth tiling, and flash's key-tile
# walk made the sparse bench model's two full layers decode 1.55x slower than dense at 4,096 slots
# (BENCHMARKS.md, session 29).
FLASH_MIN_KEYS = 512
SPARSE_IMPLS = ("gather", "masked", "paged")
FLASH_TILE = 128  # queries and keys per flash tile on full layers (sparse layers: keys per indexer block)


def resolve_impl(impl: str, key_len: int, backend: str | None = None, query_len: int | None = None) -> str:
    """The attention impl that runs for `impl` over key_len keys (cache slots when decoding) on `backend`
    (default: jax's), for query_len queries (default key_len, a whole sequence): "auto" is "cudnn" on a GPU,
    elsewhere `unfused_impl`; the others are themselves. A full layer where cuDNN does not apply runs
    `unfused_impl`."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r}: expected one of {IMPLS}")
    if impl != "auto":
        return impl
    return "cudnn" if fused_impl(backend) is not None else unfused_impl(key_len, query_len)


def unfused_impl(key_len: int, query_len: int | None = None) -> str:
    """What "auto" runs off a GPU, and "cudnn" where cuDNN does not apply: flash where the dense scores block
    [query_len (default key_len), key_len] holds FLASH_MIN_KEYS^2 elements or more (a whole sequence: from
    FLASH_MIN_KEYS keys), else dense."""
    queries = key_len if query_len is None else query_len
    return "flash" if queries * key_len >= FLASH_MIN_KEYS ** 2 else "dense"


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, scale: float) -> jax.Array:
    """softmax(q k^T * scale, masked) v with query head h reading kv head h // (H / KV).

    q [B, S, H, D], k/v [B, S_k, KV, D], keep [B, 1 or H, S, S_k] -> [B, S, H, D].
    Logits and softmax in fp32; probabilities cast to the value dtype before the value product.
    """
    b, s, h, d = q.shape
    kv, sk = k.shape[2], k.shape[1]
    g = h // kv
    # Leading batch dims (b, kv) and the query rows (s, g) merged, s major (a context-sharded s stays one
    # contiguous range): XLA:CPU ran the einsum form with free dims (g, s) 1.4-2x slower, forward+backward.
    qg = q.reshape(b, s, kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, s * g, d)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KV, S_k, D]
    logits = jax.lax.dot_general(qg, kt, (((3,), (3,)), ((0, 1), (0, 1))),
                                 preferred_element_type=jnp.float32).reshape(b, kv, s, g, sk) * scale
    keep = keep.reshape(b, 1, s, 1, sk) if keep.shape[1] == 1 else \
        keep.reshape(b, kv, g, s, sk).transpose(0, 1, 3, 2, 4)
    logits = jnp.where(keep, logits, _MASKED)
    probs = softmax(logits).astype(v.dtype).reshape(b, kv, s * g, sk)
    out = jax.lax.dot_general(probs, vt, (((3,), (2,)), ((0, 1), (0, 1))))  # [B, KV, S G, D]
    return out.reshape(b, kv, s, g, d).transpose(0, 2, 1, 3, 4).reshape(b, s, h, d)


def valid_replay(ids: jax.Array, n_blocks: int) -> jax.Array:
    """Replayed block ids [..., K] as the set of blocks they name: an id outside [0, n_blocks) or equal to an earlier
    one of its row becomes -1 (none). The masked path reads a selection as a set; the gather paths gathered a
    repeated block twice (its keys weighted double in the softmax) and clipped an id past the keys to the last
    block, so one replay gave two results. Ids an indexer chose (`topk_key_blocks`) pass unchanged."""
    ids = jnp.where((ids < 0) | (ids >= n_blocks), -1, ids)
    for j in range(1, ids.shape[-1]):  # K is small (the release: 32); no [.., K, K] array is formed
        again = (ids[..., :j] == ids[..., j:j + 1]).any(-1) & (ids[..., j] >= 0)
        ids = ids.at[..., j].set(jnp.where(again, -1, ids[..., j]))
    return ids


def attention_block(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
                    key_valid: jax.Array | None, cfg, sparse: bool, cache: LayerCache | None = None,
                    query_chunk: int = 0, layout: Layout = Layout(), impl: str = "auto",
                    sparse_impl: str = "gather", block_ids: jax.Array | None = None, return_block_ids: bool = False,
                    return_recall: bool = False, return_indexer_kl: bool = False):
    """One layer's attention on normalised hidden x [B, S, d] -> [B, S, d] (and the updated cache).

    p holds this layer's q/k/v/o projections ([heads, D, d] / [d, H, D]), q/k norms, and for sparse
    layers the indexer's index_q_proj [Hi, Di, d], index_k_proj [Di, d] and their norms.
    cache (decoding): this layer's `m3jax.model.kv_cache.LayerCache` ({"k", "v": [B, S_max, KV, D],
    "index_k": [B, S_max, Di] for sparse layers} in its stack's cache), the post-norm, post-RoPE keys by slot;
    returned updated. The new tokens' keys are written at slots = positions, and
    attention reads every slot (slots not yet written lie beyond each query's position, so causality
    hides them); key_valid then spans S_max.
    query_chunk: queries per scores block on each device (0 = all local queries at once).
    layout: where activations live (the context shards of the sequence decide the chunking).
    impl: "dense" (masked [chunk, S_k] scores), "flash" (`flash_attention`, no scores block), "cudnn" (full
    layers on cuDNN where it applies, `m3jax.model.fused_attention`) or "auto" (`resolve_impl`).
    sparse_impl: sparse layers "gather" (only the kept blocks, `sparse_layer_attention`), "paged" (gather, its
    forward-only passes on a GPU through jax's Pallas paged-attention kernel, `m3jax.model.paged_sparse`)
    or "masked".
    block_ids [B, S, Hi, K] (sparse layers; indexer selection replay): attend over these key blocks (-1 =
    none) instead of the indexer's. return_block_ids (sparse layers): also return, last, the indexer's own
    top-K block ids [B, S, Hi, index_topk_blocks] int32 (-1 = none; padded with -1 when the keys hold
    fewer blocks): the blocks used without replay; with replay, those the indexer would have chosen
    (one extra indexer pass, no attention).
    return_recall (sparse layers, no cache): also return, last, the layer's indexer recall (a scalar, fp32;
    `m3jax.model.recall.indexer_recall`): the share of the full attention's probability mass (computed
    without the indexer's mask) in the blocks the indexer selects, over the real queries (key_valid).
    return_indexer_kl (sparse layers, no cache): also return, last, the indexer alignment KL of every query,
    [B, S] fp32 (`m3jax.model.indexer_align`); its gradient reaches only the indexer's parameters.
    """
    eps = cfg.rms_norm_eps
    merged = layout.num_devices == 1  # one device: projections on merged token rows (m3jax.model.projections)
    q = rms_norm(project_out(x, p["q_proj"], merged), p["q_norm"], eps)
    k = rms_norm(project_out(x, p["k_proj"], merged), p["k_norm"], eps)
    v = project_out(x, p["v_proj"], merged)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    iq = ik = None
    if sparse:  # detached: the selection is discrete, and the alignment KL must not train the residual stream
        iq, ik = indexer_qk(p, jax.lax.stop_gradient(x), cos, sin, eps, merged)
    if cache is not None:
        rows = jnp.arange(x.shape[0])[:, None]
        cache = cache.write(rows, positions, k=k, v=v, **({"index_k": ik} if sparse else {}))
        k, v, ik = cache.read("k"), cache.read("v"), cache.read("index_k")
    n_ctx = layout.size("act_seq")
    backend = layout.backend  # the platform the program is built for decides the "auto" choices
    replay, used = (block_ids if sparse else None), None
    # A sparse layer attends as a full one when its keys hold no more blocks than the indexer keeps: every block a
    # query can see is then selected (`sees_every_block`), so the full layer's kernels (cuDNN on a GPU) run it and
    # the indexer runs only where its block ids are asked for. A replayed selection is data: it keeps the sparse path.
    selects = sparse and not (replay is None and sees_every_block(k.shape[1], cfg))
    sel_iq, sel_ik = (iq, ik) if selects else (None, None)
    impl = resolve_impl(impl, k.shape[1], backend, q.shape[1])
    if impl == "cudnn" and (selects or not fused_applies(q, k.shape[1], cache is not None, n_ctx, backend)):
        impl = unfused_impl(k.shape[1], q.shape[1])
    want_ids = sparse and (return_block_ids or return_recall)
    own = want_ids and replay is None and selects  # the ids the attention selects are the answer
    if replay is not None:
        b, s = x.shape[:2]
        want = (b, s, cfg.index_n_heads)
        if replay.ndim != 4 or replay.shape[:3] != want:
            raise ValueError(f"block_ids {replay.shape}: expected [B, S, Hi, K] = [{b}, {s}, {cfg.index_n_heads}, K]")
        replay = valid_replay(replay.astype(jnp.int32), -(-k.shape[1] // cfg.index_block_size))
    if selects and sparse_impl in ("gather", "paged") and context_shards.applies(q, k, cfg.index_n_heads, layout):
        attend = functools.partial(one_device_sparse_attention, cfg, own, backend)
        o = context_shards.per_context_shard(attend, layout, q, k, v, positions, key_valid, iq, ik, replay,
                                             return_block_ids=own)
        if own:
            o, used = o
    elif selects and sparse_impl in ("gather", "paged"):
        k, v, ik = gather_keys(k, v, ik, layout)
        # One device: the grouped or the slot path, chosen by the config's shape and the step's queries per
        # key slot (`one_device_path`): over a whole sequence never by S; a decode step, where a block brings
        # a fraction of a row, runs the slots. They agree to float rounding; neither is bitwise batch
        # invariant on XLA:CPU (a query alone and among S others differ by 1-2 ulp: the softmax's exp and sums
        # vectorise by shape), as the per-tile gathers are not either.
        path = _one_device_path(cfg, q, k, cfg.index_n_heads, backend) if layout.num_devices == 1 else "tiles"
        if sparse_impl == "paged" and paged_applies(q, n_ctx, backend):
            o, ids = _paged(q, k, v, positions, key_valid, iq, ik, replay, cfg, n_ctx, layout, path)
            o = (o, ids) if own else o
        else:
            o = sparse_layer_attention(q, k, v, positions, key_valid, iq, ik, cfg, to_chunks=_to_chunks,
                                       from_chunks=_from_chunks, n_ctx=n_ctx, constrain=layout.constrain,
                                       path=path, block_ids=replay, return_block_ids=own)
        if own:
            o, used = o
    elif impl == "cudnn":  # a full layer, or a sparse one that sees every block (others took another impl above)
        def unfused(q, k, v):
            return _unfused(q, k, v, positions, key_valid, cfg, query_chunk, layout)

        o = fused_attention(q, k, v, positions, key_valid, cfg.head_dim ** -0.5, fallback=unfused, backend=backend)
    elif impl == "flash":
        o = flash_layer_attention(q, k, v, positions, key_valid, sel_iq, sel_ik, cfg, block_ids=replay,
                                  return_block_ids=own, layout=layout)
    elif query_chunk and x.shape[1] // n_ctx > query_chunk:
        o = chunked_attention(q, k, v, positions, key_valid, sel_iq, sel_ik, cfg, query_chunk, layout,
                              block_ids=replay, return_block_ids=own)
    else:
        o = masked_attention(q, k, v, positions, key_valid, sel_iq, sel_ik, cfg, block_ids=replay,
                             return_block_ids=own)
    if own and sparse_impl not in ("gather", "paged"):
        o, used = o
    out = project_in(o, p["o_proj"], merged)
    result = (out,) if cache is None else (out, cache)
    if want_ids and used is None:  # replayed: the indexer's own choice, for the selection-mismatch metric
        _, _, ik = gather_keys(k, v, ik, layout)
        used = select_blocks(iq, ik, positions, cfg, to_chunks=_to_chunks, from_chunks=_from_chunks, n_ctx=n_ctx)
    if return_block_ids and sparse:
        result += (pad_block_ids(used, cfg.index_topk_blocks),)
    if return_recall and sparse:
        if cache is not None:
            raise ValueError("return_recall needs the whole sequence (no decode cache)")
        keys = gather_keys(k, v, None, layout)[0]
        result += (indexer_recall(q, keys, positions, key_valid, used, cfg, query_mask=key_valid, n_ctx=n_ctx,
                                  constrain=layout.constrain),)
    if return_indexer_kl and sparse:
        if cache is not None:
            raise ValueError("return_indexer_kl needs the whole sequence (no decode cache)")
        # Per shard (else its backward all-reduced d(ik) per tile) when the heads are whole: each shard's KL is a
        # mean over its own index heads, which a tensor-parallel shard holds only some of.
        if context_shards.applies(q, k, cfg.index_n_heads, layout) and layout.size("act_heads") == 1:
            def align(q, k, v, positions, key_valid, iq, ik, block_ids):
                return indexer_alignment_kl(q, k, iq, ik, positions, key_valid, cfg)

            kl = context_shards.per_context_shard(align, layout, q, k, v, positions, key_valid, iq, ik,
                                                  out_axes=context_shards.ROW_AXES)
        else:
            keys, _, index_keys = gather_keys(k, v, ik, layout)
            kl = indexer_alignment_kl(q, keys, iq, index_keys, positions, key_valid, cfg, n_ctx=n_ctx,
                                      constrain=layout.constrain)
        result += (kl,)
    return result if len(result) > 1 else result[0]


def sees_every_block(key_len: int, cfg) -> bool:
    """Whether the indexer keeps every key block a query can see over key_len keys (cache slots when decoding):
    HF selects the top min(K, nb) of the nb = ceil(key_len / bs) blocks and drops those with a -inf score (the
    fully-future ones), so with nb <= K = index_topk_blocks each query keeps every block at or before its own
    and the sparse layer is exactly causal attention with the padding mask."""
    return -(-key_len // cfg.index_block_size) <= cfg.index_topk_blocks


def one_device_sparse_attention(cfg, own: bool, backend: str, q, k, v, positions, key_valid, iq, ik, block_ids):
    """A sparse layer's gathered attention as one device runs it (the path `one_device_path` picks for the
    shape on `backend`): each context shard's (`m3jax.model.context_shards`). Local heads: with tensor
    parallelism the units split with the heads."""
    return sparse_layer_attention(q, k, v, positions, key_valid, iq, ik, cfg, to_chunks=_to_chunks,
                                  from_chunks=_from_chunks, path=_one_device_path(cfg, q, k, iq.shape[2], backend),
                                  block_ids=block_ids, return_block_ids=own)


def _one_device_path(cfg, q, k, index_heads: int, backend: str) -> str:
    """`one_device_path` for queries q [B, S, H, D] over keys k [B, S_k, KV, D] and `index_heads` index heads
    (the heads as this program holds them: local ones inside a shard_map)."""
    units = len(head_units(q.shape[2], k.shape[2], index_heads)[0])
    return one_device_path(cfg.index_topk_blocks, cfg.index_block_size, q.shape[2] // units, backend,
                           q.shape[1] / k.shape[1])


def _paged(q, k, v, positions, key_valid, iq, ik, replay, cfg, n_ctx: int, layout: Layout, path: str):
    """A sparse layer under sparse_impl "paged" (`m3jax.model.paged_sparse`): (o, the block ids used)."""
    ids = replay if replay is not None else select_blocks(iq, ik, positions, cfg, to_chunks=_to_chunks,
                                                          from_chunks=_from_chunks, n_ctx=n_ctx)

    def replayed(q, k, v, ids, positions, key_valid):  # captures no traced value: it is a custom VJP's rule
        return sparse_layer_attention(q, k, v, positions, key_valid, None, None, cfg, to_chunks=_to_chunks,
                                      from_chunks=_from_chunks, n_ctx=n_ctx, constrain=layout.constrain, path=path,
                                      block_ids=ids)

    kv_of, idx_of = head_units(q.shape[2], k.shape[2], cfg.index_n_heads)
    return paged_sparse_attention(q, k, v, positions, key_valid, ids, cfg, kv_of, idx_of, gather=replayed,
                                  backend=layout.backend), ids


def _unfused(q, k, v, positions, key_valid, cfg, query_chunk: int, layout: Layout):
    """A full layer's attention as "auto" runs it without cuDNN (the fused path's fallback)."""
    if unfused_impl(k.shape[1], q.shape[1]) == "flash":
        return flash_layer_attention(q, k, v, positions, key_valid, None, None, cfg, layout=layout)
    if query_chunk and q.shape[1] // layout.size("act_seq") > query_chunk:
        return chunked_attention(q, k, v, positions, key_valid, None, None, cfg, query_chunk, layout)
    return masked_attention(q, k, v, positions, key_valid, None, None, cfg)


def pad_block_ids(ids: jax.Array, k: int) -> jax.Array:
    """[..., K'] block ids -> [..., k] int32, padded with -1 (none) when the keys held fewer than k blocks."""
    return jnp.pad(ids.astype(jnp.int32), [(0, 0)] * (ids.ndim - 1) + [(0, k - ids.shape[-1])], constant_values=-1)


def _sparse_blocks(iq, ik, positions, cfg, block_ids, return_block_ids: bool):
    """(keep-mask over key blocks [B, Hi, S, nb], the ids it came from [B, S, Hi, K] or None): the replayed
    block_ids [B, S, Hi, K], else the indexer's top-K (ids only when asked: otherwise `select_key_blocks`,
    today's program)."""
    nb = -(-ik.shape[1] // cfg.index_block_size)
    if block_ids is not None:
        return block_ids_to_mask(jnp.moveaxis(block_ids, 2, 1), nb), None
    kw = dict(block_size=cfg.index_block_size, topk_blocks=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks)
    if not return_block_ids:
        return select_key_blocks(iq, ik, positions, **kw), None
    ids = topk_key_blocks(iq, ik, positions, **kw)  # select_key_blocks, keeping the ids
    return block_ids_to_mask(ids, nb), jnp.moveaxis(ids, 1, 2)


def masked_attention(q, k, v, positions, key_valid, iq, ik, cfg, block_ids=None, return_block_ids=False):
    """Attention of queries q [B, S, H, D] at `positions` over every key slot of k/v [B, S_k, KV, D]:
    causal and padding mask, AND the indexer's block selection when iq/ik are given (sparse layers), or the
    replayed block_ids [B, S, Hi, K]. return_block_ids (no replay): (o, the ids used [B, S, Hi, K])."""
    keep = causal_keep(positions, key_valid, k.shape[1])
    ids = None
    if iq is not None:
        blocks, ids = _sparse_blocks(iq, ik, positions, cfg, block_ids, return_block_ids)
        keep = keep & block_mask_to_tokens(blocks, cfg.index_block_size, k.shape[1], q.shape[2])  # local heads
    o = gqa_attention(q, k, v, keep, cfg.head_dim ** -0.5)
    return (o, ids) if return_block_ids else o


def flash_layer_attention(q, k, v, positions, key_valid, iq, ik, cfg, block_ids=None, return_block_ids=False,
                          layout: Layout = Layout()):
    """`masked_attention` with `flash_attention`: the same keep-mask, never materialised. Sparse layers
    walk key tiles of one indexer block and skip blocks no query of a tile selected.
    layout: a context-sharded one runs the layer shard by shard (`m3jax.model.context_shards`)."""
    if context_shards.applies(q, k, None if iq is None else cfg.index_n_heads, layout):
        def attend(q, k, v, positions, key_valid, iq, ik, block_ids):
            return flash_layer_attention(q, k, v, positions, key_valid, iq, ik, cfg, block_ids, return_block_ids)

        return context_shards.per_context_shard(attend, layout, q, k, v, positions, key_valid, iq, ik, block_ids,
                                                return_block_ids, balance=iq is None)
    blocks, tile, ids = None, FLASH_TILE, None
    if iq is not None:
        blocks, ids = _sparse_blocks(iq, ik, positions, cfg, block_ids, return_block_ids)
        tile = cfg.index_block_size
    o = flash_attention(q, k, v, scale=cfg.head_dim ** -0.5, positions=positions, key_valid=key_valid,
                        block_mask=blocks, block_size=cfg.index_block_size, q_tile=max(tile, 64), k_tile=tile)
    return (o, ids) if return_block_ids else o


def chunked_attention(q, k, v, positions, key_valid, iq, ik, cfg, chunk: int, layout: Layout, block_ids=None,
                      return_block_ids: bool = False):
    """`masked_attention` over blocks of `chunk` local queries (a scan; each block is rematerialised in
    the backward pass, so only one block's scores are ever live). A context-sharded layout runs it shard by
    shard (`m3jax.model.context_shards`: every key slot gathered once, before the scan). K and V enter the
    scan in fp32 and are cast back per block: the cotangents of scan constants accumulate in their dtype,
    so dK and dV sum over blocks in fp32.
    Padded query rows (S_l not a multiple of chunk) sit at position 0 and are dropped from the output.
    block_ids [B, S, Hi, K]: replayed selection, chunked like the queries; return_block_ids: (o, ids used)."""
    if context_shards.applies(q, k, None if iq is None else cfg.index_n_heads, layout):
        def attend(q, k, v, positions, key_valid, iq, ik, block_ids):
            return chunked_attention(q, k, v, positions, key_valid, iq, ik, cfg, chunk, Layout(), block_ids,
                                     return_block_ids)

        return context_shards.per_context_shard(attend, layout, q, k, v, positions, key_valid, iq, ik, block_ids,
                                                return_block_ids)
    s, n_ctx, constrain = q.shape[1], layout.size("act_seq"), layout.constrain
    k, v, ik = gather_keys(k, v, ik, layout)
    dtype = k.dtype
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    xs = (_to_chunks(q, n_ctx, chunk), _to_chunks(positions, n_ctx, chunk),
          None if iq is None else _to_chunks(iq, n_ctx, chunk))
    if block_ids is not None:
        xs += (_to_chunks(block_ids, n_ctx, chunk),)

    def block(_, xs):
        qc, pc, iqc = xs[:3]
        qc = constrain(qc, ("act_batch", "act_seq", "act_heads", None))
        o = masked_attention(qc, k32.astype(dtype), v32.astype(dtype), pc, key_valid, iqc, ik, cfg,
                             block_ids=xs[3] if len(xs) > 3 else None, return_block_ids=return_block_ids)
        o, ids = o if return_block_ids else (o, None)
        o = constrain(o, ("act_batch", "act_seq", "act_heads", None))
        return None, ((o, ids) if return_block_ids else o)

    _, o = jax.lax.scan(jax.checkpoint(block, prevent_cse=False), None, xs)
    if return_block_ids:
        return _from_chunks(o[0], n_ctx, s), _from_chunks(o[1], n_ctx, s)
    return _from_chunks(o, n_ctx, s)


def gather_keys(k, v, ik, layout: Layout):
    """Keys, values (and indexer keys) of every slot on each device: gathered over the context axis."""
    constrain = layout.constrain
    local, gathered = ("act_batch", "act_seq", "act_kv_heads", None), ("act_batch", None, "act_kv_heads", None)
    # Projected on each context shard, then gathered: constraining only the gathered layout lets the
    # partitioner gather the (12x wider) hidden state instead and project the whole sequence everywhere.
    k, v = (constrain(constrain(t, local), gathered) for t in (k, v))
    if ik is not None:
        ik = constrain(constrain(ik, local[:2] + (None,)), ("act_batch", None, None))
    return k, v, ik


def indexer_qk(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, eps: float,
               tokens_merged: bool = False):
    """Normalised, rotated indexer queries [B, S, Hi, Di] and its single key head [B, S, Di].

    tokens_merged: project on merged token rows (one device; `m3jax.model.projections`).

    HF rotates the indexer with cos[..., :index_head_dim] of the attention's RoPE table.
    """
    di = p["index_k_proj"].shape[0]
    iq = rms_norm(project_out(x, p["index_q_proj"], tokens_merged), p["index_q_norm"], eps)
    ik = rms_norm(project_out(x, p["index_k_proj"][None], tokens_merged), p["index_k_norm"], eps)
    iq = apply_rope(iq, cos[..., :di], sin[..., :di])
    ik = apply_rope(ik, cos[..., :di], sin[..., :di])
    return iq, ik[:, :, 0, :]
