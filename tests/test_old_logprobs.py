"""`grpo.old_logprobs: update`: with one update per step, logp_old is the update's own log-probs (gradient stopped)
instead of a forward over the step's sequences before it. The step trains as with the pass (same samples, losses,
gradient norms and mismatch metrics up to float order), only without that forward."""

import pytest

from rl.config import ConfigError, load_config
from tests.tiny_runs import TINY, numbers, tiny_trainer, two_steps


def test_the_update_as_its_own_logp_old_needs_one_update_per_step():
    with pytest.raises(ConfigError, match=r'grpo.old_logprobs = "update" with grpo.updates_per_step = 2: the second '
                                          r"and later updates would take logp_old from weights the first already "
                                          r"changed"):
        load_config(str(TINY), ["grpo.old_logprobs=update", "grpo.updates_per_step=2"])


@pytest.mark.slow  # two short trainer runs
def test_a_step_without_the_logprob_pass_trains_as_one_with_it(tmp_path):
    want = two_steps(tiny_trainer(tmp_path, "pass"))
    got = two_steps(tiny_trainer(tmp_path, "update", "grpo.old_logprobs=update"))
    for w, g in zip(want, got):
        w, g = numbers(w), numbers(g)
        assert g["reward/mean"] == w["reward/mean"]  # the same samples: the weights moved the same way
        for k in ("loss", "grad_norm", "clip_frac", "gen_kl_error", "token_mult_prob_error", "is_out_of_band_frac",
                  "entropy_approx"):
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), k
    # the pass took its time before; now it is not run (the trainer's own routes for moe/route_mismatch_frac come
    # from the pass, so that metric is left out)
    assert "moe/route_mismatch_frac" in want[0] and "moe/route_mismatch_frac" not in got[0]
