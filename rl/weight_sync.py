"""The weight-sync phase of a GRPO step: the new policy handed to the generator and, for engines that hold a copy,
checked on fixed probe sequences against the trainer's own logprobs."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from rl.generation import backends
from rl.generation.base import Generator, SamplingParams


@dataclasses.dataclass
class ProbeCheck:
    """Fixed sequences every engine must score as the trainer does after each weight transfer."""
    prompts: list
    responses: list
    sampling: SamplingParams
    trainer_logprobs: Callable  # (prompts, responses) -> the trainer's logprobs, as `probe_max_abs_diff` reads
    limit: float | None  # generation.verify_max_abs_diff (None: measure only)


def probe_check(generation, vocab_size: int, sampling: SamplingParams, trainer_logprobs: Callable
                ) -> ProbeCheck | None:
    """The probe of every transfer (`generation`: the run's generation section): generation.verify_probes sequences,
    each half prompt and half response of generation.max_seq_len tokens; None for the JAX engine, which shares the
    trainer's parameters, or with verify_probes 0. Scored at the run's temperature without its top-k / top-p
    (`probe_sampling`; `trainer_logprobs` must score the same): under them most random probe tokens are -inf on both
    sides, and the check compared almost nothing."""
    if generation.backend == "jax" or not generation.verify_probes:
        return None
    half = max(generation.max_seq_len // 2, 1)
    prompts, responses = backends.probe_sequences(generation.verify_probes, vocab_size, half,
                                                  generation.max_seq_len - half)
    return ProbeCheck(prompts, responses, probe_sampling(sampling), trainer_logprobs, generation.verify_max_abs_diff)


def probe_sampling(sampling: SamplingParams) -> SamplingParams:
    """The transform the probes are scored under: the run's temperature, every token kept."""
    return sampling.untruncated()


def sync_weights(engine: Generator, state, version: int, probe: ProbeCheck | None = None) -> dict:
    """Hand the new weights to the generator. For engines that received a copy, report the transfer
    and, with `probe`, compare every engine's logprobs on the probe sequences with the trainer's.
    Returns metrics (empty when the engine shares the parameters)."""
    t0 = time.perf_counter()
    stats = engine.set_weights(state.params, version, state.rest)
    if stats is None:  # the JAX engine shares the parameters: nothing moved
        return {}
    out = {"time/weight_transfer": time.perf_counter() - t0, "transfer/gb_per_s": stats.gb_per_s,
           "transfer/convert_s": stats.convert_s, "transfer/send_s": stats.send_s,
           "transfer/apply_s": stats.apply_s, "transfer/senders": stats.senders,
           "pool/resent_rows": engine.resent_rows,
           "pool/restarts": engine.restarts}
    if probe is not None:
        engine_lp = engine.score(probe.prompts, probe.responses, probe.sampling)
        diff = backends.probe_max_abs_diff(engine_lp, probe.trainer_logprobs(probe.prompts, probe.responses),
                                           probe.prompts)
        out["transfer/probe_max_abs_logprob_diff"] = diff
        out["transfer/probe_engines"] = len(engine_lp)
        if probe.limit is not None and (diff > probe.limit or len(engine_lp) == 0):
            raise RuntimeError(f"after the transfer of weight version {version}, the vLLM engines' logprobs on "
                               f"the probe sequences differ from the trainer's by {diff:.3g} > "
                               f"generation.verify_max_abs_diff={probe.limit} ({len(engine_lp)} engines answered)")
    return out
