"""The rows of a prompt file: JSONL (one JSON object per line), JSON (one array of objects) or Parquet (needs
``pyarrow``), each with its 1-based row number (for JSONL, its line). What a row must hold is `rl.data`'s to check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np


class DatasetError(ValueError):
    """A prompt file that cannot be used: missing, unreadable, or a row without what is needed."""

    def __init__(self, path: str | os.PathLike, message: str, *, row: int | None = None):
        self.path = str(path)
        self.row = row
        where = self.path if row is None else f"{self.path}, row {row}"
        super().__init__(f"{where}: {message}")



FileFormat = Literal["auto", "jsonl", "json", "parquet"]
PROMPT_KEYS = ("prompt", "question", "problem")  # the prompt and answer fields rl.data detects, in its order
ANSWER_KEYS = ("reward_model.ground_truth", "answer", "ground_truth", "solution")

_EXT_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}


def _file_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        if fmt not in ("jsonl", "json", "parquet"):
            raise DatasetError(path, f"unknown format {fmt!r}; expected one of 'auto', 'jsonl', 'json', 'parquet'")
        return fmt
    ext = path.suffix.lower()
    if ext in _EXT_FORMATS:
        return _EXT_FORMATS[ext]
    raise DatasetError(
        path, f"cannot tell the file format from the extension {ext!r}; expected .jsonl, .json or .parquet, "
        "or set the format (data.format / eval.format: jsonl, json or parquet)"
    )


class _RepeatedKey(ValueError):
    """A key twice in one JSON object: json keeps the last value silently (an answer could be the wrong one)."""

    def __init__(self, key: str):
        super().__init__(f"the key {key!r} appears twice in one object (JSON would keep the last silently); "
                         "expected each key once")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    rows = []
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark (some Windows editors) is not a row
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue  # blank lines (a trailing newline, separators) are not rows
                text = line.rstrip("\r\n")  # else a line cut short is reported at "column 1" of the next
                try:
                    rows.append((lineno, json.loads(text, object_pairs_hook=_unique_keys)))
                except _RepeatedKey as e:
                    raise DatasetError(path, str(e), row=lineno) from None
                except json.JSONDecodeError as e:
                    where = "the line ends early" if e.pos >= len(text.rstrip()) else f"column {e.colno}"
                    raise DatasetError(path, f"invalid JSON ({e.msg}: {where}); expected one JSON object per line",
                                       row=lineno) from None
                except (ValueError, RecursionError) as e:  # json's limits: a huge integer, deep nesting
                    raise DatasetError(path, f"JSON that cannot be read ({_json_limit(e)}); expected one JSON "
                                             "object per line", row=lineno) from None
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e, "JSON lines", lines_are_rows=True) from None
    return rows


def _not_utf8(path: Path, error: UnicodeDecodeError, expected: str, *, lines_are_rows: bool) -> DatasetError:
    """The error naming the line of a JSON / JSONL file that is not UTF-8, and the byte in it (the row, for JSONL):
    the text reader's own offset counts from the chunk it was decoding (~8 KiB), not from the file, and names no
    line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                where = "" if lines_are_rows else f" of line {lineno}"
                return DatasetError(path, f"not UTF-8 text ({e.reason} at byte {e.start + 1}{where or ' of the line'})"
                                          f"; expected {expected} in UTF-8", row=lineno if lines_are_rows else None)
    return DatasetError(path, f"not UTF-8 text ({error.reason}); expected {expected} in UTF-8")


def _json_limit(e: Exception) -> str:
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return str(e).split(";")[0]  # "Exceeds the limit (4300 digits) for integer string conversion..."


def _read_json(path: Path) -> list[tuple[int, Any]]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            data = json.load(f, object_pairs_hook=_unique_keys)
    except _RepeatedKey as e:
        raise DatasetError(path, str(e)) from None
    except json.JSONDecodeError as e:
        # datasets' Dataset.to_json("x.json") writes JSON Lines: one object, then "Extra data" on line 2
        lines = (" (one JSON object a line, as datasets' to_json writes a .json: set data.format / eval.format: "
                 "jsonl)") if e.msg == "Extra data" and e.colno == 1 else ""
        raise DatasetError(path, f"invalid JSON ({e.msg} at line {e.lineno}, column {e.colno}){lines}") from None
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e, "JSON", lines_are_rows=False) from None
    except (ValueError, RecursionError) as e:
        raise DatasetError(path, f"JSON that cannot be read ({_json_limit(e)})") from None
    if isinstance(data, dict) and (held := _lone_record(data)):
        # a lone record, not a wrapper: its chat messages, or a list of examples it held, were read as the rows
        raise DatasetError(path, f"one JSON object with a prompt field ({held!r}): a single record; expected a "
                                 "JSON array of records ([{...}, ...]) or JSON Lines (one record a line, "
                                 "data.format / eval.format: jsonl)")
    if isinstance(data, dict):  # {"data": [...]} / {"rows": [...]} wrappers: exactly one list, of objects
        # (a lone record's {"tags": ["x"]} was unwrapped into a row "x")
        lists = [v for v in data.values() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
        if len(lists) != 1:
            keys = ", ".join(list(data)[:8]) + (", ..." if len(data) > 8 else "")
            held = f"{len(lists)} lists" if lists else "no list"
            lines = "" if lists else " (one record of JSON Lines? then set data.format / eval.format: jsonl)"
            raise DatasetError(path, f"a JSON object (keys {keys}) that holds {held} of objects; expected a JSON "
                                     "array of objects, or an object with exactly one such array (a {\"data\": "
                                     "[...]} wrapper)" + lines)
        data = lists[0]
    if not isinstance(data, list):
        raise DatasetError(path, f"expected a JSON array of objects, got a JSON {type(data).__name__}")
    return list(enumerate(data, start=1))


def _lone_record(data: dict) -> str | None:
    """The prompt field of an object that is one record rather than a {"data": [...]} wrapper: it has a prompt field
    that is its only list of objects (chat messages), or a prompt field and an answer field. A wrapper may carry a
    dataset-level prompt (a system prompt) beside its records."""
    lower = {str(k).lower(): k for k in data}
    prompt = next((lower[k] for k in PROMPT_KEYS if k in lower), None)
    if prompt is None:
        return None
    messages = isinstance(data[prompt], list) and data[prompt] and all(isinstance(m, dict) for m in data[prompt])
    answered = any(k.split(".")[0] in lower for k in ANSWER_KEYS)
    return prompt if messages or answered else None


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(path, "reading Parquet needs the 'pyarrow' package (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for corrupt or non-Parquet files
        raise DatasetError(path, f"not a readable Parquet file ({type(e).__name__}: {e})") from None
    rows = table.to_pylist()
    narrow = [f for f in table.schema if _has_float32(f.type)]
    for row in rows if narrow else ():
        for field in narrow:
            row[field.name] = _as_written(row[field.name], field.type)
    return list(enumerate(rows, start=1))


def _has_float32(t) -> bool:
    import pyarrow as pa
    if pa.types.is_float32(t):
        return True
    if pa.types.is_struct(t):
        return any(_has_float32(t.field(i).type) for i in range(t.num_fields))
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and _has_float32(t.value_type)


def _as_written(value, t):
    """A float32 cell as the number it was written as: to_pylist widens 123.456 to 123.45600128173828, which is
    then the answer's text (and math_verify scores a right \\boxed{123.456} 0)."""
    import pyarrow as pa
    if value is None:
        return None
    if pa.types.is_float32(t):
        return float(str(np.float32(value)))  # the shortest text that reads back as the same float32
    if pa.types.is_struct(t):
        return {k: _as_written(v, t.field(k).type) if t.get_field_index(k) >= 0 else v for k, v in value.items()}
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return [_as_written(v, t.value_type) for v in value]
    return value


def read_rows(path: Path, fmt: str) -> list[tuple[int, Any]]:
    """(1-based row number, parsed row) of every row of a JSONL, JSON or Parquet file; any problem is a DatasetError
    naming the file (and the row, where one is at fault)."""
    if not path.exists():
        raise DatasetError(path, "file not found")
    if not path.is_file():
        raise DatasetError(path, "not a regular file")
    kind = _file_format(path, fmt)
    try:
        if kind == "jsonl":
            return _read_jsonl(path)
        if kind == "json":
            return _read_json(path)
        return _read_parquet(path)
    except OSError as e:
        raise DatasetError(path, f"cannot read the file ({e.strerror or e})") from None
