"""Which checkpoints stay on disk (orbax's preservation policies): the `checkpoint.keep` newest and, with
`checkpoint.keep_best`, the one of the best held-out evaluation so far (`eval.best_metric`), however old.

Without it, the best policy of a long run was deleted `keep` saves later: the run remembered the best value and its
step, but not the weights. The trainer also saves each step whose evaluation is a new best (`rl.trainer`), so
that the best step has a checkpoint to keep. (NeMo-RL's `keep_top_k` by a validation metric, Hugging Face
Trainer's `load_best_model_at_end`.)
"""

from __future__ import annotations

import orbax.checkpoint as ocp


class KeepStep:
    """An orbax PreservationPolicy keeping the checkpoint of `step` (None: none), which the trainer moves to each new
    best. orbax asks it after each save, when it deletes what no policy keeps."""

    def __init__(self, step: int | None = None):
        self.step = step

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        return [info.step == self.step for info in checkpoints]


def preservation(keep: int, best: KeepStep | None):
    """The `keep` newest, and `best`'s step where there is one."""
    latest = ocp.checkpoint_managers.LatestN(n=keep)
    return latest if best is None else ocp.checkpoint_managers.AnyPreservationPolicy(policies=[latest, best])
