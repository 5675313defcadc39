"""python -m m3jax.demo [--out runs/demo]: the model end to end on a laptop, in about a minute.

Builds a tiny random MiniMax-M3 (dense + MoE layers, full + lightning-indexer sparse attention),
exports it in the released layout, converts that to the native layout, reloads it, checks the
logits survived bit for bit (and match transformers' reference model when it is installed), and
prints greedy continuations.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import m3jax
from m3jax.cli_args import description, path_argument

TINY = m3jax.M3Config(
    vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=64, dense_intermediate_size=256, shared_intermediate_size=64,
    num_local_experts=8, num_experts_per_tok=2, partial_rotary_factor=0.5,
    layer_types=("full_attention",) + ("minimax_m3_sparse",) * 3, mlp_layer_types=("dense",) + ("sparse",) * 3,
    index_n_heads=2, index_head_dim=32, index_block_size=8, index_topk_blocks=2, bos_token_id=1, eos_token_id=2)


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding by full forwards over a fixed right-padded buffer (one compile)."""
    width = max(map(len, prompts)) + new_tokens
    ids = np.zeros((len(prompts), width), np.int32)
    lengths = np.array([len(p) for p in prompts])
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = p
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, ids, lengths):
        mask = jnp.arange(ids.shape[1])[None] < lengths[:, None]
        logits = nnx.merge(graphdef, state)(ids, attention_mask=mask)
        return jnp.argmax(logits[jnp.arange(ids.shape[0]), lengths - 1], axis=-1)

    for _ in range(new_tokens):
        tok = np.asarray(next_token(state, ids, lengths))
        ids[np.arange(len(prompts)), lengths] = tok
        lengths = lengths + 1
    return [ids[row, len(p):lengths[row]].tolist() for row, p in enumerate(prompts)]


def _parents(path: str):
    """`path` and each directory above it."""
    while True:
        yield path
        if os.path.dirname(path) == path:
            return
        path = os.path.dirname(path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m m3jax.demo", description=description(__doc__))
    ap.add_argument("--out", type=path_argument, default="runs/demo", help="directory the exported checkpoints go to")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random model")
    args = ap.parse_args(argv)
    if not 0 <= args.seed < 2 ** 32:  # numpy refuses a negative seed, once two checkpoints are written
        ap.error(f"--seed {args.seed}: expected an integer from 0 to 2**32 - 1")
    blocked = next((p for p in _parents(os.path.abspath(args.out)) if os.path.exists(p) and not os.path.isdir(p)),
                   None)
    if blocked:
        ap.error(f"--out {args.out}: {blocked} is a file; expected a directory (made if missing)")
    from m3jax.hf.save import check_destination
    for kind in ("released", "native"):  # both, before either is written (native's refusal left released written)
        try:
            check_destination(os.path.join(args.out, kind))
        except FileExistsError as e:
            ap.error(f"--out {args.out}: {e}")
    t0 = time.perf_counter()
    model = m3jax.M3ForCausalLM(TINY, rngs=nnx.Rngs(args.seed))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    released = m3jax.save_pretrained(model, os.path.join(args.out, "released"), layout="released")
    native = m3jax.save_pretrained(m3jax.from_pretrained(released), os.path.join(args.out, "native"))
    reloaded = m3jax.from_pretrained(native)
    print(f"tiny M3: {n:,} parameters, {len(TINY.segments())} scanned stacks; exported released -> "
          f"converted native: {native}")

    ids = jnp.asarray(np.random.default_rng(args.seed).integers(3, TINY.vocab_size, (2, 40)), jnp.int32)
    ours = np.asarray(reloaded(ids))
    assert np.array_equal(ours, np.asarray(model(ids))), "round trip changed the logits"
    print("round trip: logits bitwise identical")
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers not installed: skipping the reference comparison")
    else:
        hf = AutoModelForCausalLM.from_pretrained(native, attn_implementation="eager").eval()
        with torch.no_grad():
            theirs = hf(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()
        print(f"transformers reference: max |logit diff| / max |logit| = "
              f"{np.abs(ours - theirs).max() / np.abs(theirs).max():.2e}")
    prompts = [[1, 17, 42, 99], [1, 5, 6, 7, 8, 9], [1, 300]]
    for p, out in zip(prompts, greedy(reloaded, prompts, 12)):
        print(f"prompt {p} -> greedy {out}")
    print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
