"""Rewards: a registry of ``fn(completion_text, answer, **kw) -> float`` and time-limited batch scoring
(``prompt`` and ``meta``, the row's other fields, go to a reward that names them).

Built-in rewards (registered on import): ``math_verify`` (rl.rewards.math), ``code_tests`` / ``code_tests_frac``
(rl.rewards.code: the completion's program against the record's test cases), ``format``
(rl.rewards.format), ``judge`` (rl.rewards.judge: a model behind an OpenAI-compatible endpoint scores the
sample), ``reverse_digits`` / ``copy_digits`` / ``sort_digits`` / ``exact_digits``
(rl.rewards.synthetic). See rl.rewards.registry for how ``score_batch`` runs and time-limits them.
"""

from rl.rewards.registry import (
    MODES,
    RewardScores,
    UnknownRewardError,
    get_reward,
    list_rewards,
    register_reward,
    reward_mode,
    score_batch,
    score_components,
    shutdown_process_pool,
)
from rl.rewards import code, format, judge, math, synthetic  # noqa: E402,F401  (register the built-ins)

__all__ = [
    "MODES",
    "RewardScores",
    "UnknownRewardError",
    "get_reward",
    "list_rewards",
    "register_reward",
    "reward_mode",
    "score_batch",
    "score_components",
    "shutdown_process_pool",
]
