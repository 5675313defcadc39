"""The checks of a `reward:` list (the run's, or `eval.reward`) against the reward registry, at config load."""

from __future__ import annotations

import difflib

from rl.config.errors import _Problem
from rl.config.fields import _show


def reward_problems(specs, where: str) -> list[_Problem]:
    """Each entry of `specs` (at config key `where`: "reward" or "eval.reward") must name a registered reward, once,
    and its `args` must fit that function's parameters. Skipped when rl.rewards cannot be imported."""
    try:
        from rl.rewards import list_rewards
        from rl.rewards.registry import args_problem
    except ImportError:
        return []
    registered = sorted(list_rewards())
    names = [r.name for r in specs]
    out = []
    for i, (n, spec) in enumerate(zip(names, specs)):
        key = f"{where}[{i}]"
        if n not in registered:
            close = difflib.get_close_matches(n, registered, n=1)
            hint = f" (did you mean {_show(close[0])}?)" if close else ""
            out.append(_Problem(f"{key}.name", (
                f"{key}.name = {_show(n)}: no reward is registered under this name{hint}; allowed: one of "
                f"{', '.join(_show(r) for r in registered)} (register custom rewards with "
                "rl.rewards.register_reward before loading the config)")))
        elif (why := args_problem(n, spec.args)) is not None:
            out.append(_Problem(f"{key}.args", f"{key}.args = {_show(spec.args)}: reward {_show(n)} cannot be "
                                               f"called with them ({why}); allowed: its keyword parameters"))
        if n in names[:i]:
            out.append(_Problem(f"{key}.name", f"{key}.name = {_show(n)}: listed twice; allowed: each reward once "
                                               "(combine weights)"))
    return out
