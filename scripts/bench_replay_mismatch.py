"""Routing and indexer-selection replay under an induced generator/trainer mismatch (issue 14's acceptance).

A tiny M3 (1 full-attention dense layer + 2 sparse-attention MoE layers, 8 experts top-2, index blocks of 4,
top-2 blocks, so the sparse layers really select past 8 tokens) is the trainer. The generator is the same
model with every parameter multiplied by (1 + sigma * N(0, 1)) (seeded): a small numeric difference like a
bf16 engine's. The JAX engine samples with the generator (temperature 1, returning its MoE routes and key
blocks); the trainer then scores the sampled tokens (`rl.logprobs.policy_logprobs`, the logprob pass's
function) with replay off, routes replayed, blocks replayed, and both. Printed per sigma and setting, over
the response tokens: moe/route_mismatch_frac and indexer/selection_mismatch_frac (trainer's own choice vs the
generator's), gen_kl_error and token_mult_prob_error (`rl.grpo.mismatch.generation_mismatch_metrics`,
NeMo-RL's definitions). Replay cannot remove the mismatch of the weights themselves; it removes the part
that flipped discrete choices add.

    .venv/bin/python scripts/bench_replay_mismatch.py                     # sigma 1e-3 1e-2, 64 samples
    .venv/bin/python scripts/bench_replay_mismatch.py --sigma 3e-2 --rows 128
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from m3jax import tiny  # noqa: E402
from rl.generation.base import SamplingParams  # noqa: E402
from rl.generation.jax_engine import JaxEngine  # noqa: E402
from rl.grpo.mismatch import generation_mismatch_metrics, route_mismatch_frac, selection_mismatch_frac  # noqa: E402
from rl.logprobs import policy_logprobs  # noqa: E402

CFG = tiny.m3_config(layers=3, full_attention_layers=1, dense_layers=1, hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, intermediate_size=32, dense_intermediate_size=64,
                     num_local_experts=8, num_experts_per_tok=2, index_n_heads=2, index_head_dim=16,
                     index_block_size=4, index_topk_blocks=2, vocab_size=128)
PROMPT, NEW = 16, 32


def perturbed(params, sigma: float, seed: int):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [p * (1 + sigma * jax.random.normal(k, p.shape, p.dtype))
                                     for p, k in zip(leaves, keys)])


def batch_of(rollout, prompts):
    """Training arrays of prompt + response: input_ids / targets / attention_mask [N, S], the generator's
    logp at the position that predicts each response token, its routes and blocks, the response mask."""
    n, s = len(prompts), PROMPT + NEW - 1
    ids, tgt, att, resp, lg = (np.zeros((n, s), t) for t in (np.int32, np.int32, np.int32, np.float32, np.float32))
    for i, p in enumerate(prompts):
        length = int(rollout.lengths[i])
        seq = list(p) + list(rollout.tokens[i, :length])
        ids[i, :len(seq) - 1], tgt[i, :len(seq) - 1], att[i, :len(seq) - 1] = seq[:-1], seq[1:], 1
        resp[i, len(p) - 1:len(seq) - 1] = 1
        lg[i, len(p) - 1:len(seq) - 1] = rollout.logprobs[i, :length]
    mb = {"input_ids": ids, "targets": tgt, "attention_mask": att,
          "routes": rollout.routes[:, :s], "block_ids": rollout.block_ids[:, :s]}
    return {k: jnp.asarray(v) for k, v in mb.items()}, jnp.asarray(lg), jnp.asarray(resp)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sigma", type=float, nargs="+", default=[1e-3, 1e-2])
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    model = tiny.m3_model(CFG, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    prompts = [list(r) for r in np.random.default_rng(1).integers(3, CFG.vocab_size, (args.rows, PROMPT))]
    sp = SamplingParams(max_new_tokens=NEW, temperature=1.0)

    @jax.jit(static_argnums=(2, 3))
    def score(params, mb, replay_routes, replay_blocks):
        m = nnx.merge(graphdef, params, rest)
        return policy_logprobs(m, mb, sp, 0, replay=replay_routes, return_routes=True, replay_blocks=replay_blocks,
                               return_block_ids=True)

    print(f"tiny M3: {CFG.num_hidden_layers} layers ({model.num_moe_layers} MoE, {model.num_sparse_layers} sparse; "
          f"blocks of {CFG.index_block_size}, top-{CFG.index_topk_blocks}), {args.rows} samples of {PROMPT} + "
          f"<= {NEW} tokens, temperature 1")
    print("| sigma | replay | route mismatch | selection mismatch | gen_kl_error | token_mult_prob_error |")
    print("|---|---|---|---|---|---|")
    for sigma in args.sigma:
        gen = JaxEngine(graphdef, perturbed(params, sigma, seed=7), rest, return_routes=True, return_block_ids=True)
        rollout = gen.generate(prompts, sp, jax.random.key(3), prompt_width=PROMPT)
        mb, logp_gen, mask = batch_of(rollout, prompts)
        for name, rr, rb in (("none", False, False), ("routes", True, False), ("blocks", False, True),
                             ("routes + blocks", True, True)):
            logp, own_routes, own_blocks = score(params, mb, rr, rb)
            mm = generation_mismatch_metrics(logp_gen, logp, mask)
            print(f"| {sigma:g} | {name} | {float(route_mismatch_frac(own_routes, mb['routes'], mask)):.4f} | "
                  f"{float(selection_mismatch_frac(own_blocks, mb['block_ids'], mask)):.4f} | "
                  f"{float(mm['gen_kl_error']):.3e} | {float(mm['token_mult_prob_error']):.6f} |", flush=True)


if __name__ == "__main__":
    main()
