"""The order in which a run takes its prompt records: ``PromptLoader``, endless and checkpointable; ``build_data``
makes it, with the tokenizer, from a run config.

``PromptLoader`` shuffles with a fresh ``numpy.random.Generator`` seeded by ``(seed, epoch)`` each epoch
and keeps its position as ``{seed, epoch, index}`` (with the records' count and fingerprint, which a resume
must match). A batch that runs past the end of an epoch is
completed from the start of the next epoch's order, so nothing is skipped, and that order starts with prompts the
batch does not hold yet (`next_epoch_order`); the position also keeps what that batch held of the previous epoch
(``head``), so restoring ``state_dict()`` continues with exactly the batches an uninterrupted run would have produced,
also where the resumed run draws another ``grpo.prompts_per_step``. A state saved with another seed is
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
        # The current epoch's `next_epoch_order` arguments: what the batch that spanned into it held of the previous
        # epoch, and that batch's size. They follow the batch size the run drew with then, which a resume may change
        # (rebuilt from epoch 0 with the new size, the order of the epoch under way was another one: a prompt drawn
        # twice in it and another never).
        self.head: list[int] = []
        self.head_batch = self.batch_size
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def __len__(self) -> int:
        return len(self.records)

    @property
    def batches_per_epoch(self) -> float:
        return len(self.records) / self.batch_size

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = next_epoch_order(np.asarray(self.head, np.int64), self._shuffled(self.epoch),
                                           len(self.head), self.head_batch)
            self._order_epoch = self.epoch
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
                # a batch left unfinished spans into the next epoch, whose order starts with records it lacks
                self.head, self.head_batch = (list(out) if len(out) < self.batch_size else []), self.batch_size
        return out

    def next_batch(self) -> list[PromptRecord]:
        return [self.records[i] for i in self.next_indices()]

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """``{seed, epoch, index, num_records}`` (plain ints): the position after the last batch taken; ``head`` and
        ``head_batch``, what the batch that spanned into this epoch held of the one before and its size (the epoch's
        order follows them); and ``records``, the records' fingerprint (``records_fingerprint``)."""
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index, "num_records": len(self.records),
                "head": list(self.head), "head_batch": self.head_batch, "records": self.fingerprint}

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
        head, head_batch = state.get("head"), state.get("head_batch")
        if head is None:  # saved before the head was recorded: every batch had this run's size, or the order differs
            head, head_batch = _head_of_constant_batches(self, epoch), self.batch_size
        n = len(self.records)
        if (not isinstance(head_batch, int) or head_batch < 1 or not isinstance(head, list)
                or not all(isinstance(i, int) and 0 <= i < n for i in head)):
            raise ValueError(f"loader state's head {head!r} / head_batch {head_batch!r} is not a list of record "
                             f"indices below {n} and a batch size >= 1")
        self.epoch, self.index = epoch, index
        self.head, self.head_batch = [int(i) for i in head], int(head_batch)
        self._order_epoch = -1


def _head_of_constant_batches(loader: PromptLoader, epoch: int) -> list[int]:
    """The head of `epoch` for a state saved before heads were (`PromptLoader.head`): the records of epoch - 1's order
    that the batch spanning into it held, every batch of `loader.batch_size` (a pass over the orders so far)."""
    n, size = len(loader.records), loader.batch_size
    order, head = loader._shuffled(0), []
    for e in range(1, epoch + 1):
        spanned = e * n % size
        previous, head = order, ([int(i) for i in order[n - spanned:]] if spanned and size <= n else [])
        order = next_epoch_order(previous, loader._shuffled(e), spanned, size)
    return head


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
    first = shuffled[~np.isin(shuffled, previous[len(previous) - spanned:])][:batch_size - spanned]
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
    from rl.answer_checks import check_answers
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
        check_answers(records, [spec.name for spec in cfg.reward], d.path, "data.answer_key")
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
