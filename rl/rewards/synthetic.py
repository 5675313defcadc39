"""Rewards for the synthetic digit tasks (rl.tasks), grpo-reference.md §6.

The completion is the decoded sampled text (``DigitTokenizer.decode``): it is cut at the first
``<eos>`` and read back into tokens (specials such as ``<sep>`` count as one position each, so
decoding with ``skip_special_tokens=False`` scores exactly what was sampled). ``answer`` is the target
digit string.

- ``reverse_digits`` / ``copy_digits`` / ``sort_digits``: dense partial credit, the fraction of the
  answer's positions ``i`` where completion token ``i`` equals answer digit ``i`` (missing positions are
  wrong; anything after the answer's length is ignored). E.g. answer ``"4321"``: ``"4321"`` -> 1.0,
  ``"4300"`` -> 0.5, ``"43"`` -> 0.5, ``"1234"`` -> 0.0.
- ``exact_digits``: 1.0 if the completion (up to ``<eos>``) is exactly the answer, else 0.0 (the sparse
  reward of the ``addmod`` task).
"""

from __future__ import annotations

from rl.rewards.registry import register_reward
from rl.tasks import DigitTokenizer

__all__ = ["digit_positions", "exact_digits", "completion_tokens"]

_TOK = DigitTokenizer()
_EOS = DigitTokenizer.eos_token


def completion_tokens(text: str) -> list[int | None]:
    """Token ids of a decoded completion up to its first ``<eos>`` (unknown characters -> None)."""
    cut = text.find(_EOS)
    return _TOK.tokenize_text(text if cut < 0 else text[:cut], strict=False)


@register_reward("sort_digits", mode="inline", scores=(0, 1))
@register_reward("copy_digits", mode="inline", scores=(0, 1))
@register_reward("reverse_digits", mode="inline", scores=(0, 1))
def digit_positions(completion: str, answer: str, *, truncated: bool = False) -> float:
    """Fraction of answer positions the completion gets right (the tasks differ only in the answer)."""
    want = _TOK.tokenize_text(answer)
    if not want:
        raise ValueError("empty answer")
    got = completion_tokens(completion)
    return sum(1 for i, t in enumerate(want) if i < len(got) and got[i] == t) / len(want)


@register_reward("exact_digits", mode="inline", scores=(0, 1))
def exact_digits(completion: str, answer: str, *, truncated: bool = False) -> float:
    return float(completion_tokens(completion) == _TOK.tokenize_text(answer))
