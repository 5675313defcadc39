"""The checks of a `reward:` list (the run's, or `eval.reward`) against the reward registry, at config load."""

from __future__ import annotations

import difflib

import numpy as np

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
        from rl.rewards.registry import args_problem, own_args_problem
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
        elif (why := args_problem(n, spec.args, own=False)) is not None:
            out.append(_Problem(f"{key}.args", f"{key}.args = {_show(spec.args)}: reward {_show(n)} cannot be "
                                               f"called with them ({why}); allowed: its keyword parameters"))
        elif (why := own_args_problem(n, spec.args)) is not None:  # its own rules: the keywords are right
            out.append(_Problem(f"{key}.args", f"{key}.args = {_show(spec.args)}: reward {_show(n)} refuses them: "
                                               f"{why}"))
        if n in names[:i]:
            out.append(_Problem(f"{key}.name", f"{key}.name = {_show(n)}: listed twice; allowed: each reward once "
                                               "(combine weights)"))
    return out


def threshold_problems(specs, threshold: float, where: str) -> list[_Problem]:
    """`eval.correct_threshold` against what the weighted sum of `specs` (the rewards at config key `where`) can
    score, when every one of them registered its range (`register_reward(..., scores=)`): a threshold above the most
    they can sum to makes pass@k and maj@k 0 whatever the model does, one at or below the least makes them 1. A
    sample's score is sum_i w_i r_i with r_i in [lo_i, hi_i], so it lies in
    [sum_i min(w_i lo_i, w_i hi_i), sum_i max(w_i lo_i, w_i hi_i)], summed and compared in float32 as the run does."""
    try:
        from rl.rewards.registry import UnknownRewardError, reward_scores
    except ImportError:
        return []
    least = most = 0.0
    parts = []
    for spec in specs:
        try:
            scores = reward_scores(spec.name)
        except UnknownRewardError:  # reward_problems names it
            return []
        if scores is None:  # a reward of the user's that declared no range: nothing to judge by
            return []
        # float32 as the run sums (rl.rewards.registry.score_specs) and compares (a float32 reward >= the threshold):
        # in float64 weights 0.7 + 0.2 + 0.1 sum to 0.9999999999999999 and refused the threshold 1.0 a run reaches.
        ends = (np.float32(spec.weight * scores[0]), np.float32(spec.weight * scores[1]))
        least, most = np.float32(least + min(ends)), np.float32(most + max(ends))
        parts.append(f"{spec.name} {spec.weight:g} x [{scores[0]:g}, {scores[1]:g}]")
    if not parts:
        return []
    sums = f"the rewards of {where} ({', '.join(parts)}) score from {least:g} to {most:g}"
    if np.float32(threshold) > most:
        return [_Problem("eval.correct_threshold", (
            f"eval.correct_threshold = {_show(threshold)}: no sample can be correct, since {sums}; allowed: a "
            f"threshold in ({least:g}, {most:g}]"), (where,))]
    if np.float32(threshold) <= least:
        return [_Problem("eval.correct_threshold", (
            f"eval.correct_threshold = {_show(threshold)}: every sample would be correct, since {sums}; allowed: a "
            f"threshold in ({least:g}, {most:g}]"), (where,))]
    return []
