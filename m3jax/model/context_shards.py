"""A layer's attention run context shard by context shard (`sharding.context.context_parallel_attention`).

Every attention path that walks the queries in tiles or chunks (flash, the sparse layers' gathers, the
query-chunked dense path) runs inside `jax.shard_map` under a context-sharded layout: each device gets its
own queries (and their indexer queries and replayed block ids) and the keys, values, key padding and
indexer keys of every slot, and computes as one device would. The partitioner, left to itself, gathered
every flash query tile onto every context device, and all-reduced dK / dV at every tile or chunk of the
others' backward (BENCHMARKS.md, session 19).

The indexer's heads are cut like the query heads (tensor parallelism), so device t's query heads
[t H/T, (t+1) H/T) meet index heads [t Hi/T, (t+1) Hi/T): with Hi and KV divisible by T, each local query
head maps to the same kv and index head as on one device (head h reads kv head h // (H/KV) and index head
h // (H/Hi); both group sizes divide H/T).
"""

from __future__ import annotations

from typing import Callable

import jax

from sharding.context import Q_AXES, ROW_AXES, context_parallel_attention  # noqa: F401  (ROW_AXES: callers' out_axes)
from sharding.layout import Layout

HEAD_ROWS = ("act_batch", "act_seq", "act_heads", None)  # [B, S, heads, .]: queries, indexer queries, block ids
INDEX_KEYS = ("act_batch", "act_seq", None)  # the indexer's single key head [B, S, Di]


def applies(q: jax.Array, k: jax.Array, index_heads: int | None, layout: Layout) -> bool:
    """Whether a layer runs shard by shard: a context-sharded layout, keys of the queries' own slots (no decode
    cache: the cache's slots are not the queries'), and (sparse layers, index_heads given) index heads that
    split like the query heads over tensor parallelism."""
    return (layout.size("act_seq") > 1 and k.shape[1] == q.shape[1]
            and (index_heads is None or index_heads % layout.size("act_heads") == 0))


def per_context_shard(attend: Callable, layout: Layout, q, k, v, positions, key_valid, iq=None, ik=None,
                      block_ids=None, return_block_ids: bool = False, out_axes=None, balance: bool = False):
    """attend(q, k, v, positions, key_valid, iq, ik, block_ids) -> o (or (o, block ids) with return_block_ids)
    on each context shard's queries over every key slot; iq / ik / block_ids may be None (full layers, no
    replay). Shapes as `m3jax.model.attention.attention`: q [B, S, H, D], k / v [B, S, KV, D], iq [B, S, Hi, Di],
    ik [B, S, Di], block_ids [B, S, Hi, K]. out_axes: the logical axes of attend's output when it is not o
    (e.g. ROW_AXES for a per-query [B, S] value); an input attend does not read is not gathered (the
    unused gather is dead code). balance: attend's work per query grows with its position (a full layer's causal
    flash), so mirror shards share it (`sharding.context`)."""
    local = [(a, HEAD_ROWS) for a in (iq, block_ids) if a is not None]
    gathered = [] if ik is None else [(ik, INDEX_KEYS)]

    def local_attend(q, k, v, positions, key_valid, *rest):
        rest = list(rest)
        iq_l = rest.pop(0) if iq is not None else None
        ids_l = rest.pop(0) if block_ids is not None else None
        ik_l = rest.pop(0) if ik is not None else None
        return attend(q, k, v, positions, key_valid, iq_l, ik_l, ids_l)

    if out_axes is None:
        out_axes = (Q_AXES, HEAD_ROWS) if return_block_ids else Q_AXES
    return context_parallel_attention(local_attend, layout, q, k, v, positions, key_valid, local=local,
                                      gathered=gathered, out_axes=out_axes, balance=balance)
