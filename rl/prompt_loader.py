"""The order in which a run takes its prompt records: ``PromptLoader``, endless and checkpointable; ``build_data``
makes it, with the tokenizer, from a run config.

``PromptLoader`` shuffles with a fresh ``numpy.random.Generator`` seeded by ``(seed, epoch)`` each epoch
and keeps its position as ``{seed, epoch, index}`` (with the records' count and fingerprint, which a resume
must match). A batch that runs past the end of an epoch is
completed from the start of the next epoch's order, so nothing is skipped, and that order starts with prompts the
batch does not hold yet (`next_epoch_order`); restoring ``state_dict()``
continues with exactly the batches an uninterrupted run would have produced. A state saved with another seed is
refused: taking the saved seed instead would leave a config that names a seed the order does not follow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rl.data import PromptRecord


class PromptLoader:
    """Endless batches of prompts in a reshuffled order each epoch, with a checkpointable position.

    Epoch ``e``'s order is ``np.random.default_rng([seed, e]).permutation(len(records))``, its first slots
    rearranged where a batch spans the epochs (`next_epoch_order`); ``index`` is the next position in that order.
    ``next_batch()`` returns ``batch_size`` records, continuing into the next epoch's order when the current one
    runs out: each epoch draws every record once, and a batch holds distinct records unless it is larger than the
    records (`build_data` warns of that).
    """

    def __init__(self, records: Sequence[PromptRecord], batch_size: int, seed: int = 0):
        if len(records) == 0:
            raise ValueError("PromptLoader needs at least one record")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.records = list(records)
        self.fingerprint = records_fingerprint(self.records)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.index = 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def __len__(self) -> int:
        return len(self.records)

    @property
    def batches_per_epoch(self) -> float:
        return len(self.records) / self.batch_size

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            # Each order depends on the one before (its tail shares a batch with this one's head): continue from
            # the order in hand, or from epoch 0 after a restore (a pass over the records per epoch).
            ahead = self._order is not None and 0 <= self._order_epoch < self.epoch
            e, order = (self._order_epoch, self._order) if ahead else (0, self._shuffled(0))
            while e < self.epoch:
                e += 1
                order = next_epoch_order(order, self._shuffled(e), e * len(self.records) % self.batch_size,
                                         self.batch_size)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def _shuffled(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def next_indices(self) -> list[int]:
        """Dataset indices of the next batch (advances the position)."""
        out: list[int] = []
        n = len(self.records)
        while len(out) < self.batch_size:
            order = self._epoch_order()
            take = min(self.batch_size - len(out), n - self.index)
            out.extend(int(i) for i in order[self.index:self.index + take])
            self.index += take
            if self.index == n:
                self.epoch += 1
                self.index = 0
        return out

    def next_batch(self) -> list[PromptRecord]:
        return [self.records[i] for i in self.next_indices()]

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int | str]:
        """``{seed, epoch, index, num_records}`` (plain ints): the position after the last batch taken; and
        ``records``, the records' fingerprint (``records_fingerprint``)."""
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index, "num_records": len(self.records),
                "records": self.fingerprint}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in ("seed", "epoch", "index") if k not in state]
        if missing:
            raise ValueError(f"loader state is missing {missing}; expected keys seed, epoch, index")
        n = state.get("num_records")
        if n is not None and int(n) != len(self.records):
            raise ValueError(
                f"loader state was saved with {int(n)} records but this dataset has {len(self.records)}; "
                "resuming would not continue the same order")
        if int(state["seed"]) != self.seed:  # the order is the saved seed's: another one would not take effect
            raise ValueError(f"loader state was saved with shuffle seed {int(state['seed'])} (data.shuffle_seed) but "
                             f"this run's is {self.seed}; the prompts' order is the checkpoint's")
        saved = state.get("records")  # states saved before it was recorded continue on the count alone
        if saved is not None and saved != self.fingerprint:
            source = self.records[0].meta.get("source")
            raise ValueError(
                f"loader state was saved over other prompt records than this dataset's {len(self.records)}"
                + (f" from {source}" if source else "") + f" (the same count, other contents: fingerprint {saved} "
                f"there, {self.fingerprint} here); resuming would train on other prompts than the checkpoint's")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < len(self.records):
            raise ValueError(f"loader state out of range: epoch={epoch}, index={index} for {len(self.records)} records")
        self.epoch, self.index = epoch, index
        self._order_epoch = -1


def next_epoch_order(previous: np.ndarray, shuffled: np.ndarray, spanned: int, batch_size: int) -> np.ndarray:
    """The order of an epoch whose first batch also holds the last `spanned` records of the previous epoch's order:
    `shuffled` with the first batch_size - spanned records that batch does not hold yet moved to the front (each
    keeps its place among the rest). Without it, a prompt drawn at the end of one epoch and the start of the next
    was in one step twice (its groups weighed double): 82 of 200 steps with 30 prompts, 16 a step. Unchanged
    where no batch spans the epochs, or where the batch is larger than the records (repeats are then unavoidable).
    """
    n = len(shuffled)
    if spanned == 0 or batch_size > n:
        return shuffled
    first = shuffled[~np.isin(shuffled, previous[n - spanned:])][:batch_size - spanned]
    return np.concatenate([first, shuffled[~np.isin(shuffled, first)]])


def records_fingerprint(records: Sequence[PromptRecord]) -> str:
    """A short hash of the records in order (prompt, answer and their fields): a checkpoint's position is an index
    into them, so a file edited in place (same count) must not be continued as if it were the same. A record's
    `source` and `row` are left out: a moved file holds the same prompts."""
    h = hashlib.blake2b(digest_size=8)
    for r in records:
        meta = {k: v for k, v in r.meta.items() if k not in ("source", "row")}
        h.update(json.dumps([r.prompt, r.answer, meta], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def build_data(cfg):
    """(tokenizer, prompt loader, pad id) of a run config: the synthetic task's, or the model's tokenizer over a
    dataset, its prompts rendered and fitted to generation.max_prompt_tokens."""
    from rl.data import load_prompts
    from rl.model_tokenizer import load_tokenizer
    from rl.prompt_lengths import fit_prompt_lengths
    from rl.tasks import make_task
    d = cfg.data
    if d.kind == "synthetic":
        task = make_task(d.task, num_digits=d.num_digits, seed=d.shuffle_seed)
        tokenizer = task.tokenizer
        records = task.dataset(max(4096, cfg.grpo.prompts_per_step * 64))
    else:
        tokenizer = load_tokenizer(cfg.model.path)
        records = load_prompts(d.path, format=d.format, prompt_key=d.prompt_key, answer_key=d.answer_key,
                               layout=d.layout)
        records, ids = fit_prompt_lengths(records, tokenizer, cfg.generation.max_prompt_tokens,
                                          chat_template=d.chat_template, overlong=d.overlong_prompts,
                                          vocab_size=cfg.model.m3_config().vocab_size)
        # the ids checked here are the ones every draw generates from (PromptRecord.ids)
        records = [dataclasses.replace(r, ids=np.asarray(x, np.int32)) for r, x in zip(records, ids)]
    if len(records) < cfg.grpo.prompts_per_step:  # a batch then spans epochs: some prompts twice in one step
        logging.getLogger(__name__).warning(
            "%s holds %d prompt(s), fewer than grpo.prompts_per_step = %d: every step draws some of them more than "
            "once (their groups weigh double in the step's loss); a larger file or a smaller prompts_per_step "
            "draws each once a step", d.path, len(records), cfg.grpo.prompts_per_step)
    loader = PromptLoader(records, cfg.grpo.prompts_per_step, seed=d.shuffle_seed)
    return tokenizer, loader, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
