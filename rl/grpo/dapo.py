"""DAPO's sampling-side pieces: dynamic sampling that refills, and the soft overlong punishment.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv 2503.14476).
Pure functions of plain arrays; `rl.phases.draw` runs the rounds (generation and scoring) around them.

Dynamic sampling (DAPO's constraint 0 < |{o_i : is_equivalent(a, o_i)}| < G)
---------------------------------------------------------------------------
A group whose G rewards are all equal has advantage 0 under a mean baseline: it carries no policy
gradient and only dilutes the loss normaliser. DAPO over-samples: it keeps drawing batches of prompts
and keeps the groups with non-zero reward variance until the step holds exactly `prompts_per_step` of
them, so the batch size and the normaliser stay what the config says. Here the rounds are bounded
(`grpo.dynamic_sampling_max_rounds`); when they run out, the earliest zero-variance groups fill the
batch (loss weight 0). Variance is that of the final, summed reward (after overlong shaping), i.e. the
quantity the advantages are computed from.

Soft overlong punishment (DAPO's R_length), L_max = generation.max_new_tokens, L_cache = overlong_buffer:

    R_length(y) =  0                                    if |y| <= L_max - L_cache
                   ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                  -1                                    if L_max < |y|

added to the task reward times `overlong_penalty` (DAPO: 1). A response cut at the limit
(|y| = L_max) gets the full -penalty; the penalty ramps linearly over the last L_cache tokens.
"""

from __future__ import annotations

import logging
from typing import Sequence

import jax
import numpy as np

log = logging.getLogger(__name__)


def round_key(seed: int, step: int, round: int) -> jax.Array:
    """The sampling key of a step's `round`-th batch: fold_in(key(seed), step) for round 0 (the key a
    step without dynamic sampling uses, so turning the feature on changes nothing in round 0), and
    fold_in(that, round) for the refills. A function of (run.seed, step, round) only: a resumed run
    draws the same samples."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return key if round == 0 else jax.random.fold_in(key, round)


def select_groups(zero_variance: Sequence[np.ndarray], num_groups: int) -> tuple[np.ndarray, int]:
    """Which drawn groups a step trains on.

    Args:
      zero_variance: per round, bool [groups of that round]: True where all G rewards are equal.
      num_groups: prompts_per_step, the groups the step must hold.
    Returns:
      (picked, informative): picked is int [num_groups, 2] of (round, group) in draw order;
      informative = how many of them have non-zero variance. The first `num_groups` informative groups
      in draw order are taken; if there are fewer, the earliest zero-variance groups fill the rest.
    Raises ValueError when fewer than `num_groups` groups were drawn in all.
    """
    pairs = [(r, g) for r, z in enumerate(zero_variance) for g in range(len(z))]
    flags = np.concatenate([np.asarray(z, bool) for z in zero_variance]) if pairs else np.zeros(0, bool)
    if len(pairs) < num_groups:
        raise ValueError(f"only {len(pairs)} groups drawn, the step needs {num_groups}")
    good = np.flatnonzero(~flags)[:num_groups]
    fill = np.flatnonzero(flags)[:num_groups - len(good)]
    chosen = np.sort(np.concatenate([good, fill]))  # draw order: round 0's groups first
    return np.asarray(pairs, np.int64).reshape(-1, 2)[chosen], int(len(good))


def overlong_penalty(lengths, max_len: int, buffer: int, penalty: float = 1.0) -> np.ndarray:
    """float32 [N]: DAPO's soft overlong punishment per response (module docstring), to add to the reward.

    0 up to max_len - buffer tokens, then linear down to -penalty at max_len; -penalty beyond it.
    buffer = 0 switches it off (all zeros).
    """
    lengths = np.asarray(lengths, np.float64)
    if buffer <= 0:
        return np.zeros(lengths.shape, np.float32)
    if buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} exceeds the length limit {max_len}")
    start = max_len - buffer
    r = np.where(lengths <= start, 0.0, (start - lengths) / buffer)
    r = np.where(lengths > max_len, -1.0, r)
    return (r * penalty).astype(np.float32)


class ShortSteps:
    """Tells of the steps whose dynamic sampling ran out of rounds before it found enough informative groups: the
    first as a warning, the rest in run.log (near convergence it is every step); the metric dapo/filled_groups
    counts them too."""

    def __init__(self):
        self.count = 0

    def after(self, step_done: int, metrics: dict, prompts_per_step: int) -> None:
        """step_done: the step's number as metrics.jsonl numbers it (steps done)."""
        if not metrics.get("dapo/filled_groups"):
            return
        self.count += 1
        (log.warning if self.count == 1 else log.debug)(
            "step %d: dynamic sampling found %d of %d informative groups in %d round(s) "
            "(grpo.dynamic_sampling_max_rounds); %d zero-variance groups fill the step at loss weight 0",
            step_done, metrics["dapo/kept_groups"], prompts_per_step, metrics["dapo/rounds"],
            metrics["dapo/filled_groups"])
