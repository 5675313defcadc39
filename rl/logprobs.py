"""The logprob pass: per-token log-probabilities of given targets under the current (or reference)
weights, through the same model and sampling transform as the loss, on the run's layout.

Used for `logp_old`, the KL reference and the engines' probe checks. It runs under the layout's mesh
with the batch placed as the train step places it, so it lowers to the same expert-parallel program
as the update (a pass outside the mesh would gather every expert onto every device).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rl.generation.base import SamplingParams, token_logprobs
from sharding.layout import Layout
from sharding.train_step import batch_sharding

_INPUTS = ("input_ids", "attention_mask", "targets")


def make_logprob_pass(graphdef, sampling: SamplingParams, layout: Layout = Layout()):
    """pass_(params, rest, batch) -> logp [micro-batches, batch, seq] for batch arrays
    [micro-batches, batch, seq] with input_ids, attention_mask and targets (micro-batches run in turn)."""

    @jax.jit
    def run(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        sp = sampling

        def one(mb):
            logits = model(mb["input_ids"], attention_mask=mb["attention_mask"])
            return token_logprobs(logits, mb["targets"], sp.temperature, sp.top_p, sp.top_k)

        return jax.lax.map(one, batch)

    def pass_(params, rest, batch):
        batch = {k: batch[k] for k in _INPUTS}
        if layout.mesh is None:
            return run(params, rest, batch)
        rows = np.shape(batch["input_ids"])[1]
        extra = -rows % layout.size("act_batch")  # e.g. a handful of probe rows: pad, then drop
        if extra:
            batch = {k: np.pad(np.asarray(v), [(0, 0), (0, extra), (0, 0)]) for k, v in batch.items()}
        spec = batch_sharding(layout).spec
        batch = {k: jax.device_put(v, NamedSharding(layout.mesh, P(*spec[:np.ndim(v)]))) for k, v in batch.items()}
        with jax.set_mesh(layout.mesh):
            out = run(params, rest, batch)
        return out[:, :rows] if extra else out

    pass_.jitted = run
    return pass_
