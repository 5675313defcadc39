"""`grpo.old_logprobs: update`: with one update per step, logp_old is the update's own log-probs (gradient stopped)
instead of a forward over the step's sequences before it. The step trains as with the pass (same samples, losses,
gradient norms and mismatch metrics up to float order), only without that forward."""

import jax
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
        # the update compares its own experts and key blocks with the generator's, as the pass did
        for k in ("moe/route_mismatch_frac", "indexer/selection_mismatch_frac"):
            assert k in w and g[k] == pytest.approx(w[k], abs=1e-9), k


@pytest.mark.parametrize("replay", [False, True])
def test_the_update_compares_its_own_experts_and_key_blocks_with_the_generators(replay):
    """Without a pass, the loss sums how many of the real tokens' (MoE layer) expert sets and (sparse layer, index
    head) key-block sets the generator chose differently from the trainer: the numbers the pass's
    `route_mismatch_frac` / `selection_mismatch_frac` give. Under replay the update runs the generator's ids and
    still compares its own choices."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from m3jax.tiny import m3_model, random_ids
    from rl.generation.base import SamplingParams
    from rl.grpo.loss import LossConfig
    from rl.grpo.mismatch import id_mismatch_from_sums, route_mismatch_frac, selection_mismatch_frac
    from rl.policy import grpo_loss_fn
    from tests.test_routing_replay import CFG

    model = m3_model(CFG, seed=3)
    ids = np.asarray(random_ids(CFG, 2, 33, seed=4))
    mask = np.ones((2, 32), np.int32)
    mask[1, 20:] = 0  # right padding: its ids count for neither
    _, routes, blocks = model(jnp.asarray(ids[:, :-1]), attention_mask=jnp.asarray(mask), return_routes=True,
                              return_block_ids=True)
    routes, blocks = np.asarray(routes), np.asarray(blocks)
    gen_routes, gen_blocks = routes.copy(), blocks.copy()
    gen_routes[0, 3:9, 1] = (gen_routes[0, 3:9, 1] + 1) % CFG.num_local_experts  # 6 of 2 x 52 real (token, layer)
    gen_routes[1, 25:, 0] = (gen_routes[1, 25:, 0] + 1) % CFG.num_local_experts  # padding: not counted
    gen_blocks[0, 16:, 0, 0, 0] = -1  # a dropped block on layer 0, head 0 from position 16 on
    mb = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "attention_mask": mask, "loss_mask": mask.astype(np.float32),
          "logp_gen": np.zeros((2, 32), np.float32), "advantages": np.ones((2, 32), np.float32),
          "routes": gen_routes.astype(np.int16), "block_ids": gen_blocks.astype(np.int16)}
    loss_fn = grpo_loss_fn(SamplingParams(max_new_tokens=1), LossConfig(), replay=replay, indexer_replay=replay)
    graphdef, state = nnx.split(model)
    _, stats = jax.jit(lambda s, b: loss_fn(nnx.merge(graphdef, s), b))(state, {k: jnp.asarray(v) for k, v in mb.items()})
    got = id_mismatch_from_sums({k: float(v) for k, v in stats.items()})
    if replay:  # the trainer's own choices downstream of the replayed ones (what the pass returns under replay)
        _, routes, blocks = model(jnp.asarray(ids[:, :-1]), attention_mask=jnp.asarray(mask),
                                  routes=jnp.asarray(gen_routes), block_ids=jnp.asarray(gen_blocks),
                                  return_routes=True, return_block_ids=True)
    want_routes = float(route_mismatch_frac(routes, gen_routes, mask))
    want_blocks = float(selection_mismatch_frac(blocks, gen_blocks, mask))
    assert want_routes >= 6 / (52 * 2) and want_blocks > 0
    assert got == {"moe/route_mismatch_frac": pytest.approx(want_routes),
                   "indexer/selection_mismatch_frac": pytest.approx(want_blocks)}
