"""A policy objective and an advantage estimator added from outside the package (rl.grpo.registry): the config
accepts their names, LossConfig and the step's advantages use them; names stay unique."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from rl.config import ConfigError, load_config
from rl.config.grpo_section import ADVANTAGES, LOSSES
from rl.grpo import (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, LossConfig, grpo_loss, register_advantage_estimator,
                     register_policy_loss)
from rl.grpo.objectives import PolicyTerm
from rl.phases import advantages
from tests.test_run_config import TINY


@pytest.fixture
def registered():
    """Registers `_test_plain_pg` and `_test_rank` for the test, and removes them after it."""
    def plain_pg(lp, lo, a, m, cfg):  # REINFORCE written by a user: -A * logp
        return PolicyTerm(-a * lp, jnp.exp(lp - lo), jnp.zeros(lp.shape, bool), jnp.zeros(lp.shape, bool))

    def rank(rewards, group_size):  # each sample's rank in its group, centred
        r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
        ranks = jnp.argsort(jnp.argsort(r, axis=1), axis=1).astype(jnp.float32)
        return (ranks - (group_size - 1) / 2).reshape(-1)

    register_policy_loss("_test_plain_pg")(plain_pg)
    register_advantage_estimator("_test_rank")(rank)
    yield plain_pg, rank
    for registry, choices, name in ((POLICY_LOSSES, LOSSES, "_test_plain_pg"),
                                    (ADVANTAGE_ESTIMATORS, ADVANTAGES, "_test_rank")):
        registry.pop(name, None)
        choices.registered.remove(name)


def test_a_registered_objective_and_estimator_load_and_run(registered):
    plain_pg, _ = registered
    cfg = load_config(TINY, ["grpo.loss=_test_plain_pg", "grpo.advantage=_test_rank", "grpo.dual_clip=null"])
    assert (cfg.grpo.loss, cfg.grpo.advantage) == ("_test_plain_pg", "_test_rank")
    adv = advantages(np.array([0.0, 1.0, 0.5, 0.2, 3.0, 1.0], np.float32), np.zeros(6, bool),
                     dataclasses.replace(cfg.grpo, group_size=3))
    np.testing.assert_array_equal(adv.advantages, [-1, 1, 0, -1, 1, 0])
    lp = jnp.asarray([[-1.0, -2.0, -0.5]])
    mask, a = jnp.ones((1, 3)), jnp.asarray([2.0])
    got, _ = grpo_loss(lp, lp, lp, a, mask, LossConfig(loss="_test_plain_pg", dual_clip=None))
    want, _ = grpo_loss(lp, lp, lp, a, mask, LossConfig(loss="reinforce", dual_clip=None))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)  # the same objective, written outside


def test_names_stay_unique_and_unregistered_ones_are_refused(registered):
    plain_pg, _ = registered
    register_policy_loss("_test_plain_pg")(plain_pg)  # the same function again (a module reloaded): fine
    with pytest.raises(ValueError, match="policy loss '_test_plain_pg' is already registered"):
        register_policy_loss("_test_plain_pg")(lambda lp, lo, a, m, cfg: None)
    with pytest.raises(ConfigError, match=r'grpo.advantage = "_test_rnak": not an allowed value \(did you mean '
                                          r'"_test_rank"\?\)'):
        load_config(TINY, ["grpo.advantage=_test_rnak"])
    # a custom objective's name without the launcher that registers it: the error says how names are added
    with pytest.raises(ConfigError, match=r'grpo.loss = "my_pg": not an allowed value; allowed: one of "ppo_clip", '
                                          r'.*, or a name registered with rl.grpo.register_policy_loss before the '
                                          r'config loads'):
        load_config(TINY, ["grpo.loss=my_pg", "grpo.dual_clip=null"])


def test_the_objectives_keys_are_not_named_inert_under_a_registered_objective(registered):
    """docs/extending.md: a registered objective receives every grpo key (eps_high, gspo_*, ...) and uses them or not;
    the start warned that grpo.eps_high "has no effect" under it (an audit). Under a shipped objective it still is."""
    from rl.start_warnings import start_warnings
    for loss, named in (("_test_plain_pg", False), ("reinforce", True)):
        cfg = load_config(TINY, [f"grpo.loss={loss}", "grpo.dual_clip=null", "grpo.eps_high=0.3",
                                 "grpo.gspo_eps_high=0.01"])
        lines = [w for w in start_warnings(cfg, cfg.model.m3_config()) if "eps_high" in w]
        assert bool(lines) == named, (loss, lines)


def test_the_rank_estimator_of_docs_extending_gives_ties_one_rank():
    """The estimator docs/extending.md shows, run as written: it ranked tied rewards by their place in the group, so
    a group of equal rewards got advantages -3.5 .. 3.5 instead of 0 (an audit)."""
    import re
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "extending.md")).read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if 'estimator("rank")' in b)
    names = {}
    try:
        exec(block, names)
        rank = names["rank"]
        np.testing.assert_array_equal(rank(jnp.zeros(8), 8), np.zeros(8))
        np.testing.assert_array_equal(rank(jnp.asarray([1.0, 0, 0, 0, 2, 5, 2, 1]), 4),
                                      [1.5, -0.5, -0.5, -0.5, 0, 1.5, 0, -1.5])
    finally:
        for registry, choices, name in ((POLICY_LOSSES, LOSSES, "plain_pg"), (ADVANTAGE_ESTIMATORS, ADVANTAGES, "rank")):
            if registry.pop(name, None) is not None:
                choices.registered.remove(name)
