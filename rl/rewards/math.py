"""``math_verify``: is the completion's final answer mathematically equal to the reference?

Uses Hugging Face's ``math-verify`` (``parse`` + ``verify``):

- gold: the reference answer wrapped as ``\\boxed{answer}`` (unless it already holds a box) and
  parsed as LaTeX, so ``0.5``, ``1/2`` and ``\\frac{1}{2}`` all work, a number with unit words (``2 eggs``) as
  the number (`gold_text`); parsed golds are cached. A gold
  that does not parse raises (the sample is counted as a failure: a data problem, not a wrong answer).
- prediction: the answer the completion ends on (`extract_final_answer`): after its ``</think>`` where it
  thought first, whichever of its last ``\\boxed{...}``, its last ``Answer: ...`` line (DAPO-Math's requested
  format) and its last ``#### ...`` line (GSM8K's) comes last; a box tried while thinking, or before a final
  ``Answer:`` line, is not the answer (an audit: DAPO-style completions scored by an earlier box). Stating none,
  math-verify's own extraction over that part (its last LaTeX or plain expression), but not for a completion cut
  off by the length limit (``truncated``) or one that never closed its ``<think>``: those score 0, since the last
  number such a text happens to hold is no answer.
- both: a closing full stop and LaTeX spaces between thousands (``1\\,000``) are dropped (`tidy_answer`).
- comparison: ``verify(gold, pred)`` over every parsed form pair; 1.0 if any matches.

Time limits. math-verify bounds each ``parse`` and comparison with ``signal.alarm`` (whole seconds;
main thread only; with ``timeout=None`` it runs unbounded). This reward passes each call the
remaining part of its own ``timeout_s`` (rounded up to a second) when it runs in a main thread — in a
``score_batch`` process-pool worker, or inline from the main thread when no other ``SIGALRM`` timer is
pending (math-verify's ``alarm(0)`` would cancel it) — and ``None`` otherwise, where the caller's
watchdog must bound it. In thread mode that watchdog can only abandon the thread: a runaway sympy
evaluation (``\boxed{2^{2^{2^{30}}}}``) then keeps a core and grows memory until it ends, and while it is
inside C it holds the GIL; so use the default process mode for untrusted completions. A math-verify timeout raises out of this function so that
``score_batch`` counts it (math-verify would otherwise log it and return "wrong"). Registered with
mode ``"process"``: a computation stuck in C (which no signal interrupts) is then ended by killing the
worker.
"""

from __future__ import annotations

import json
import math
import re
import signal
import threading
import time
from collections import OrderedDict

from rl.rewards.format import answer_scope, closed_boxes
from rl.rewards.registry import register_reward

__all__ = ["math_verify_reward", "extract_final_answer", "answer_scope"]

# The answer runs from the line's first non-space to its last: a lazy (.+?) before [ \t]*$ retried the trailing run
# at every character, quadratic on a long line of spaces (a 16k-character one took 3.8 s, unbounded in the trainer's
# eval.majority_answer: boxed). [^\S\n]* also ends a CRLF line.
_ANSWER_LINE = re.compile(r"^[ \t*#_]*answer[ \t*_]*:[ \t*]*(\S(?:.*\S)?)[^\S\n]*$", re.IGNORECASE | re.MULTILINE)
# A sentence's full stop after the answer (\boxed{5.}, a reference "12."): math-verify read "5." as no number. Only
# one stop after a digit, letter or closing bracket: "1, 2, \ldots" and "..." keep theirs.
_FULL_STOP = re.compile(r"(?<=[0-9A-Za-z})\]])\.\s*$")
# Thousands separated by a LaTeX space (1\,000, 1\ 000, 1~000); 1{,}000 is left alone: a decimal comma too.
_DIGIT_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\[,;:! ]|~)(?=\d{3}(?!\d))")
# GSM8K's final line, "#### 72": a number, so a Markdown heading ("#### Verification") is not one (a review)
_GSM8K_LINE = re.compile(r"^[ \t]*####[ \t]*(\$?-?\d[\d,]*(?:\.\d+)?)\.?[^\S\n]*$", re.MULTILINE)
# A reference of a number and plain words after it ("2 eggs", "18 dollars"): math-verify read the words as symbols
# (2*E*g*g*s) that no prediction equals, so every sample scored 0 and no failure was counted (an audit). Words are
# units there and the number is the answer, unless one of them is a connective, a function or a multiplier ("2 and 3",
# "2 pi", "5 million").
_NUMBER_AND_WORDS = re.compile(r"^\s*([-+]?\d[\d,]*(?:\.\d+)?)((?:\s+[A-Za-z]{2,})+)\.?\s*$")
_NOT_UNITS = frozenset({"and", "or", "to", "of", "times", "plus", "minus", "over", "pi", "inf", "infinity", "sqrt",
                        "ln", "log", "exp", "sin", "cos", "tan", "mod", "dozen", "hundred", "thousand", "million",
                        "billion", "trillion"})
_GOLD_CACHE: OrderedDict[str, list] = OrderedDict()
_GOLD_CACHE_SIZE = 4096


def tidy_answer(latex: str) -> str:
    """An answer's text as math-verify reads it: a closing full stop and spaces between thousands dropped."""
    return _DIGIT_GROUP_SPACE.sub("", _FULL_STOP.sub("", latex.strip()))


def _line_answer(match: re.Match) -> str | None:
    # '$5$.' is 5 (stripping $ then '.' left '5$'); the end is trimmed by hand, since an end-anchored
    # [\s$.]+$ is retried at every character of a long run of spaces (quadratic, as the line's pattern was)
    ans = re.sub(r"^[\s$]+", "", match.group(1))
    end = len(ans)
    while end and (ans[end - 1].isspace() or ans[end - 1] in "$."):
        end -= 1
    return ans[:end] or None


def extract_final_answer(text: str) -> str | None:
    """The answer a completion ends on, in its `answer_scope`: whichever of its last non-empty ``\\boxed{}``
    (`tidy_answer`), its last ``Answer:`` line (DAPO-Math's requested format) and its last ``#### x`` line (GSM8K's)
    comes last (``$`` and a final ``.`` stripped from a line's); None where it states none. Linear in the text."""
    scope = answer_scope(text)
    return None if scope is None else _stated_answer(scope)


def _stated_answer(scope: str) -> str | None:
    """`extract_final_answer` of an answer part already cut out (`answer_scope`)."""
    stated = []
    for start, begin, end in reversed(closed_boxes(scope)):  # the last non-empty one, sliced alone
        if scope[begin:end].strip():
            stated.append((start, tidy_answer(scope[begin:end])))
            break
    for pattern in (_ANSWER_LINE, _GSM8K_LINE):
        line = None
        for line in pattern.finditer(scope):
            pass
        if line is not None and (ans := _line_answer(line)) is not None:
            stated.append((line.start(), ans))
    return max(stated)[1] if stated else None


class _Budget:
    """Per-call timeouts for math-verify out of one per-sample allowance."""

    def __init__(self, timeout_s: float | None):
        # signal.alarm only works in the main thread, and would cancel a timer the caller set itself
        usable = (timeout_s is not None and hasattr(signal, "SIGALRM")
                  and threading.current_thread() is threading.main_thread()
                  and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
        self.deadline = time.monotonic() + timeout_s if usable else None

    def next(self) -> int | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("math_verify: per-sample time limit used up")
        return max(1, math.ceil(left))


def _mv():
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # Off-main-thread calls pass timeout=None on purpose (the caller bounds them); silence the
    # one-time "timeout is disabled" warning that would otherwise suggest a misconfiguration.
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    return math_verify


def gold_text(answer: str) -> str:
    """An answer as math-verify reads it (the reference's, and a prediction's): `tidy_answer`'s, and a number
    followed by unit words the number ("Answer: 18 dollars" against 18 read 18*d*o*l*l*a*r*s: a review)."""
    units = _NUMBER_AND_WORDS.match(answer)
    if units and not {w.lower() for w in units.group(2).split()} & _NOT_UNITS:
        return units.group(1)
    return tidy_answer(answer)


def _gold(answer: str, budget: _Budget) -> list:
    hit = _GOLD_CACHE.get(answer)
    if hit is not None:
        _GOLD_CACHE.move_to_end(answer)
        return hit
    mv = _mv()
    text = answer if "\\boxed" in answer else "\\boxed{" + gold_text(answer) + "}"
    gold = mv.parse(text, extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=budget.next(),
                    raise_on_error=True)
    if not gold:
        gold = mv.parse(answer, parsing_timeout=budget.next(), raise_on_error=True)
    if not gold:
        raise ValueError(f"math_verify: cannot parse the reference answer {answer[:100]!r}")
    _GOLD_CACHE[answer] = gold
    if len(_GOLD_CACHE) > _GOLD_CACHE_SIZE:
        _GOLD_CACHE.popitem(last=False)
    return gold


@register_reward("math_verify", mode="process", scores=(0, 1))
def math_verify_reward(completion: str, answer: str, *, timeout_s: float | None = 5.0,
                       truncated: bool = False) -> float:
    from math_verify.errors import TimeoutException

    mv = _mv()
    budget = _Budget(timeout_s)
    gold = _gold(answer, budget)
    scope = answer_scope(completion)
    final = None if scope is None else _stated_answer(scope)
    if final is not None:
        pred = mv.parse("\\boxed{" + gold_text(final) + "}", parsing_timeout=budget.next(), raise_on_error=True)
    elif scope is None or truncated:  # cut off while thinking, or before it stated an answer: the last number it
        return 0.0                     # happened to write is not one (DeepScaleR's and verl's graders give 0)
    else:
        pred = mv.parse(scope, parsing_timeout=budget.next(), raise_on_error=True)
    if not pred:
        return 0.0
    timed_out = False
    for g in gold:
        for p in pred:
            try:
                if mv.verify(g, p, timeout_seconds=budget.next(), raise_on_error=True):
                    return 1.0
            except TimeoutException:
                timed_out = True  # another form may still match cheaply; report only if none does
            except Exception:
                pass  # this pair of forms cannot be compared (sympy refuses); try the others
    if timed_out:
        raise TimeoutError("math_verify: comparison timed out")
    return 0.0


math_verify_reward.warmup = _mv  # score_batch / pool workers import math-verify before timing samples


def check_reference_answer(answer: str, meta: dict | None = None) -> str | None:
    """Why math_verify cannot take `answer` as one reference, or None: a JSON object, or a JSON list of more than one
    item holding texts (several accepted answers, as a dataset's list became JSON text at load: '["3", "three"]'
    scored 0 for \\boxed{3}, every sample, no failure counted). A list of numbers ([0, 1], an interval) and a
    one-item list compare as usual. Checked for every row as its file loads (rl.answer_checks)."""
    if not answer.startswith(("[", "{")):
        return None
    try:
        value = json.loads(answer)
    except ValueError:  # LaTeX, not JSON: [0, 1), {1, 2}
        return None
    if isinstance(value, dict):
        return f"math_verify: the answer is a JSON object ({answer[:80]!r}); expected one reference answer"
    if isinstance(value, list) and len(value) > 1 and any(isinstance(v, str) for v in value):
        return (f"math_verify: the answer is a list of {len(value)} items ({answer[:80]!r}), several accepted "
                "answers?; expected one reference answer, the form math_verify compares a response with")
    return None


math_verify_reward.check_answer = check_reference_answer
