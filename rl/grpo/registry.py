"""Adding a policy objective or an advantage estimator from a module of your own (as `rl.rewards.register_reward`
adds a reward): the function goes into the package's registry and its name into the config's allowed values, so
`grpo.loss: NAME` / `grpo.advantage: NAME` load and run. Register before the config is loaded, in every process
of a job (a launcher that imports the module, docs/extending.md)."""

from __future__ import annotations

from typing import Callable

from rl.config.grpo_section import ADVANTAGES, LOSSES
from rl.grpo.advantages import ADVANTAGE_ESTIMATORS
from rl.grpo.objectives import POLICY_LOSSES


def register_policy_loss(name: str, *, replace: bool = False) -> Callable:
    """Decorator: file `fn(lp, lo, a, m, cfg) -> rl.grpo.objectives.PolicyTerm` under `name`, where lp / lo are the
    [B, T] log-probs of the update (with gradient) and before it, a the [B, T] advantages, m the [B, T] loss mask
    and cfg the run's `rl.grpo.loss.LossConfig`; PolicyTerm's loss is the per-token policy term before the
    importance weight, the mask and the aggregation (`rl.grpo.loss.grpo_loss`)."""
    return _register(name, replace, POLICY_LOSSES, LOSSES, "policy loss")


def register_advantage_estimator(name: str, *, replace: bool = False) -> Callable:
    """Decorator: file `fn(rewards, group_size) -> advantages` under `name`: rewards a flat [N] array of
    N = prompts x group_size samples, each prompt's group consecutive; one float32 advantage per sample."""
    return _register(name, replace, ADVANTAGE_ESTIMATORS, ADVANTAGES, "advantage estimator")


def _register(name, replace, registry: dict, choices, what: str) -> Callable:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name must be a non-empty string, got {name!r}")

    def decorator(fn):
        if not callable(fn):
            raise TypeError(f"register {what} {name!r}: expected a function, got {type(fn).__name__}")
        if name in registry and registry[name] is not fn and not replace:
            raise ValueError(f"{what} {name!r} is already registered; pass replace=True to override it")
        registry[name] = fn
        choices.add(name)
        return fn

    return decorator
