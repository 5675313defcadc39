"""Linear projections between the residual stream and head-shaped activations.

The weights keep HF's [out..., in] layout. Written as einsums over [B, S, ...] activations, autodiff's weight
gradient contracts the two token axes, and XLA:CPU fused the transpose that feeds its matmul into the
elementwise backward before it (q-norm, RoPE): one [1, 4096, 8, 128] -> [8, 128, 1, 4096] loop fusion took
108 ms, a cache miss per element. With the token axes merged first ([N, in] rows) the same gradient is one
dot_general over N that reads its operands as they lie: 137 -> 86 ms for the q projection, q-norm and
o projection's gradients at S = 4096 (BENCHMARKS.md, issue 11, session 12).

Only on one device (`tokens_merged`): under a mesh the batch and sequence axes are sharded over different
mesh axes (data, context), and merging them changed the partitioner's collectives (the small bench model's
train step at mesh (1, 4, 1, 2): 0.75 -> 2.25 MB of all-reduce); there the einsum stays.
"""

import jax
import jax.numpy as jnp

_LETTERS = "abcdefgh"


def project_out(x: jax.Array, w: jax.Array, tokens_merged: bool) -> jax.Array:
    """y[..., o1, .., ok] = sum_e x[..., e] w[o1, .., ok, e]:  x [..., E], w [*out, E] -> [..., *out]."""
    e = x.shape[-1]
    if not tokens_merged:
        out = _LETTERS[: w.ndim - 1]
        return jnp.einsum(f"...z,{out}z->...{out}", x, w)
    y = jax.lax.dot_general(x.reshape(-1, e), w.reshape(-1, e), (((1,), (1,)), ((), ())))
    return y.reshape(*x.shape[:-1], *w.shape[:-1])


def project_in(x: jax.Array, w: jax.Array, tokens_merged: bool) -> jax.Array:
    """y[..., e] = sum_{i1..ik} x[..., i1, .., ik] w[e, i1, .., ik]:  x [..., *in], w [E, *in] -> [..., E]."""
    inner = w.shape[1:]
    lead = x.shape[: x.ndim - len(inner)]
    if x.shape[len(lead):] != inner:
        raise ValueError(f"project_in: x {x.shape} does not end in the weight's input dims {inner}")
    if not tokens_merged:
        sub = _LETTERS[: len(inner)]
        return jnp.einsum(f"...{sub},z{sub}->...z", x, w)
    y = jax.lax.dot_general(x.reshape(-1, w[0].size), w.reshape(w.shape[0], -1), (((1,), (1,)), ((), ())))
    return y.reshape(*lead, w.shape[0])
