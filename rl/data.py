"""Prompt datasets for GRPO: loading, validation, chat rendering and a checkpointable loader.

Files
-----
``load_prompts`` reads local JSONL (one JSON object per line), JSON (one array of objects) and Parquet
files (needs ``pyarrow``) and returns ``PromptRecord``s. Three record layouts are recognised:

===========  =======================================================  ===============================
layout       prompt                                                   answer
===========  =======================================================  ===============================
``dapo``     ``prompt``: list of chat messages ``{role, content}``    ``reward_model.ground_truth``
``gsm8k``    ``question``: string (or chat messages under ``prompt``  ``answer``; the text after the
             whose first ``answer`` ends on ``#### <number>``)         last ``####`` (commas removed;
                                                                      kept whole if it has none)
``plain``    ``prompt`` (or ``question`` / ``problem``): string or    ``answer`` (or ``ground_truth``,
             chat messages                                            ``solution``)
===========  =======================================================  ===============================

``prompt_key`` / ``answer_key`` override detection; dotted keys (``reward_model.ground_truth``) reach
into nested objects. Auto-detection looks at the first row (top-level keys matched case-insensitively,
so AIME's ``Problem`` / ``Answer`` columns work) and then every row must have those keys.

The whole file is read and validated inside ``load_prompts``: a bad file raises one ``DatasetError``
naming the file, the 1-based row (for JSONL: the line number) and what was expected, before a trainer
has touched any state. Numeric answers are converted to strings, lists and dicts (a code task's test cases,
`rl.rewards.code`) to JSON text.

Prompts
-------
``PromptRecord.prompt`` is either a string or a list of chat messages; ``render_prompt`` turns it into
token ids with the tokenizer's chat template when asked (``data.chat_template: true``) and the tokenizer has one
(``add_generation_prompt=True``), else with plain ``encode`` (messages are then joined by blank lines, which the
load-time check warns of when the tokenizer has a template). Synthetic tasks (``rl.tasks``) produce
records whose prompt is a plain string that their own tokenizer encodes, so the loader and the trainer
need no special case for them. `rl.prompt_lengths.fit_prompt_lengths` renders every record once at load and
refuses (or drops, ``data.overlong_prompts``) the prompts longer than the generation width.

The order in which a run takes the records is `rl.prompt_loader.PromptLoader`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np

from rl.prompt_rows import ANSWER_KEYS as _ANSWER_KEYS, PROMPT_KEYS as _PROMPT_KEYS, DatasetError, FileFormat, read_rows

__all__ = [
    "DatasetError",
    "PromptRecord",
    "load_prompts",
    "records_from_rows",
    "prompt_ids",
    "render_prompt",
]

Message = dict  # {"role": str, "content": str}
Prompt = Union[str, list[Message]]


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt: a string or chat messages, the reference answer (a string), and free-form metadata.

    ``meta`` holds the row's other fields plus ``source`` (the file) and ``row`` (1-based) when loaded
    from a file; synthetic tasks put their ``task`` name, ``reward`` name and ``prompt_ids`` there.
    ``ids``: the prompt's token ids as rendered once at load (`rl.prompt_loader.build_data`), which every draw
    reuses (`prompt_ids`): a chat template that writes today's date (Llama 3.2's) rendered other ids each day, so a
    run's prompts drifted from those checked at load, and hosts rendering either side of midnight differed. Not
    part of the record's identity (equality, fingerprints): they follow from the prompt and the tokenizer.
    """

    prompt: Prompt
    answer: str
    meta: dict = dataclasses.field(default_factory=dict)
    ids: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)


# --------------------------------------------------------------------------------------------------
# Keys and layouts (the rows themselves: rl.prompt_rows)

Layout = Literal["auto", "dapo", "gsm8k", "plain"]

_MISSING = object()


def _lookup(row: Mapping, dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; a literal key containing dots wins over the nested path."""
    if dotted in row:
        return row[dotted]
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _find_key(row: Mapping, candidates: Sequence[str]) -> str | None:
    lower = {k.lower(): k for k in row if isinstance(k, str)}
    for cand in candidates:
        if _lookup(row, cand) is not _MISSING:
            return cand
        top, _, rest = cand.partition(".")
        if top.lower() in lower and lower[top.lower()] != top:
            real = lower[top.lower()] + ("." + rest if rest else "")
            if _lookup(row, real) is not _MISSING:
                return real
    return None


def _detect(path: Path, first: Mapping, first_row: int, layout: str, prompt_key: str | None,
            answer_key: str | None) -> tuple[str, str, str]:
    """Choose (layout, prompt_key, answer_key) from the first row and the caller's overrides."""
    if layout not in ("auto", "dapo", "gsm8k", "plain"):
        raise DatasetError(path, f"unknown layout {layout!r}; expected 'auto', 'dapo', 'gsm8k' or 'plain'")
    defaults = {"dapo": ("prompt", "reward_model.ground_truth"), "gsm8k": ("question", "answer")}
    if layout in defaults:
        prompt_key = prompt_key or defaults[layout][0]
        answer_key = answer_key or defaults[layout][1]
    if prompt_key is None:
        prompt_key = _find_key(first, _PROMPT_KEYS)
        if prompt_key is None:
            raise DatasetError(
                path, f"no prompt field; expected one of {list(_PROMPT_KEYS)} (found keys {sorted(map(str, first))}); "
                "set data.prompt_key / eval.prompt_key (prompt_key= in Python) to choose one", row=first_row)
    if answer_key is None:
        answer_key = _find_key(first, _ANSWER_KEYS)
        if answer_key is None:
            raise DatasetError(
                path, f"no answer field; expected one of {list(_ANSWER_KEYS)} (found keys {sorted(map(str, first))}); "
                "set data.answer_key / eval.answer_key (answer_key= in Python) to choose one", row=first_row)
    if layout == "auto":
        if answer_key.lower() == "reward_model.ground_truth":
            layout = "dapo"
        elif answer_key.lower() == "answer" and (prompt_key.lower() == "question" or _is_gsm8k_solution(
                _lookup(first, answer_key))):  # GSM8K's answers under chat-message prompts (an audit: plain
            layout = "gsm8k"                  # layout took the whole solution for the reference, scored 0)
        else:
            layout = "plain"
    return layout, prompt_key, answer_key


_GSM8K_END = re.compile(r"\n####[ \t]*\$?-?\d[\d,]*(?:\.\d+)?\s*$")


def _is_gsm8k_solution(answer: Any) -> bool:
    """A worked solution that ends on GSM8K's ``#### <number>`` line (not a Markdown heading or a comment banner)."""
    return isinstance(answer, str) and _GSM8K_END.search(answer) is not None


def _gsm8k_final(text: str) -> str | None:
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "")


def _check_prompt(path: Path, row: int, key: str, value: Any) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(path, f"field {key!r} is an empty string; expected the prompt text", row=row)
        return value
    if isinstance(value, (list, tuple)):  # chat messages (Parquet gives lists of dicts, maybe numpy arrays)
        messages = []
        if not value:
            raise DatasetError(path, f"field {key!r} is an empty list; expected chat messages", row=row)
        for i, m in enumerate(value):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(
                    path, f"field {key!r} message {i}: expected an object with string 'role' and 'content', "
                    f"got {_short(m)}", row=row)
            messages.append({"role": m["role"], "content": m["content"]})
        if not any(m["content"].strip() for m in messages):  # a chat template would render roles around nothing
            raise DatasetError(path, f"field {key!r}: every message's content is empty; expected the prompt text",
                               row=row)
        return messages
    if isinstance(value, np.ndarray):
        return _check_prompt(path, row, key, value.tolist())
    raise DatasetError(path, f"field {key!r}: expected a string or a list of chat messages, got {_short(value)}", row=row)


def _check_answer(path: Path, row: int, key: str, value: Any, layout: str) -> str:
    if isinstance(value, np.ndarray):  # a parquet list column
        value = value.tolist()
    if isinstance(value, (list, tuple, dict)):  # structured answers (a code task's tests) travel as JSON text
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as e:
            raise DatasetError(path, f"field {key!r}: a structured answer that is not JSON ({e})", row=row) from None
    if isinstance(value, bool) or not isinstance(value, (str, int, float, np.integer, np.floating)):
        raise DatasetError(path, f"field {key!r}: expected a string, a number, or JSON-like lists / dicts (test "
                                 f"cases), got {_short(value)}", row=row)
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):  # JSON's NaN / Infinity
        raise DatasetError(path, f"field {key!r} is {value}; expected the reference answer (a string or a finite "
                                 "number)", row=row)
    # a float as written, never in exponent form: str(0.00001) is '1e-05', which math_verify reads as e - 5
    text = (np.format_float_positional(value, trim="-") if isinstance(value, (float, np.floating))
            else str(value)).strip()
    if layout == "gsm8k":
        final = _gsm8k_final(text)
        if final is not None:
            text = final
    if not text:
        raise DatasetError(path, f"field {key!r} is empty; expected the reference answer", row=row)
    return text


def _short(value: Any) -> str:
    s = repr(value)
    return f"{type(value).__name__} {s[:60] + '...' if len(s) > 60 else s}"


def records_from_rows(rows: Sequence[tuple[int, Any]] | Sequence[Mapping], *, source: str | os.PathLike = "<rows>",
                      layout: Layout = "auto", prompt_key: str | None = None,
                      answer_key: str | None = None) -> list[PromptRecord]:
    """Validate rows (dicts, or ``(row_number, dict)`` pairs) and turn them into ``PromptRecord``s."""
    path = Path(source)
    pairs = [r if isinstance(r, tuple) else (i, r) for i, r in enumerate(rows, start=1)]
    if not pairs:
        raise DatasetError(path, "no rows; expected at least one prompt")
    for rownum, row in pairs:
        if not isinstance(row, Mapping):
            raise DatasetError(path, f"expected a JSON object (a mapping of field names to values), got {_short(row)}", row=rownum)
    first_row, first = pairs[0]
    layout, prompt_key, answer_key = _detect(path, first, first_row, layout, prompt_key, answer_key)
    prompt_top = prompt_key if prompt_key in first else prompt_key.split(".")[0]
    out = []
    for rownum, row in pairs:
        prompt = _lookup(row, prompt_key)
        if prompt is _MISSING:
            raise DatasetError(path, f"missing field {prompt_key!r} (the prompt)", row=rownum)
        answer = _lookup(row, answer_key)
        if answer is _MISSING:
            raise DatasetError(path, f"missing field {answer_key!r} (the answer)", row=rownum)
        prompt = _check_prompt(path, rownum, prompt_key, prompt)
        answer_text = _check_answer(path, rownum, answer_key, answer, layout)
        meta = {k: v for k, v in row.items() if k != prompt_top}
        meta.update(source=str(path), row=rownum, layout=layout)
        out.append(PromptRecord(prompt=prompt, answer=answer_text, meta=meta))
    return out


def load_prompts(path: str | os.PathLike, *, format: FileFormat = "auto", prompt_key: str | None = None,
                 answer_key: str | None = None, layout: Layout = "auto") -> list[PromptRecord]:
    """Read and validate a whole prompt file (JSONL / JSON / Parquet) into ``PromptRecord``s.

    ``format`` is the file format (``"auto"``: from the extension). ``layout`` forces a record layout
    (``"dapo"``, ``"gsm8k"``, ``"plain"``; default: detected). ``prompt_key`` / ``answer_key`` (dotted
    for nested fields) override the detected fields. Raises ``DatasetError`` naming the file, the
    1-based row and what was expected.
    """
    path = Path(path)
    rows = read_rows(path, format)
    return records_from_rows(rows, source=path, layout=layout, prompt_key=prompt_key, answer_key=answer_key)


# --------------------------------------------------------------------------------------------------
# Rendering

def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def _as_id_list(out) -> list[int]:
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # BatchEncoding (transformers >= 5 default)
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        if len(out) != 1:
            raise ValueError(f"expected one token sequence, got {len(out)}")
        out = out[0]
    return [int(t) for t in out]


def prompt_ids(record: PromptRecord, tokenizer, *, chat_template: bool) -> list[int]:
    """The record's ids rendered at load where it has them, else `render_prompt`'s."""
    if record.ids is not None:
        return [int(t) for t in record.ids]
    return render_prompt(record, tokenizer, chat_template=chat_template)


def render_prompt(record: PromptRecord | Prompt, tokenizer, *, chat_template: bool = True) -> list[int]:
    """Token ids of a prompt, ready for generation.

    With ``chat_template=True`` and a tokenizer that has one, messages (a string prompt becomes one user
    message) go through ``tokenizer.apply_chat_template(..., add_generation_prompt=True, tokenize=True)``.
    Otherwise the text (messages' contents joined by blank lines) is ``tokenizer.encode``d with the
    tokenizer's own special tokens (BOS etc.), but for a text that already starts with the BOS token (a prompt a
    chat template rendered: a second BOS before it was a sequence the model was never tuned on).
    """
    prompt = record.prompt if isinstance(record, PromptRecord) else record
    if chat_template and has_chat_template(tokenizer):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return _as_id_list(out)
    text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
    bos = getattr(tokenizer, "bos_token", None)
    if isinstance(bos, str) and bos and text.startswith(bos):
        return _as_id_list(tokenizer.encode(text, add_special_tokens=False))
    return _as_id_list(tokenizer.encode(text))

