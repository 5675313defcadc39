"""Synthetic digit tasks for the tiny CPU demo (grpo-reference.md §6), with their own 16-token tokenizer.

Vocabulary (``vocab_size`` 16, nothing to download)::

    0..9  the digits "0".."9"
    10    <bos>     11  <sep>     12  <eos>     13  <pad>     14  "+"     15  "="

A prompt is ``[<bos>, d1 .. dn, <sep>]``; the policy should answer with n digits and ``<eos>``.

Records are ordinary ``rl.data.PromptRecord``s so the same ``PromptLoader`` / ``render_prompt`` path
serves the demo and real datasets: ``prompt`` is the digit string (``"3141"``), which
``DigitTokenizer.encode`` wraps in ``<bos> ... <sep>`` like a HF tokenizer adds its special tokens (it
has no chat template, so ``render_prompt`` uses ``encode``); ``answer`` is the target digit string;
``meta`` holds ``task``, ``reward`` (the registered reward name to score it with) and ``prompt_ids``.

Tasks: ``reverse`` (answer = digits reversed), ``copy``, ``sort`` (ascending) — all scored with dense
partial credit (fraction of positions right) — and ``addmod`` (prompt ``a+b``, answer ``(a+b) mod 10``,
exact match; the sparse-reward case of §6).

Held-out prompts: ``held_out(n, exclude)`` draws distinct prompts whose text is not in ``exclude`` (the
training records), so a run evaluates on prompts it never trains on while its training prompts stay
exactly those of ``dataset`` (a split of the string space by hash would change them, and with them a
demo's whole trajectory). Short strings run out: 4,096 training draws leave ~2/3 of the 10,000 4-digit
strings but ~16 of the 1,000 3-digit ones.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterable, Sequence

import numpy as np

from rl.data import PromptRecord

__all__ = [
    "DigitTokenizer",
    "DigitTask",
    "ReverseDigitsTask",
    "CopyDigitsTask",
    "SortDigitsTask",
    "AddModTask",
    "TASKS",
    "make_task",
]


# What `DigitTokenizer.decode` writes for an id past its vocabulary (Unicode's replacement character)
UNKNOWN = "\ufffd"


class DigitTokenizer:
    """A 16-token tokenizer with the parts of the HF tokenizer interface the trainer uses."""

    BOS, SEP, EOS, PAD, PLUS, EQUALS = 10, 11, 12, 13, 14, 15
    TOKENS = tuple(str(d) for d in range(10)) + ("<bos>", "<sep>", "<eos>", "<pad>", "+", "=")
    vocab_size = 16
    bos_token_id, sep_token_id, eos_token_id, pad_token_id = BOS, SEP, EOS, PAD
    bos_token, sep_token, eos_token, pad_token = "<bos>", "<sep>", "<eos>", "<pad>"
    all_special_ids = [BOS, SEP, EOS, PAD]
    chat_template = None  # render_prompt uses encode()
    padding_side = "left"

    _PIECE = re.compile(r"<bos>|<sep>|<eos>|<pad>|[0-9+=]|\s+|.", re.S)
    _IDS = {t: i for i, t in enumerate(TOKENS)}

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self._IDS)

    def tokenize_text(self, text: str, *, strict: bool = True) -> list[int | None]:
        """Token ids of ``text`` (whitespace ignored); an unknown character raises, or is ``None`` with strict=False."""
        out: list[int | None] = []
        for piece in self._PIECE.findall(text):
            if piece.isspace():
                continue
            tid = self._IDS.get(piece)
            if tid is None and strict:
                raise ValueError(f"DigitTokenizer: unknown character {piece!r} in {text!r}")
            out.append(tid)
        return out

    def encode(self, text: str, add_special_tokens: bool = True, **_: object) -> list[int]:
        """``"314"`` -> ``[<bos>, 3, 1, 4, <sep>]`` (without the wrapping when add_special_tokens=False)."""
        ids = self.tokenize_text(text)
        return [self.BOS, *ids, self.SEP] if add_special_tokens else ids  # type: ignore[list-item]

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, **_: object) -> dict:
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False, **_: object) -> str:
        """Ids -> text; specials appear as ``<eos>`` etc. unless skipped. An id past the task's vocabulary (a model
        whose vocabulary is larger, as model.tiny.vocab_size >= 16 or a checkpoint's allow, samples them) is
        ``UNKNOWN``, which every reward scores as wrong; a negative id raises."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError(f"DigitTokenizer.decode takes one sequence, got shape {arr.shape}; use batch_decode")
        ids = arr.tolist()
        skip = set(self.all_special_ids) if skip_special_tokens else ()
        parts = []
        for t in ids:
            if t < 0:
                raise ValueError(f"DigitTokenizer: negative token id {t}")
            if t >= self.vocab_size:
                parts.append(UNKNOWN)
            elif t not in skip:
                parts.append(self.TOKENS[t])
        return "".join(parts)

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False, **kw) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def convert_ids_to_tokens(self, ids: int | Iterable[int]):
        if isinstance(ids, (int, np.integer)):
            return self.TOKENS[int(ids)]
        return [self.TOKENS[int(i)] for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]):
        if isinstance(tokens, str):
            return self._IDS[tokens]
        return [self._IDS[t] for t in tokens]


class DigitTask(abc.ABC):
    """Base class: random digit strings -> ``PromptRecord``s; subclasses define ``target``."""

    name = "digits"
    reward = "reverse_digits"

    def __init__(self, num_digits: int = 4, seed: int = 0):
        if int(num_digits) < 1:
            raise ValueError(f"num_digits must be >= 1, got {num_digits}")
        self.num_digits = int(num_digits)
        self.seed = int(seed)
        self.tokenizer = DigitTokenizer()

    @abc.abstractmethod
    def target(self, digits: str) -> str:
        """The answer digit string for prompt digits."""

    def prompt_text(self, digits: str) -> str:
        return digits

    def make_record(self, digits: str) -> PromptRecord:
        prompt = self.prompt_text(digits)
        return PromptRecord(
            prompt=prompt,
            answer=self.target(digits),
            meta={"task": self.name, "reward": self.reward, "prompt_ids": self.tokenizer.encode(prompt)},
        )

    def sample_digits(self, n: int, rng: np.random.Generator) -> list[str]:
        draws = rng.integers(0, 10, size=(n, self.num_digits))
        return ["".join(map(str, row)) for row in draws]

    def dataset(self, size: int) -> list[PromptRecord]:
        """``size`` random prompts, the same for the same (seed, num_digits, size)."""
        rng = np.random.default_rng([self.seed, self.num_digits])
        return [self.make_record(d) for d in self.sample_digits(int(size), rng)]

    def held_out(self, size: int, exclude: Iterable[str]) -> list[PromptRecord]:
        """Up to ``size`` distinct prompts whose text is not in ``exclude``, drawn on a random stream of
        their own (the same for the same seed, num_digits, size and exclude); fewer only when no more exist (where
        the digit strings number a million or fewer: beyond, rounds that find nothing new stop it)."""
        excluded = set(exclude)
        rng = np.random.default_rng([self.seed, self.num_digits, 1])  # not dataset()'s stream
        picked: dict[str, None] = {}  # insertion-ordered set
        barren = 0  # consecutive rounds that found nothing new: every string is excluded or taken
        while len(picked) < size and barren < 8:
            before = len(picked)
            for d in self.sample_digits(max(int(size), 64), rng):
                if self.prompt_text(d) not in excluded and d not in picked:
                    picked[d] = None
                    if len(picked) == size:
                        break
            barren = barren + 1 if len(picked) == before else 0
        if len(picked) < size and 10 ** self.num_digits <= 10 ** 6:
            # the random rounds stopped while strings were left (13 of 1000 three-digit ones outside 4096 training
            # draws, 12 found): the rest of the space, in an order of the same stream
            for i in rng.permutation(10 ** self.num_digits):
                d = str(int(i)).zfill(self.num_digits)
                if self.prompt_text(d) not in excluded and d not in picked:
                    picked[d] = None
                    if len(picked) == size:
                        break
        return [self.make_record(d) for d in picked]

    def max_new_tokens(self) -> int:
        """Answer digits + <eos>."""
        return len(self.target("0" * self.num_digits)) + 1


class ReverseDigitsTask(DigitTask):
    name, reward = "reverse", "reverse_digits"

    def target(self, digits: str) -> str:
        return digits[::-1]


class CopyDigitsTask(DigitTask):
    name, reward = "copy", "copy_digits"

    def target(self, digits: str) -> str:
        return digits


class SortDigitsTask(DigitTask):
    name, reward = "sort", "sort_digits"

    def target(self, digits: str) -> str:
        return "".join(sorted(digits))


class AddModTask(DigitTask):
    """Prompt ``a+b`` (single digits), answer ``(a+b) mod 10``; ``num_digits`` is fixed at 2 operands."""

    name, reward = "addmod", "exact_digits"

    def __init__(self, num_digits: int = 2, seed: int = 0):
        super().__init__(2, seed)

    def prompt_text(self, digits: str) -> str:
        return f"{digits[0]}+{digits[1]}"

    def target(self, digits: str) -> str:
        return str((int(digits[0]) + int(digits[1])) % 10)


TASKS: dict[str, type[DigitTask]] = {
    cls.name: cls for cls in (ReverseDigitsTask, CopyDigitsTask, SortDigitsTask, AddModTask)
}


def make_task(name: str, **kwargs) -> DigitTask:
    """``make_task("reverse", num_digits=4, seed=0)``; unknown names list the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name](**kwargs)
