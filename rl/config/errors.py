"""How problems are reported: ConfigError (what callers catch) and _Problem (one problem, with its key)."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from rl.config.fields import _show


class ConfigError(ValueError):
    """An invalid run config. `problems` holds one line per problem; str() lists them all."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            msg = f"invalid run config: {self.problems[0]}"
        else:
            msg = f"invalid run config ({len(self.problems)} problems):\n" + "\n".join(
                f"  - {p}" for p in self.problems)
        super().__init__(msg)


@dataclasses.dataclass
class _Problem:
    key: str
    text: str
    also: tuple[str, ...] = ()  # other keys the problem involves (their sources are named too)


def _bad(key: str, value: Any, problem: str, allowed: str) -> _Problem:
    return _Problem(key, f"{key} = {_show(value)}: {problem}; allowed: {allowed}")


def _unknown(key: str, names: list[str], where: str) -> _Problem:
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return _Problem(key, f"{key}: unknown key{hint}; allowed keys in {where}: {', '.join(names)}")
