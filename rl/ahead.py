"""One step off policy (`grpo.max_trajectory_age_steps: 1`): step n+1's draw runs while step n trains.

    step n:   [wait for draw n] [launch draw n+1 on the weights of version n] [rewards .. update n]
              [wait for draw n+1 to finish] [push weights n+1]

Draw n+1 (rollouts and rewards, every DAPO round) samples with the weights the generator holds when it
starts, the version step n trained from, so its trajectories are one step old when step n+1 trains on
them. The loss's importance correction already uses the generator's logprobs (`logp_gen`), which are
that version's. The weights are only pushed once the draw has finished: an engine never changes weights
in the middle of a draw.

The pipeline drains before every checkpoint and evaluation (those steps draw nothing ahead): a checkpoint
then holds exactly what an uninterrupted run would resume from, so a resumed run repeats the run bitwise,
and an evaluation never shares the generator with a draw. A save the checkpoint schedule did not foresee
(the `must_save_by` deadline, `max_wall_minutes`, a SIGTERM or SIGINT stop) saves the data position from before the draw in flight,
which is then dropped: the resumed run draws those prompts again, with newer weights.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable


class AheadDraw:
    """At most one draw in flight on a background thread (the generator and reward calls release the GIL
    or wait on other processes). `take` returns it; `settle` waits for it without taking it."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="m3jax-draw-ahead")
        self._future = None
        self.loader_state = None  # the data position before the draw in flight (what a checkpoint saves)
        self.version = None  # the weight version the draw in flight samples with

    @property
    def pending(self) -> bool:
        return self._future is not None

    def launch(self, draw: Callable, loader_state: dict, version: int) -> None:
        assert self._future is None, "one draw ahead at most"
        self.loader_state, self.version = loader_state, version
        self._future = self._pool.submit(draw)

    def settle(self) -> float:
        """Wait until the draw in flight has finished (its errors are raised by `take`); seconds waited."""
        t0 = time.perf_counter()
        if self._future is not None:
            concurrent.futures.wait([self._future])
        return time.perf_counter() - t0

    def take(self):
        """(the draw's result, its weight version, seconds waited for it)."""
        waited = self.settle()
        future, version = self._future, self.version
        self._future = self.loader_state = self.version = None
        return future.result(), version, waited

    def close(self) -> None:
        """Drop what is in flight (after it finishes: it uses the generator) and stop the thread."""
        self.settle()
        self._future = self.loader_state = self.version = None
        self._pool.shutdown(wait=True)


def draws_ahead(done: int, total_steps: int, checkpoint_every: int, evaluates: bool) -> bool:
    """Whether the step that ends with `done` steps done may launch the next draw: not after the last
    step, and not when a checkpoint (every `checkpoint_every` steps) or an evaluation (`evaluates`)
    follows it: the pipeline drains there."""
    if done >= total_steps or evaluates:
        return False
    return not (checkpoint_every and done % checkpoint_every == 0)
