"""GRPO building blocks: group advantages and the clipped, importance-corrected policy loss.

Everything here is a pure JAX function (jit-able; `LossConfig` is a frozen, hashable dataclass and
can be a static argument). See `advantages` and `loss` for the formulas.
"""

from rl.grpo.advantages import (ADVANTAGE_ESTIMATORS, get_advantage_estimator, group_advantages, overlong_mask,
                                zero_variance_groups)
from rl.grpo.loss import LossConfig, generation_mismatch_metrics, grpo_loss, kl_estimate, normalizer

__all__ = [
    "ADVANTAGE_ESTIMATORS", "get_advantage_estimator", "group_advantages", "overlong_mask", "zero_variance_groups",
    "LossConfig", "generation_mismatch_metrics", "grpo_loss", "kl_estimate", "normalizer",
]
