"""Which checkpoints stay on disk (orbax's preservation policies): the `checkpoint.keep` newest and, with
`checkpoint.keep_best: k`, those of the k best held-out evaluations so far (`eval.best_metric`), however old.

Without it, the best policy of a long run was deleted `keep` saves later: the run remembered the best value and its
step, but not the weights. The trainer also saves each step whose evaluation enters the k best (`rl.trainer`), so
that each of them has a checkpoint to keep; one pushed out by a better one goes at the next save. (NeMo-RL's
`keep_top_k` by a validation metric, Hugging Face Trainer's `load_best_model_at_end`.)
"""

from __future__ import annotations

import orbax.checkpoint as ocp


class KeepSteps:
    """An orbax PreservationPolicy keeping the checkpoints of `steps`, which the trainer sets to the k best
    evaluations' as they change. orbax asks it after each save, when it deletes what no policy keeps."""

    def __init__(self, steps=()):
        self.steps = frozenset(steps)

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        return [info.step in self.steps for info in checkpoints]


def preservation(keep: int, best: KeepSteps | None):
    """The `keep` newest, and `best`'s steps where there is such a policy."""
    latest = ocp.checkpoint_managers.LatestN(n=keep)
    return latest if best is None else ocp.checkpoint_managers.AnyPreservationPolicy(policies=[latest, best])
