"""A GRPO step's logprob pass and train step on rows of mixed lengths: every micro-batch at the full width vs
micro-batches cut to the widths their rows need (`grpo.micro_batch_widths`, `sharding.widths`), side by side.

Model (m3jax.tiny.m3_config): 4 layers (1 full attention + 3 sparse, 1 dense MLP + 3 MoE of 8 experts, top-2),
hidden 256, 4 query heads of 64, 2 kv heads, index blocks of 64, top-4, vocab 2048, fp32, remat on. Rows: prompts
of 64-256 tokens and responses drawn from `--lengths` (uniform: 32 .. the response budget; long-tail: most
responses short, a few at the budget, as early in an RL run), right-padded to --seq positions. The rows of the
step are sorted longest first (`rl.phases.sorted_by_length`) for both contestants, so only the cut differs.
--rows rows in micro-batches of --micro rows. Median wall seconds of --iters round-robin calls after a warm-up
(which compiles every width); the loss and the gradient norm of both are printed side by side.

    .venv/bin/python scripts/bench_micro_batch_widths.py                      # S = 2048, widths 512 1024 1536
    .venv/bin/python scripts/bench_micro_batch_widths.py --lengths long-tail
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from m3jax import tiny  # noqa: E402
from rl.generation.base import SamplingParams  # noqa: E402
from rl.grpo.batch import split_micro  # noqa: E402
from rl.logprobs import make_logprob_pass  # noqa: E402
from rl.phases import sorted_by_length, width_metrics  # noqa: E402
from sharding import precision  # noqa: E402
from sharding.train_step import init_state, make_train_step  # noqa: E402


def batch_of(rows: int, seq: int, lengths: str, vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(64, 257, rows)
    budget = seq - prompt
    if lengths == "uniform":
        response = rng.integers(32, budget + 1)
    else:  # long-tail: exponential with mean budget / 5, a tenth of the rows at the budget
        response = np.minimum(budget, 32 + rng.exponential(budget / 5)).astype(int)
        at_budget = rng.choice(rows, max(1, rows // 10), replace=False)
        response[at_budget] = budget[at_budget]
    real = prompt + response
    pos = np.arange(seq)
    ids = rng.integers(3, vocab, (rows, seq + 1)).astype(np.int32)
    attention = (pos < real[:, None]).astype(np.int32)
    loss = ((pos >= prompt[:, None] - 1) & (pos < real[:, None] - 1)).astype(np.float32)
    return {"input_ids": ids[:, :-1] * attention, "targets": ids[:, 1:], "attention_mask": attention,
            "loss_mask": loss}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--widths", type=int, nargs="+", default=[512, 1024, 1536])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--lengths", choices=("uniform", "long-tail"), default="uniform")
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()

    cfg = tiny.m3_config(layers=4, full_attention_layers=1, dense_layers=1, vocab_size=2048, hidden_size=256,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
                         dense_intermediate_size=512, index_n_heads=2, index_head_dim=64, index_block_size=64,
                         index_topk_blocks=4, max_position_embeddings=a.seq + 1)
    model = tiny.m3_model(cfg, seed=0, remat=True)
    opt = precision.with_master_weights(optax.sgd(1e-3), "none")
    batch = split_micro(sorted_by_length(batch_of(a.rows, a.seq, a.lengths, cfg.vocab_size), 1), a.rows // a.micro)
    fractions = width_metrics(batch, tuple(a.widths))
    sampling = SamplingParams(max_new_tokens=a.seq)

    contestants = {}
    for name, widths in (("full width", ()), ("cut", tuple(a.widths))):
        graphdef, state = init_state(model, opt)
        state = jax.device_put(state, jax.devices()[0])
        contestants[name] = (make_logprob_pass(graphdef, sampling, widths=widths),
                             make_train_step(graphdef, opt, donate=False, widths=widths), state)

    def logprobs(name):
        lp, _, state = contestants[name]
        return jax.block_until_ready(lp(state.params, state.rest, batch))

    def train(name):
        _, step, state = contestants[name]
        return jax.block_until_ready(step(state, batch)[1])

    times = {(n, p): [] for n in contestants for p in ("logprobs", "train")}
    metrics = {}
    for name in contestants:  # warm-up: compiles every width
        logprobs(name)
        metrics[name] = train(name)
    for _ in range(a.iters):
        for name in contestants:
            for phase, fn in (("logprobs", logprobs), ("train", train)):
                t = time.perf_counter()
                fn(name)
                times[(name, phase)].append(time.perf_counter() - t)

    print(f"S = {a.seq}, {a.rows} rows in micro-batches of {a.micro}, lengths {a.lengths}, widths {a.widths}: "
          f"real tokens {fractions['batch/real_frac']:.3f} of the positions, cut computes "
          f"{fractions['batch/computed_frac']:.3f}")
    print("| pass | full width s | cut s | full / cut |\n|---|---|---|---|")
    for phase in ("logprobs", "train"):
        full, cut = (statistics.median(times[(n, phase)]) for n in contestants)
        print(f"| {phase} | {full:.3f} | {cut:.3f} | {full / cut:.2f} |")
    for name, m in metrics.items():
        print(f"{name}: loss {float(m['loss']):.8g}, grad norm {float(m['grad_norm']):.8g}")


if __name__ == "__main__":
    main()
