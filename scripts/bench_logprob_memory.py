"""Compiled temporaries of token logprobs from the final hidden states: today's full [T, vocab] logits vs
`rl.logprobs.chunked_token_logprobs` (blocks of `--chunk` positions, rematerialised).

    .venv/bin/python scripts/bench_logprob_memory.py                  # M3 head, one 8192-token row, bf16
    .venv/bin/python scripts/bench_logprob_memory.py --dtype float32
    .venv/bin/python scripts/bench_logprob_memory.py --vocab 32768 --hidden 64 --tokens 2048 --chunk 256 \
        --dtype float32                                               # tests/test_chunked_logprobs.py's shape

Each program is compiled from ShapeDtypeStructs on XLA:CPU (nothing is allocated, so M3's 200,064 x
6144 head compiles on a laptop) and `memory_analysis().temp_size_in_bytes` is read: "logprobs" is the
logprob pass's head (forward only), "grad" the loss's (d/d hidden and d/d lm_head of a weighted sum of
the logprobs, as the GRPO loss back-propagates). One device: divide by the tensor-parallel size for a
vocabulary cut over `tensor`, and by the context-parallel size for the positions.

The chunked backward keeps one [vocab, hidden] fp32 gradient sum (placed as the head is, so cut by FSDP
on a mesh); it does not grow with T. With a bf16 head XLA:CPU also materialises fp32 [vocab, hidden]
upcasts of the head in the backward loop (CPU has no bf16 matmul; GPUs and TPUs multiply bf16 natively),
so the bf16 "grad" rows overstate what a GPU holds.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from m3jax.model.decoder import lm_head_logits
from rl.generation.base import token_logprobs
from rl.logprobs import chunked_token_logprobs

# (temperature, top_p, top_k): the recipes' plain sampling, and a nucleus + top-k one (sorts [T, V])
SAMPLINGS = {"T=1": (1.0, 1.0, 0), "T=0.7 top_p=0.95 top_k=50": (0.7, 0.95, 50)}


def temp_mib(chunk: int, tokens: int, vocab: int, hidden: int, dtype, sampling, grad: bool) -> float:
    h = jax.ShapeDtypeStruct((1, tokens, hidden), dtype)
    w = jax.ShapeDtypeStruct((vocab, hidden), dtype)
    y = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    if chunk:
        def lp(h, w, y):
            return chunked_token_logprobs(h, w, y, *sampling, chunk_tokens=chunk)
    else:
        def lp(h, w, y):
            return token_logprobs(lm_head_logits(h, w), y, *sampling)
    fn = lp
    if grad:
        # a weighted sum (weights = the targets, any array) so no gradient is structurally zero
        fn = jax.grad(lambda h, w, y: jnp.sum(jnp.where(y > 0, lp(h, w, y) * y, 0.0)), argnums=(0, 1))
    return jax.jit(fn).lower(h, w, y).compile().memory_analysis().temp_size_in_bytes / 2 ** 20


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=200064)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--tokens", type=int, default=8192, help="one row (the 32-node recipe's sequence)")
    ap.add_argument("--chunk", type=int, default=1024, help="model.logprob_chunk_tokens")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a = ap.parse_args()
    dtype = jnp.dtype(a.dtype)
    tv = a.tokens * a.vocab * 4 / 2 ** 20
    print(f"T={a.tokens} vocab={a.vocab} hidden={a.hidden} {a.dtype}, chunk {a.chunk}; one [T, vocab] fp32 array "
          f"= {tv:,.0f} MiB; compiled temp_size_in_bytes (XLA:CPU, jax {jax.__version__}):")
    print(f"{'sampling':<28} {'program':<9} {'full MiB':>10} {'chunked MiB':>12} {'ratio':>6}")
    for name, s in SAMPLINGS.items():
        for grad in (False, True):
            full = temp_mib(0, a.tokens, a.vocab, a.hidden, dtype, s, grad)
            chunked = temp_mib(a.chunk, a.tokens, a.vocab, a.hidden, dtype, s, grad)
            print(f"{name:<28} {'grad' if grad else 'logprobs':<9} {full:>10,.0f} {chunked:>12,.0f} "
                  f"{full / chunked:>6.1f}")


if __name__ == "__main__":
    main()
