"""The call every run makes of a reward, checked against the reward's signature at registration
(rl.rewards.registry.register_reward)."""

from __future__ import annotations

import inspect

# Keywords a reward gets only where its signature names them (rl.rewards.registry's docstring says what each holds).
BY_NAME_KEYWORDS = ("timeout_s", "prompt", "meta")


def named_keywords(fn) -> frozenset:
    """Which of BY_NAME_KEYWORDS `fn`'s signature names (none for a builtin without a signature)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(k for k in BY_NAME_KEYWORDS if k in params)


def context_value(fn, key: str, value):
    """What `fn` gets for by-name keyword `key`: `value`, except that a function with a `meta_keys` attribute gets
    only those fields of `meta` (a process-mode reward's keywords are pickled per sample, and a code dataset's row
    may carry megabytes of reference solutions the reward never reads)."""
    keys = getattr(fn, "meta_keys", None)
    if key == "meta" and keys is not None and isinstance(value, dict):
        return {k: value[k] for k in keys if k in value}
    return value


def check_call(name: str, fn, mode: str) -> None:
    """Refuse, at registration, a reward that cannot take the call every run makes: fn(completion, answer,
    truncated=...) (in batch mode the same with lists), plus the by-name keywords it names. `def r(completion,
    answer)` used to fail on every sample of every step, each failure scored 0, and the run went on to its end with
    that reward silently 0."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: found out at its first call
        return
    # keyword-only parameters without a default come from the config entry's `args` (checked at load: args_problem)
    from_args = {k: None for k, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY and p.default is p.empty
                 and k not in ("truncated", *BY_NAME_KEYWORDS)}  # these the run passes itself
    try:
        sig.bind("completion", "answer", truncated=False, **{k: None for k in named_keywords(fn)}, **from_args)
    except TypeError as e:
        call, expected = (("fn(completions, answers, truncated=[...])", "fn(completions: list[str], "
                           "answers: list[str], **kw) -> list[float] (kw: truncated as a list") if mode == "batch" else
                          ("fn(completion, answer, truncated=...)", "fn(completion: str, answer: str, **kw) -> float "
                           "(kw: truncated"))
        positional = [k for k, p in sig.parameters.items()
                      if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty]
        for_args = [k for k in positional[2:] if k not in ("truncated", *BY_NAME_KEYWORDS)]
        hint = (f"; a parameter the config's args give must be keyword-only: def {getattr(fn, '__name__', 'fn')}"
                f"(completion, answer, *, {', '.join(for_args)}, ...)" if for_args else "")
        raise TypeError(f"reward {name!r}: {getattr(fn, '__qualname__', fn)}{sig} cannot be called as {call} ({e}), "
                        f"as a run calls every {mode}-mode reward; expected {expected}, and timeout_s, prompt or "
                        f"meta where the function names them){hint}") from None
