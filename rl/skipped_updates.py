"""Updates skipped for a non-finite gradient (`sharding.train_step` keeps the weights and the optimizer's state).

One such update is harmless and was only counted (`skipped_updates` in metrics.jsonl). A diverged run (a learning
rate too high, a batch that overflows every time) skips every update from then on: its weights no longer change,
its loss reads nan, and it used to train on to its last step and print "done". Now each step with a skipped update
is a warning, and `optim.stop_after_skipped_steps` steps in a row whose updates were all skipped stop the run with
an error (Megatron-LM stops at a non-finite loss by default).

An update with no learning signal is held the same way: none of its tokens carries loss (every row at loss weight 0:
the groups dynamic sampling filled in after its last round, every response cut under `grpo.overlong_filter`), or its
gradient is exactly 0 (every group's rewards equal, with no KL or entropy term). Its gradient is 0, yet Adam's
momentum and the weight decay would move the weights: a warning of its own (at the first step of a run of such
steps, then every 100th), `empty_updates` in metrics.jsonl, and no count toward the stop, as nothing diverged.
"""

from __future__ import annotations

import logging

log = logging.getLogger("rl.trainer")


HELD_EVERY = 100  # steps in a row with a held update between two warnings of them


class UpdatesSkipped(Exception):
    """The run stops: its updates were all skipped for `optim.stop_after_skipped_steps` steps in a row."""


class SkippedUpdates:
    def __init__(self, limit: int, updates_per_step: int):
        self.limit, self.updates_per_step = limit, updates_per_step
        self.in_a_row = 0  # steps whose updates were all skipped, up to the last one seen
        self.held_in_a_row = 0  # steps with an update held for want of a learning signal, up to the last one seen

    def after(self, step: int, skipped: int, loss: float, grad_norm: float, empty: int = 0) -> None:
        """Step `step` (as metrics.jsonl numbers it) skipped `skipped` of its updates for a non-finite gradient and
        held `empty` for want of a learning signal; raises UpdatesSkipped at the limit."""
        self.held_in_a_row = self.held_in_a_row + 1 if empty else 0
        # the first of a run of them, then every HELD_EVERY-th: a saturated run (every group's rewards equal) holds
        # most of its updates, and a line each step buried the others (a soak run: 9 in 10 steps)
        if empty and (self.held_in_a_row == 1 or self.held_in_a_row % HELD_EVERY == 0):
            row = f" ({self.held_in_a_row} steps in a row; `empty_updates` counts each)" if self.held_in_a_row > 1 \
                else ""
            log.warning("step %d: %d of %d update(s) held, with no learning signal (no token of theirs carrying loss: "
                        "every row at loss weight 0, groups of equal rewards that dynamic sampling filled in or "
                        "responses grpo.overlong_filter dropped; or a gradient of exactly 0: every group's rewards "
                        "equal, with no KL or entropy term): the weights did not change%s", step, empty,
                        self.updates_per_step, row)
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row = self.in_a_row + 1 if skipped >= self.updates_per_step else 0
        row = f" ({self.in_a_row} steps in a row)" if self.in_a_row > 1 else ""
        log.warning("step %d: %d of %d update(s) skipped, the gradient not finite (loss %.4g, gradient norm %.4g): "
                    "the weights did not change%s", step, skipped, self.updates_per_step, loss, grad_norm, row)
        if self.limit and self.in_a_row >= self.limit:
            first = step - self.in_a_row + 1
            raise UpdatesSkipped(
                f"the updates of steps {first} to {step} were all skipped, their gradients not finite "
                f"(optim.stop_after_skipped_steps = {self.limit}): the run has diverged (or every batch overflows), "
                f"and its weights have not changed since step {first - 1}; the run stops. Lower optim.lr or check "
                "the data and rewards, and start again from a checkpoint before the divergence")
