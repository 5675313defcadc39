"""A merged mapping -> a validated RunConfig, each problem naming the file or override that set its key."""

from __future__ import annotations

import copy
import re
from typing import Any

from rl.config.errors import ConfigError, _bad, _Problem, _unknown
from rl.config.fields import _fields, _hints, _is_section, _item_type, _kind, _non_none
from rl.config.run import _DEFER, RunConfig
from rl.config.validate import _problems
from rl.config.yaml_io import as_dict


def _build(cls: type, data: Any, prefix: str, out: list[_Problem]) -> Any:
    """A mapping -> an instance of `cls`; unknown keys and non-mappings are reported and skipped."""
    fields = _fields(cls)
    where = prefix or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        out.append(_bad(prefix, data, f"wrong type ({_kind(data)})", "a mapping with keys " + ", ".join(fields)))
        data = {}
    hints = _hints(cls)
    kwargs = {}
    for k, v in data.items():
        name = str(k)
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            out.append(_unknown(key, list(fields), where))
            continue
        tp = _non_none(hints[name])
        item = _item_type(tp)
        if _is_section(tp):
            kwargs[name] = _build(tp, v, key, out)
        elif item is not None and _is_section(item) and isinstance(v, list):
            # a non-mapping item stays as it is: the validator reports it once, as a wrong type
            kwargs[name] = tuple(_build(item, x, f"{key}[{i}]", out) if isinstance(x, dict) or x is None else x
                                 for i, x in enumerate(v))
        else:
            kwargs[name] = copy.deepcopy(v)
    return cls(**kwargs)


def from_dict(tree: dict, *, sources: dict[str, str] | None = None) -> RunConfig:
    """A validated RunConfig from a (merged) mapping; ConfigError lists every problem, each with its source."""
    out: list[_Problem] = []
    _DEFER[0] = True
    try:
        cfg = _build(RunConfig, tree, "", out)
    finally:
        _DEFER[0] = False
    out += _problems(cfg)
    if out:
        raise ConfigError([_with_source(p, sources or {}) for p in out])
    return cfg


def defaults_dict() -> dict:
    """The dataclass defaults as a mapping (what configs/base.yaml restates)."""
    _DEFER[0] = True
    try:
        return as_dict(RunConfig())
    finally:
        _DEFER[0] = False


def _sources_of(key: str, sources: dict[str, str]) -> list[str]:
    """Who set `key`: the nearest enclosing key that a file or override set, else whoever set keys below it."""
    key = re.sub(r"\[\d+\]", "", key)
    parts = key.split(".") if key else []
    for n in range(len(parts), 0, -1):
        src = sources.get(".".join(parts[:n]))
        if src:
            return [src]
    if parts[:2] == ["model", "tiny"] and len(parts) > 2 and "model.tiny.preset" in sources:
        # a field no file or override set, filled in by the model preset (m3jax.presets): not a default
        return [f"the model preset named by {sources['model.tiny.preset']}"]
    return [s for k, s in sources.items() if key and k.startswith(key + ".")]


def _with_source(p: _Problem, sources: dict[str, str]) -> str:
    found: list[str] = []
    for key in (p.key, *p.also):
        for s in _sources_of(key, sources):
            if s not in found:
                found.append(s)
    if found:
        return f"{p.text} [set by {'; '.join(found)}]"
    return p.text + (" [default]" if p.key else "")
