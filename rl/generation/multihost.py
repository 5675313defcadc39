"""A vLLM pool behind a multi-host trainer: process 0 owns the pool, every process sees its results.

The trainer is SPMD: every training process runs the same step on the same prompts. Only one of them
may talk to the engines (one pool, not one per host), but all of them need the rollout, and gathering
the weights into HF tensors (`hf_tensors`) is a collective that every process must iterate in the same
order. So process 0 generates / pushes / scores and broadcasts what came back; the others take part in
the collectives and receive the broadcasts.
"""

from __future__ import annotations

import numpy as np
from jax.experimental import multihost_utils

from rl.generation.base import Rollout
from rl.generation.transfer import TransferStats, model_tensors


def _from_zero(value):
    return multihost_utils.broadcast_one_to_all(value)


class ProcessZeroPool:
    def __init__(self, pool, graphdef, *, is_zero: bool, layout: str = "released"):
        self.pool, self.graphdef, self.is_zero, self.layout = pool, graphdef, is_zero, layout
        self.resent_rows = self.restarts = 0

    def generate(self, prompts, params, key, prompt_width=None) -> Rollout:
        n, t = len(prompts), params.max_new_tokens
        if self.is_zero:
            r = self.pool.generate(prompts, params, key, prompt_width)
            arrays = (r.tokens, r.logprobs, r.lengths, r.truncated, np.int32(r.weight_version))
        else:
            arrays = (np.zeros((n, t), np.int32), np.zeros((n, t), np.float32), np.zeros(n, np.int32),
                      np.zeros(n, bool), np.int32(0))
        tokens, logprobs, lengths, truncated, version = (np.asarray(a) for a in _from_zero(arrays))
        # MoE routes (engines started with return_routes): their shape first, so the others can take part
        routes_shape = np.array(r.routes.shape if self.is_zero and r.routes is not None else (0, 0, 0, 0), np.int32)
        routes_shape = tuple(int(x) for x in np.asarray(_from_zero(routes_shape)))
        routes = None
        if routes_shape[0]:
            routes = np.asarray(_from_zero(r.routes if self.is_zero else np.zeros(routes_shape, np.int16)))
        self._counters()
        return Rollout([list(p) for p in prompts], tokens, logprobs, lengths, truncated.astype(bool), int(version),
                       routes=routes)

    def set_weights(self, params, version: int, rest=None) -> TransferStats:
        tensors = model_tensors(self.graphdef, params, rest, self.layout)  # a collective: everyone iterates
        if self.is_zero:
            s = self.pool.push(tensors, version)
            figures = np.array([s.bytes, s.buckets, s.tensors, s.convert_s, s.send_s, s.apply_s, s.total_s], np.float64)
        else:
            for _ in tensors:
                pass
            figures = np.zeros(7, np.float64)
        f = np.asarray(_from_zero(figures))
        self._counters()
        return TransferStats(version, int(f[0]), int(f[1]), int(f[2]), *map(float, f[3:]))

    def score(self, prompts, responses, params) -> list[list[np.ndarray]]:
        lengths = [len(r) for r in responses]
        width = max(lengths)
        if self.is_zero:
            per_engine = self.pool.score(prompts, responses, params)
            count = np.int32(len(per_engine))
        else:
            per_engine, count = [], np.int32(0)
        count = int(_from_zero(count))
        table = np.zeros((count, len(responses), width), np.float32)
        for e, lps in enumerate(per_engine):
            for i, lp in enumerate(lps):
                table[e, i, :len(lp)] = lp
        table = np.asarray(_from_zero(table))
        return [[table[e, i, :lengths[i]] for i in range(len(responses))] for e in range(count)]

    def _counters(self) -> None:
        mine = np.array([self.pool.resent_rows, self.pool.restarts] if self.is_zero else [0, 0], np.int64)
        self.resent_rows, self.restarts = (int(x) for x in np.asarray(_from_zero(mine)))

    def shutdown(self) -> None:
        if self.is_zero:
            self.pool.shutdown()
