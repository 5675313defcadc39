"""``format``: does the completion give one well-formed final answer?

1.0 when all of these hold, else 0.0:

- the completion was not cut off by the length limit (``truncated=True`` in the sample's kwargs, which
  the trainer passes when no EOS was sampled, gives 0);
- its answer part (`answer_scope`: after ``</think>`` where it thought first; a ``<think>`` never closed is no
  answer) contains exactly one ``\\boxed{...}`` (``\\fbox{`` counts as well), with balanced braces and
  non-empty content: the boxes a thinking model tries while it thinks are drafts, not a second answer.

Text after the box (a closing ``$`` or a sentence) is allowed. The scan is linear in the length of the
completion whatever it contains, so the reward runs inline.
"""

from __future__ import annotations

from rl.rewards.registry import register_reward

__all__ = ["boxed_format", "box_starts", "box_content", "closed_boxes", "answer_scope"]

_MARKERS = ("\\boxed{", "\\fbox{")
_THINK_START, _THINK_END = "<think>", "</think>"


def answer_scope(text: str) -> str | None:
    """The part of a completion that states its answer: after its last ``</think>`` where the model closed its
    thinking (a box it tried while thinking is not its answer); None where it began with ``<think>`` and never
    closed it (cut off while thinking: it has stated no answer); else the whole text (one that merely mentions the
    tag, a program printing it say, included)."""
    end = text.rfind(_THINK_END)
    if end >= 0:
        return text[end + len(_THINK_END):]
    return None if text.lstrip().startswith(_THINK_START) else text


def box_starts(text: str) -> list[int]:
    """Offsets of every ``\\boxed{`` / ``\\fbox{`` in ``text``, in order."""
    out = []
    for m in _MARKERS:
        i = text.find(m)
        while i >= 0:
            out.append(i)
            i = text.find(m, i + len(m))
    return sorted(out)


def box_content(text: str, start: int) -> str | None:
    """The content of the box starting at ``start`` (balanced braces), or None if it never closes. LaTeX's escaped
    braces ``\\{`` ``\\}`` (a set, ``\\left\\{``) are characters, not groups."""
    open_at = text.index("{", start)
    depth = 0
    escaped = False
    for j in range(open_at, len(text)):
        c = text[j]
        if escaped:  # the character after a backslash: \{, \}, or the second backslash of \\
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:j]
    return None


def closed_boxes(text: str) -> list[tuple[int, int, int]]:
    """(start, content start, content end) of every box of ``text`` that closes, ordered by start, by one pass over
    the text: `box_content` of each start rescans to the end of an unclosed box, quadratic on a completion of many
    (56 KB of ``\\boxed{`` took 24 s, an audit's), and slicing every nested box's content is quadratic too (a
    review's: 176 KB of nested boxes, 21 s and 710 MB). Braces pair as in `box_content` (escaped ones are
    characters)."""
    opens = {text.index("{", s): s for s in box_starts(text)}  # a box's opening brace -> the box's start
    stack, out, escaped = [], [], False
    for j, c in enumerate(text):
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "{":
            stack.append(j)
        elif c == "}" and stack:
            i = stack.pop()
            if i in opens:
                out.append((opens[i], i + 1, j))
    return sorted(out)


@register_reward("format", mode="inline", scores=(0, 1))
def boxed_format(completion: str, answer: str = "", *, truncated: bool = False) -> float:
    scope = answer_scope(completion)
    if truncated or scope is None:
        return 0.0
    starts = box_starts(scope)
    if len(starts) != 1:
        return 0.0
    content = box_content(scope, starts[0])
    return float(content is not None and bool(content.strip()))
