"""The weight probe after each transfer (rl.weight_sync): scored at the run's temperature without its top-k / top-p,
so that an engine holding other weights is caught whatever the run samples with."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx

from m3jax.tiny import m3_config, m3_model
from rl.config import load_config
from rl.generation import backends
from rl.generation.base import SamplingParams
from rl.generation.jax_engine import JaxEngine
from rl.generation.transfer import TransferStats
from rl.logprobs import make_logprob_pass
from rl.weight_sync import probe_check, sync_weights
from tests.tiny_runs import TINY, tiny_trainer


class HeldCopy:
    """An engine holding its own copy of the weights (as vLLM's do), here another model's."""

    def __init__(self, graphdef, params, rest):
        self.engine, self.resent_rows, self.restarts = JaxEngine(graphdef, params, rest), 0, 0

    def set_weights(self, params, version, rest=None):
        return TransferStats(version, 1, 1, 1, 0.0, 0.0, 0.0, 0.0)

    def score(self, prompts, responses, sampling):
        return self.engine.score(prompts, responses, sampling)  # one list per engine: [[logprobs per probe]]


def test_an_engine_with_other_weights_fails_the_probe_under_top_k():
    """Under top-k 20 the random probe tokens were -inf on both sides, |-inf - -inf| = NaN was passed over, and an
    engine serving entirely other weights read a difference of 0."""
    cfg = m3_config(index_block_size=4, index_topk_blocks=2, max_position_embeddings=64)
    graphdef, params, rest = nnx.split(m3_model(cfg, seed=0), nnx.Param, ...)
    other = HeldCopy(*nnx.split(m3_model(cfg, seed=1), nnx.Param, ...))
    same = HeldCopy(graphdef, params, rest)
    run = load_config(str(TINY), ["generation.backend=vllm", "generation.verify_probes=4",
                                  "generation.max_prompt_tokens=8", "generation.max_new_tokens=8",
                                  "generation.verify_max_abs_diff=1e-4"],
                      check_paths=False)

    def trainer_logprobs(prompts, responses):
        batch = backends.probe_batch(prompts, responses, 16, 0)
        return np.asarray(make_logprob_pass(graphdef, probe.sampling)(params, rest, batch))[0]

    state = SimpleNamespace(params=params, rest=rest)
    sampling = SamplingParams(8, temperature=0.7, top_k=20, top_p=0.9)
    probe = probe_check(run.generation, cfg.vocab_size, sampling, trainer_logprobs)
    assert probe.sampling == dataclasses.replace(sampling, top_k=0, top_p=1.0)
    assert sync_weights(same, state, 1, probe)["transfer/probe_max_abs_logprob_diff"] < 1e-5
    with pytest.raises(RuntimeError, match="differ from the trainer's by"):
        sync_weights(other, state, 1, probe)


def test_the_trainer_scores_the_probes_without_top_k_or_top_p(tmp_path):
    trainer = tiny_trainer(tmp_path, "run", "generation.top_k=3", "generation.top_p=0.5")
    try:
        prompts, responses = backends.probe_sequences(2, trainer.policy.model_cfg.vocab_size, 4, 4)
        got = trainer._probe_logprobs(prompts, responses)
        assert np.isfinite(got[:, 3:7]).all()  # every probe token scored (under top-k 3 most were -inf)
        assert trainer.untruncated_pass is not trainer.logprobs
    finally:
        trainer.engine.shutdown()
