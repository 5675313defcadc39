"""The checks of a `reward:` list (the run's, or `eval.reward`) against the reward registry, at config load."""

from __future__ import annotations

import difflib

from rl.config.errors import _Problem
from rl.config.fields import _show


def _not_json(value, key: str) -> str | None:
    """`key = value: why` for the first part of `value` that is not a JSON value (string, number, boolean, null, list,
    mapping with string keys), or None. A run's config is recorded as JSON in every checkpoint, so YAML's other types
    (a date, !!binary, !!set) in a reward's args passed the checks and then stopped the trainer with a traceback."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return None
    if isinstance(value, (list, tuple)):
        return next((bad for i, v in enumerate(value) if (bad := _not_json(v, f"{key}[{i}]"))), None)
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{key} = {_show(value)}: its key {k!r} is not a string"
            if bad := _not_json(v, f"{key}.{k}"):
                return bad
        return None
    return f"{key} = {value!r}: a {type(value).__name__}"


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
        elif bad := _not_json(spec.args, f"{key}.args"):
            out.append(_Problem(f"{key}.args", f"{bad}, which the checkpoints' JSON record of the config cannot hold; "
                                               "allowed: strings, numbers, booleans, null, lists and mappings with "
                                               "string keys (quote a date: \"2024-01-01\")"))
        elif (why := args_problem(n, spec.args)) is not None:
            out.append(_Problem(f"{key}.args", f"{key}.args = {_show(spec.args)}: reward {_show(n)} cannot be "
                                               f"called with them ({why}); allowed: its keyword parameters"))
        if n in names[:i]:
            out.append(_Problem(f"{key}.name", f"{key}.name = {_show(n)}: listed twice; allowed: each reward once "
                                               "(combine weights)"))
    return out
