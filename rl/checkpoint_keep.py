"""Which checkpoints stay on disk (orbax's preservation policies): the `checkpoint.keep` newest and, with
`checkpoint.keep_best: k`, those of the k best held-out evaluations so far (`eval.best_metric`), however old.

Without it, the best policy of a long run was deleted `keep` saves later: the run remembered the best value and its
step, but not the weights. The trainer also saves each step whose evaluation enters the k best (`rl.trainer`), so
that each of them has a checkpoint to keep; one pushed out by a better one goes at the next save. (NeMo-RL's
`keep_top_k` by a validation metric, Hugging Face Trainer's `load_best_model_at_end`.)
"""

from __future__ import annotations

import argparse

BEST = "best"  # --step best: the best held-out evaluation's checkpoint


class KeepSteps:
    """An orbax PreservationPolicy keeping the checkpoints of `steps`, which the trainer sets to the k best
    evaluations' as they change. orbax asks it after each save, when it deletes what no policy keeps."""

    def __init__(self, steps=()):
        self.steps = frozenset(steps)

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        return [info.step in self.steps for info in checkpoints]


def preservation(keep: int, best: KeepSteps | None):
    """The `keep` newest, and `best`'s steps where there is such a policy."""
    import orbax.checkpoint as ocp  # here: the commands import this module to parse --step, before any heavy import
    latest = ocp.checkpoint_managers.LatestN(n=keep)
    return latest if best is None else ocp.checkpoint_managers.AnyPreservationPolicy(policies=[latest, best])


def step_argument(text: str) -> int | str:
    """argparse's type of `--step`: a step number, or "best"."""
    if text == BEST:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a step number or {BEST!r}") from None


def chosen_step(reader, step: int | str | None, doing: str = "") -> int | None:
    """The checkpoint step a reader (export, evaluation) should read, checked before any model is built: `step`
    (refused when it has no checkpoint), None for the newest, or "best" for the best of those the newest checkpoint
    ranks (`checkpoint.keep_best`'s first; else the best evaluation's step where it has a checkpoint). doing: the
    errors' words for what was asked (" to export")."""
    steps = reader.steps()
    if step == BEST:
        step = _best_step(reader, steps)
    if step is not None and step not in steps:
        raise FileNotFoundError(f"no checkpoint of step {step}{doing} in {reader.directory} (steps: "
                                f"{', '.join(map(str, steps)) or 'none'})")
    return step


def _best_step(reader, steps: list[int]) -> int:
    if not steps:
        raise FileNotFoundError(f"--step best: no checkpoint in {reader.directory}")
    meta = reader.read_meta(steps[-1])
    kept = [e["step"] for e in meta.get("kept_best") or [] if e["step"] in steps]
    best = meta.get("best")
    if kept:
        return kept[0]
    if best and best["step"] in steps:
        return best["step"]
    why = (f"its best evaluation, step {best['step']} ({best['metric']} {best['value']:.4g}), has no checkpoint"
           if best else "the run had evaluated nothing")
    raise FileNotFoundError(f"--step best: the newest checkpoint (step {steps[-1]} in {reader.directory}) names no "
                            f"checkpoint of the best evaluation: {why}; a run with checkpoint.keep_best >= 1 and "
                            "eval.every_steps > 0 keeps one")
