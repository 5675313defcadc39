"""GRPO building blocks: group advantages, the policy objectives, the importance correction, the KL
penalty and the loss that puts them together.

Everything here is a pure JAX function (jit-able; `LossConfig` is a frozen, hashable dataclass and
can be a static argument). See `advantages`, `objectives`, `importance`, `kl` and `loss` for the formulas.
"""

from rl.grpo.advantages import (ADVANTAGE_ESTIMATORS, get_advantage_estimator, group_advantages, overlong_mask,
                                zero_variance_groups)
from rl.grpo.kl import kl_penalty
from rl.grpo.loss import LossConfig, generation_mismatch_metrics, grpo_loss, kl_estimate, normalizer
from rl.grpo.objectives import POLICY_LOSSES, get_policy_loss
from rl.grpo.registry import register_advantage_estimator, register_policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS", "get_advantage_estimator", "group_advantages", "overlong_mask", "zero_variance_groups",
    "LossConfig", "generation_mismatch_metrics", "grpo_loss", "kl_estimate", "kl_penalty", "normalizer",
    "POLICY_LOSSES", "get_policy_loss", "register_advantage_estimator", "register_policy_loss",
]
