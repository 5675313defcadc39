"""Each reward's own rules for a record's answer, applied to every record of a prompt file as it loads.

A reward may carry a `check_answer(answer, meta) -> str | None` attribute (the code rewards do: their answer is a
test spec): None where the answer is one it can score, else what is wrong. Without the check, a file whose answer
field held something else (KodCode's `solution`, the reference program, picked before its `test`) trained for its
whole length with every sample failing and a warning each step; now the start is refused, naming the row."""

from __future__ import annotations

from collections.abc import Sequence

from rl.data import DatasetError, PromptRecord
from rl.rewards.calls import context_value
from rl.rewards.registry import get_reward


def check_answers(records: Sequence[PromptRecord], reward_names: Sequence[str], path: str, answer_setting: str) -> None:
    """Raise one DatasetError at the first record whose answer a reward of `reward_names` refuses. `answer_setting`:
    the config key that chooses the answer field (data.answer_key, eval.answer_key), named in the error."""
    for name in dict.fromkeys(reward_names):
        fn = get_reward(name)
        check = getattr(fn, "check_answer", None)
        if not callable(check):
            continue
        for record in records:
            problem = check(record.answer, context_value(fn, "meta", dict(record.meta)))
            if problem:
                raise DatasetError(path, f"reward {name!r} cannot score against this row's answer: {problem} (the "
                                         f"answer's field is detected, or chosen by {answer_setting})",
                                   row=record.meta.get("row"))
