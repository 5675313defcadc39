"""A draw made on process 0 alone and shared with every process: one step off policy in a multi-host job.

In a multi-host run with the vLLM pool, process 0 owns the pool and scores the rewards; the other processes receive
what it got through collectives (rl.generation.multihost, rl.score_once). A draw ahead (rl.ahead) runs on a
background thread beside the train step, whose programs hold collectives too: were the draw's broadcasts issued
from that thread, the processes would issue the two threads' collectives in different orders (gloo stopped a
two-host run at the first overlap). So the draw ahead runs on process 0 alone, with no collective in it (its pool's
own generate, its own scoring), and is shared afterwards from the main thread, where every process is at the same
point: the start of the step that trains on it.

The other processes take the same prompts from their own loaders (every process's loader is at the same position),
so only what process 0 computed travels: the rollout, the rewards, and which groups dynamic sampling kept. A draw
that failed on process 0 is raised on every process.
"""

from __future__ import annotations

import pickle
from typing import Callable

import numpy as np

from rl.data import prompt_ids
from rl.generation import multihost
from rl.phases import Drawn, draw, samples_of
from rl.rewards.registry import score_specs


def ahead_draw(engine, loader, tokenizer, cfg, sampling, step: int) -> Callable[[], Drawn | None]:
    """What the background thread runs for step `step`'s draw: the whole draw on process 0 (its pool, its scoring,
    every round of dynamic sampling), nothing elsewhere (`share` takes the prompts from their loaders)."""
    if not engine.is_zero:
        return lambda: None
    return lambda: draw(engine.local(), loader, tokenizer, cfg, sampling, step, scorer=score_specs)


def take_shared(ahead, engine, loader, tokenizer, cfg, sampling) -> tuple[Drawn, int, float]:
    """`ahead.take()` on every process, process 0's draw shared: (the draw, its weight version, seconds waited).
    A collective: every process calls it at the same point of the step."""
    drawn, error, version, waited = None, None, None, 0.0
    try:
        drawn, version, waited = ahead.take()
    except Exception as e:  # noqa: BLE001 - raised on every process by share, once the others know
        error = e
    return share(drawn, engine, loader, tokenizer, cfg, sampling, error=error), version, waited


def _share_object(obj, is_zero: bool):
    """Process 0's picklable `obj` on every process (the others pass None): its size, then its bytes."""
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if is_zero else None
    size = int(np.asarray(multihost._from_zero(np.int64(data.size if is_zero else 0))))
    data = np.asarray(multihost._from_zero(data if is_zero else np.zeros(size, np.uint8)))
    return pickle.loads(data.tobytes())


def share(drawn: Drawn | None, engine, loader, tokenizer, cfg, sampling, *, error: BaseException | None = None
          ) -> Drawn:
    """Process 0's `drawn` (or the `error` that stopped its draw) on every process; the others pass None and draw
    the same prompts from `loader`, which ends where process 0's did."""
    is_zero, group = engine.is_zero, cfg.grpo.group_size
    header = None
    if is_zero:
        header = {"error": None if error is None else f"{type(error).__name__}: {error}"[:2000]}
        if error is None:
            header.update(rounds=drawn.rounds, picked=drawn.picked, failures=drawn.failures, metrics=drawn.metrics,
                          generate_s=drawn.generate_s, draw_s=drawn.draw_s, parts=sorted(drawn.parts),
                          width=int(drawn.samples.rollout.tokens.shape[1]))
    header = _share_object(header, is_zero)
    if header["error"] is not None:
        if is_zero:
            raise error
        raise RuntimeError(f"the draw ahead failed on process 0 ({header['error']}); its log has the traceback")
    if is_zero:
        records, prompts = drawn.samples.records, drawn.samples.rollout.prompt_ids
    else:
        batches = [loader.next_batch() for _ in range(header["rounds"])]
        picked = header["picked"] if header["picked"] is not None else [(0, i) for i in range(len(batches[0]))]
        records = [batches[r][i] for r, i in picked for _ in range(group)]
        prompts = [prompt_ids(rec, tokenizer, chat_template=cfg.data.chat_template) for rec in records]
    rollout = engine.share(drawn.samples.rollout if is_zero else None, prompts, header["width"])
    n = len(prompts)
    values = ((drawn.reward.astype(np.float32), {k: np.asarray(v, np.float32) for k, v in drawn.parts.items()})
              if is_zero else (np.zeros(n, np.float32), {k: np.zeros(n, np.float32) for k in header["parts"]}))
    reward, parts = multihost._from_zero(values)
    if is_zero:
        return drawn
    return Drawn(samples_of(rollout, records, tokenizer, sampling), np.asarray(reward),
                 header["failures"], header["metrics"], header["generate_s"],
                 {k: np.asarray(v) for k, v in parts.items()}, header["rounds"],
                 None if header["picked"] is None else np.asarray(header["picked"], np.int64), header["draw_s"])
