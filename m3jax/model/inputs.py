"""The checks of `M3ForCausalLM.__call__`'s inputs: one ValueError naming the argument and what was expected, where
jax failed deep inside the model (a broadcast, a reshape, a scan over mismatched layers) or, worse, went on: a token
id past the vocabulary made its row NaN, -1 took the last row's embedding, a wrong number of replayed experts per
token ran another model, a negative decode position wrote the cache's last slot (an audit).

Shapes are checked always (they are static under jit too); values only where the array is concrete (an eager call),
as the decode positions past the cache were."""

from __future__ import annotations

import jax
import numpy as np


def _concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def _range(a) -> tuple[int, int]:
    """(min, max) of a concrete array, on the host: `np.min` of a jax array calls its own `.min`, which inside a
    trace (a constant made under jit) gives a tracer."""
    a = np.asarray(a)
    return int(a.min()), int(a.max())


def _integers(name: str, a) -> None:
    if not np.issubdtype(np.dtype(a.dtype), np.integer):
        raise ValueError(f"{name} of dtype {a.dtype}: expected integers")


def check_inputs(cfg, input_ids, positions, attention_mask, cache, routes, block_ids, *, num_moe_layers: int,
                 num_sparse_layers: int) -> tuple[int, int]:
    """(B, S) of `input_ids`, after every check above."""
    if not hasattr(input_ids, "shape") or len(input_ids.shape) != 2 or 0 in input_ids.shape:
        raise ValueError(f"input_ids {getattr(input_ids, 'shape', type(input_ids).__name__)}: expected a [B, S] "
                         "integer array with B, S >= 1")
    _integers("input_ids", input_ids)
    b, s = input_ids.shape
    if _concrete(input_ids):
        low, high = _range(input_ids)
        if low < 0 or high >= cfg.vocab_size:
            raise ValueError(f"input_ids hold token id {low if low < 0 else high}: expected ids in "
                             f"[0, {cfg.vocab_size}) (vocab_size)")
    if positions is not None:
        if tuple(positions.shape) != (b, s):
            raise ValueError(f"positions {tuple(positions.shape)}: expected [B, S] = [{b}, {s}], as input_ids")
        _integers("positions", positions)
    slots = None if cache is None else cache[0]["k"].shape[2]
    if cache is not None:
        rows = cache[0]["k"].shape[1]
        if rows != b:
            raise ValueError(f"a decode cache of {rows} rows (init_cache's batch) for input_ids of {b} rows")
        # a write past the cache is dropped (jax's scatter): the token could not see itself; a negative one wraps
        # onto the last slot, where a later token's key goes
        if s > slots:
            raise ValueError(f"decode positions up to {s - 1} with a cache of {slots} slots (init_cache's max_len): "
                             f"expected positions below {slots}")
        if positions is not None and _concrete(positions):
            low, high = _range(positions)
            if high >= slots:
                raise ValueError(f"decode positions up to {high} with a cache of {slots} slots (init_cache's "
                                 f"max_len): expected positions below {slots}")
            if low < 0:
                raise ValueError(f"decode position {low}: expected positions in [0, {slots}) (a negative one wraps "
                                 "onto the cache's last slot)")
    if attention_mask is not None:
        keys, named = (s, "S") if cache is None else (slots, "max_len")
        if tuple(attention_mask.shape) != (b, keys):
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)}: expected [B, {named}] = [{b}, {keys}] "
                             "(1 = a real token)")
    if routes is not None:
        want = (b, s, num_moe_layers, cfg.num_experts_per_tok)
        if tuple(routes.shape) != want:
            raise ValueError(f"routes {tuple(routes.shape)}: expected [B, S, MoE layers, num_experts_per_tok] = "
                             f"[{', '.join(map(str, want))}]")
        _integers("routes", routes)
        low, high = _range(routes) if _concrete(routes) else (0, 0)
        if low < 0 or high >= cfg.num_local_experts:
            raise ValueError(f"routes hold expert ids {low}..{high}: expected ids in [0, {cfg.num_local_experts}) "
                             "(num_local_experts)")
    if block_ids is not None:
        want = (b, s, num_sparse_layers, cfg.index_n_heads)
        if block_ids.ndim != 5 or block_ids.shape[:4] != want or not block_ids.shape[4]:
            raise ValueError(f"block_ids {block_ids.shape}: expected [B, S, n_sparse_layers, Hi, K] = "
                             f"[{b}, {s}, {num_sparse_layers}, {cfg.index_n_heads}, K >= 1]")
    return b, s
