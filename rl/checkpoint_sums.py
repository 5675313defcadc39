"""Checksums of a checkpoint's arrays, kept in its meta and checked at every restore.

orbax keeps none for the tensor data: a bit flipped in a saved file (bit rot, a bad copy) restored without a word, as
hundreds of wrong values where the flip fell inside a compressed chunk (measured, orbax 0.12.8). Each array's checksum
is taken on its devices, where it lies, one array after the other:

    words w_i:  the array's elements as unsigned integers of their own width (bf16 -> uint16 ...), widened to uint32
    sum     = sum_i w_i                mod 2^32
    weighted = sum_i w_i * (2 i + 1)   mod 2^32      (i: the element's index in row-major order)

Integer sums that wrap are exact in any order, so the value does not depend on the mesh, the sharding or the number
of processes that hold the array (a checkpoint restored onto another layout checks alike), and no byte leaves the
devices but the two words. Any change to one element changes `sum`; the odd weights make `weighted` change when
elements trade places. It is a check against damage, not against an adversary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

KEY = "checksums"  # the meta's entry: {"<item>/<path>": [sum, weighted, dtype]}

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _words(x: jax.Array) -> jax.Array:
    """x's bits as unsigned words of its own width, one per element (two uint32, in a trailing axis, for a 64-bit
    dtype): a bitcast, no copy; the sums widen them to uint32 as they read them."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = jnp.dtype(x.dtype).itemsize
    return lax.bitcast_convert_type(x, jnp.uint32 if size == 8 else _UNSIGNED[size])


def _checksum(x: jax.Array) -> jax.Array:
    """[sum, weighted] of x. The weighted sum is taken through the array's marginals, with i = sum_d k_d stride_d:

        sum_i w_i (2 i + 1) = sum + 2 sum_d stride_d sum_k k M_d[k]     (M_d[k]: the sum of the words at k on axis d)

    exact mod 2^32 (a ring), so no index array as large as x is ever made: the temporaries are the marginals."""
    w = _words(x)
    if w.ndim == 0:
        total = w.astype(jnp.uint32)
        return jnp.stack([total, total])
    total = weighted = None
    stride = 1
    for axis in reversed(range(w.ndim)):
        marginal = jnp.sum(w, axis=tuple(a for a in range(w.ndim) if a != axis), dtype=jnp.uint32)
        if total is None:  # the sum from the first marginal: one pass over x fewer
            total = weighted = jnp.sum(marginal, dtype=jnp.uint32)
        at = lax.iota(jnp.uint32, w.shape[axis])
        weighted = weighted + jnp.uint32(2 * stride % 2**32) * jnp.sum(at * marginal, dtype=jnp.uint32)
        stride *= w.shape[axis]
    return jnp.stack([total, weighted])


@functools.lru_cache(maxsize=None)
def _program(mesh):
    """One array's checksum, replicated over `mesh` (its mesh, or None): in a multi-host job every process then holds
    the words whole, as `np.asarray` needs. A program per array, not one for the tree: XLA:CPU materialises an
    array's words, and in one program every array's were live at once (4 arrays of 256 MiB: 1,040 MiB of
    temporaries); called one after the other, the programs hold one array's at a time."""
    out = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    return jax.jit(_checksum, out_shardings=out)


def checksums(trees: dict) -> dict[str, list[int]]:
    """{"<item>/<path>": [sum, weighted, dtype]} of every array in `trees` ({item name: pytree}); a collective in a
    multi-host job (every process calls it alike and gets the same words)."""
    named = [(f"{item}/{jax.tree_util.keystr(path, simple=True, separator='/')}", leaf) for item, tree in trees.items()
             for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(leaf, "dtype")]
    got = []
    for _, leaf in named:  # dispatched back to back, run one after the other
        sharding = getattr(leaf, "sharding", None)
        if getattr(sharding, "memory_kind", None) not in (None, "device"):  # a KL reference held in host memory
            leaf = jax.device_put(leaf, sharding.with_memory_kind("device"))  # one array at a time on the devices
        got.append(_program(sharding.mesh if isinstance(sharding, NamedSharding) else None)(leaf))
    return {name: [*(int(v) for v in np.asarray(words)), str(leaf.dtype)] for (name, leaf), words in zip(named, got)}


def problem(saved: dict | None, trees: dict) -> str | None:
    """What differs between the checksums a save kept (`saved`, the meta's KEY; None: a checkpoint written before
    they were kept, taken as it is) and the arrays restored (`trees`, as for `checksums`); None when they agree. Not
    checked: an item or array not restored (the optimizer state of a params-only read), and one restored into
    another dtype than it was saved in (Adam's moments under another precision.moment_dtype), whose bytes are not
    the saved ones."""
    if not saved:
        return None
    now = checksums(trees)
    for name in sorted(now):
        if name not in saved:
            return f"its meta keeps no checksum of {name}"
        kept = list(saved[name])
        if now[name][2] == kept[2] and now[name] != kept:
            return (f"{name} does not match the checksum taken when it was saved (read {now[name][:2]}, saved "
                    f"{kept[:2]}): its bytes changed on disk")
    return None
