"""Rewards scored once per job: process 0 scores a batch, every process receives its values.

Every process of a multi-host run holds the same rollout, and each used to score it itself. That is N times the
work of a judge's requests or a code reward's test runs (32 x on the 32-node recipe), and a reward that depends on
time or chance (a timeout on one host and not on another, a judge sampled above temperature 0, one failed request)
scored a sample differently on two hosts: each host then trained its own rows on its own rewards and advantages,
and dynamic sampling could keep other groups, or draw another number of rounds, on each (the hosts' next
collectives would then not match).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from rl.rewards.registry import score_specs
from sharding.host_values import broadcast_from_first_process


def score_once(specs, completions, answers, truncated, records=None, *, process_index: int | None = None,
               process_count: int | None = None, broadcast: Callable = broadcast_from_first_process
               ) -> tuple[np.ndarray, int, dict[str, np.ndarray]]:
    """`rl.rewards.registry.score_specs` of the batch, computed on process 0 and broadcast: (weighted total per
    sample float32, failed evaluations, each reward's own values by name), the same on every process. One process:
    score_specs itself. `process_index` / `process_count` / `broadcast` default to jax's (tests pass their own)."""
    count = jax.process_count() if process_count is None else process_count
    if count == 1:
        return score_specs(specs, completions, answers, truncated, records)
    n = len(completions)
    if (jax.process_index() if process_index is None else process_index) == 0:
        total, failures, parts = score_specs(specs, completions, answers, truncated, records)
    else:  # the same tree of shapes and dtypes as process 0 sends: a collective needs it
        total, failures, parts = np.zeros(n, np.float32), 0, {s.name: np.zeros(n, np.float32) for s in specs}
    total, failures, parts = broadcast((np.asarray(total, np.float32), np.asarray(failures, np.int32),
                                        {k: np.asarray(v, np.float32) for k, v in parts.items()}))
    # Copies: what jax's broadcast returns across hosts is read-only (jax.device_get), and callers add to the total in
    # place (DAPO's overlong punishment in rl.phases.rewards).
    return np.array(total), int(failures), {k: np.array(v) for k, v in parts.items()}
