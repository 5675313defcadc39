"""Rollouts -> fixed-shape training arrays (one sequence per row, right padded)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class RolloutArrays(Protocol):
    """What a batch is built from (a generator's `Rollout` has these, and more)."""

    prompt_ids: list[list[int]]
    tokens: np.ndarray  # [N, max_new] response tokens
    logprobs: np.ndarray  # [N, max_new] the generator's logprob of each
    lengths: np.ndarray  # [N] response tokens per row


def build_train_batch(rollout: RolloutArrays, advantages: np.ndarray, loss_weight: np.ndarray, *, width: int,
                      pad_id: int) -> dict[str, np.ndarray]:
    """Arrays [N, width - 1] for next-token training on prompt + response.

    input_ids[t] predicts targets[t] = seq[t + 1]; loss_mask is 1 where the target is a response token
    (times loss_weight, which zeroes dropped groups / overlong samples); logp_gen sits at the same
    positions; attention_mask marks the input tokens up to the last one whose prediction is trained (the last
    response token predicts nothing: left as padding, it takes no expert capacity).
    """
    n = len(rollout.prompt_ids)
    seq = np.full((n, width), pad_id, np.int32)
    loss_mask = np.zeros((n, width - 1), np.float32)
    logp_gen = np.zeros((n, width - 1), np.float32)
    attention = np.zeros((n, width - 1), np.int32)
    for i, prompt in enumerate(rollout.prompt_ids):
        p, r = len(prompt), int(rollout.lengths[i])
        if p + r > width:
            raise ValueError(f"sequence {i} has {p} prompt + {r} response tokens > width {width}")
        seq[i, :p] = prompt
        seq[i, p:p + r] = rollout.tokens[i, :r]
        loss_mask[i, p - 1:p - 1 + r] = loss_weight[i]
        logp_gen[i, p - 1:p - 1 + r] = rollout.logprobs[i, :r]
        attention[i, :p + r - 1] = 1
    return {"input_ids": seq[:, :-1], "targets": seq[:, 1:], "loss_mask": loss_mask, "logp_gen": logp_gen,
            "attention_mask": attention, "advantages": advantages.astype(np.float32)}


def split_micro(batch: dict[str, np.ndarray], num_micro: int) -> dict[str, np.ndarray]:
    """[N, ...] -> [num_micro, N / num_micro, ...]."""
    return {k: v.reshape(num_micro, v.shape[0] // num_micro, *v.shape[1:]) for k, v in batch.items()}
