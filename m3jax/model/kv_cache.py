"""One layer's view of its stack's decode cache, written in place.

A stack of n same-kind layers keeps its decode cache stacked: {"k", "v": [n, B, S_max, KV, D], "index_k":
[n, B, S_max, Di] for sparse layers}, post-norm, post-RoPE keys by slot. A decode step writes only its new
tokens' slots of each layer. The stack carries the stacked cache through its layer loop and each layer scatters
its tokens at [layer, row, position] into it: XLA updates the loop-carried buffer in place. Handed to the layer
as that layer's slice and returned as a new slice, the whole cache was copied out of the stack, written back and
its stacked output zero-filled at every step: 43 % of the tiny model's decode op time on CPU (BENCHMARKS.md,
session 28).
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """Layer `index` (an int, or the layer loop's traced counter) of the stacked cache `stacked`."""

    stacked: dict
    index: jax.Array | int

    def write(self, rows: jax.Array, positions: jax.Array, **new: jax.Array) -> "LayerCache":
        """The cache with new[name] [B, S, ...] at this layer's slots [rows, positions] (rows [B, 1], positions
        [B, S]); names not in `new` stay as they are."""
        return LayerCache({name: a.at[self.index, rows, positions].set(new[name]) if name in new else a
                           for name, a in self.stacked.items()}, self.index)

    def read(self, name: str) -> jax.Array | None:
        """This layer's [B, S_max, ...] slots of `name` (None if the stack keeps no such entry)."""
        a = self.stacked.get(name)
        return None if a is None else a[self.index]
