"""What a declared config field is made of, and the words messages use for it.

Type introspection of the section dataclasses (`_hints`, `_union`, `_non_none`, `_item_type`, `_is`), the
display of values as the user would write them (`_show`, `_kind`, `_plain`), and the text of what a field
accepts (`_allowed`, built from the rules declared with `rl.config.schema._f`).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _union(tp: Any) -> tuple[bool, list[Any]]:
    """(None allowed, the other member types)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        return type(None) in args, [a for a in args if a is not type(None)]
    return False, [tp]


def _non_none(tp: Any) -> Any:
    members = _union(tp)[1]
    return members[0] if len(members) == 1 else tp


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _item_type(tp: Any) -> Any | None:
    tp = _non_none(tp)
    return typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else None


def _is(value: Any, tp: Any) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if typing.get_origin(tp) is dict or tp is dict:
        return isinstance(value, dict)
    if typing.get_origin(tp) is tuple:
        return isinstance(value, (tuple, list))
    return isinstance(value, tp)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _show(v: Any) -> str:
    """A value as the user would write it (JSON is YAML: null, true, "text", [1, 2])."""
    try:
        return json.dumps(_plain(v), ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(v)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def _range_text(rules: dict) -> str:
    lo = ("[", rules["min"]) if "min" in rules else ("(", rules["gt"]) if "gt" in rules else None
    hi = ("]", rules["max"]) if "max" in rules else (")", rules["lt"]) if "lt" in rules else None
    if lo and hi:
        return f" in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo:
        return f" {'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
    if hi:
        return f" {'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
    return ""


def _scalar_allowed(tp: Any, rules: dict) -> str:
    if rules.get("choices"):
        how = getattr(rules["choices"], "register_with", None)  # an OpenChoices: users add names of their own
        more = f", or a name registered with {how} before the config loads (your launcher's)" if how else ""
        return "one of " + ", ".join(_show(c) for c in rules["choices"]) + more
    if "pattern" in rules:
        return rules["pattern"][1]
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer" + _range_text(rules)
    if tp is float:
        return "a number" + _range_text(rules)
    if tp is str:
        return "a string"
    if _is_section(tp):
        return "a mapping with keys " + ", ".join(_fields(tp))
    return getattr(tp, "__name__", str(tp))


def _allowed(tp: Any, meta: dict) -> str:
    """What a field accepts, in words."""
    if "allowed" in meta:
        return meta["allowed"]
    optional, members = _union(tp)
    tp = members[0]
    item = _item_type(tp)
    if item is not None:
        n = meta.get("min_items", 0)
        text = "a non-empty list" if n == 1 else f"a list of at least {n} items" if n else "a list"
        if _is_section(item):
            text += " of mappings with keys " + ", ".join(_fields(item))
        else:
            text += f" whose items are each {_scalar_allowed(item, meta.get('items', {}))}"
        if meta.get("distinct"):
            text += ", without repeats"
    else:
        text = _scalar_allowed(tp, meta)
    return f"null or {text}" if optional else text
