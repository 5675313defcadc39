"""The KL's reference scores under the run's temperature with every token kept (rl.trainer's `untruncated_pass`):
under the run's own top-k / top-p a token the moved policy sampled outside the reference's nucleus had logp_ref
-inf (an audit: 7 of 72 tokens at step 1 of a top_p 0.8 run, clamped to a constant that was nearly all of the
logged kl; with the clamps off every step after the first was skipped)."""

import numpy as np
import pytest

from rl import phases
from rl.generation.base import SamplingParams
from tests.tiny_runs import tiny_trainer


def test_the_reference_is_scored_through_its_own_pass():
    seen = []

    def pass_of(name):
        def run(params, rest, micro):
            seen.append((name, params))
            return np.zeros((1, 2), np.float32) + len(seen)
        return run

    state = type("S", (), {"params": "P", "rest": "R"})()
    micro = phases.logprobs(pass_of("policy"), state, {"input_ids": np.zeros((1, 2))}, ref_params="REF",
                            ref_pass=pass_of("reference"))
    assert seen == [("policy", "P"), ("reference", "REF")] and micro["logp_ref"][0, 0] == 2


def test_untruncated_keeps_the_temperature_and_drops_top_k_and_top_p():
    s = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.8, top_k=3, stop_token_ids=(1,))
    assert s.untruncated() == SamplingParams(max_new_tokens=4, temperature=0.7, stop_token_ids=(1,))


@pytest.mark.slow  # ~30 s: four steps of a tiny trainer
def test_a_kl_run_with_top_k_and_no_clamps_keeps_training(tmp_path):
    trainer = tiny_trainer(tmp_path, "topk", "generation.top_k=2", "grpo.kl=k3", "grpo.kl_coef=0.1",
                           "grpo.kl_clamp=null", "grpo.kl_log_ratio_clamp=null", "optim.lr=3e-2",
                           "eval.every_steps=0", "eval.at_start=false", "logging.indexer_recall_every=0")
    try:
        assert trainer.untruncated_pass is not trainer.logprobs
        rows = [trainer.step(s) for s in range(4)]
    finally:
        trainer.engine.shutdown()
    assert [r["skipped_updates"] for r in rows] == [0, 0, 0, 0], rows
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["kl"]) for r in rows), rows
    assert [r["kl/ref_inf_frac"] for r in rows] == [0.0] * 4
    assert rows[0]["kl"] > 0  # step 1's policy is the reference, but truncated to its top 2 while the reference is not
