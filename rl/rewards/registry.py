"""Reward registry and time-limited batch scoring.

A reward is ``fn(completion_text: str, answer: str, **kw) -> float``. ``register_reward(name)`` files
it under a name (several names may share a function); ``get_reward(name)`` finds it again.

``score_batch`` evaluates weighted rewards over a batch. Each (sample, reward) evaluation that raises,
returns a non-float / non-finite value, or runs past ``timeout_s`` scores 0 and is counted in
``failures``; the call itself neither raises for them nor waits past the limits.

How a reward runs (its ``mode``, chosen at registration, overridable per call):

``"inline"``
    In the calling thread, no supervision beyond a stopwatch: an evaluation that took longer than
    ``timeout_s`` is still discarded (0, counted), but cannot be interrupted. For the built-in
    rewards whose run time is bounded by construction (linear scans: ``format``, the digit rewards);
    256 digit samples score in well under a millisecond.
``"thread"`` (the default for anything registered without a mode, and for bare callables)
    Samples run one after another in a worker thread ("lane"; ``num_workers`` lanes) while the caller
    watches the clock. A sample past its limit scores 0; its lane is abandoned (Python cannot kill a
    thread; it is a daemon that exits when its call returns) and a fresh lane carries on with the
    next sample, so the batch finishes in about ``timeout_s`` per hung sample. Overhead is one thread
    start per lane plus a queue hand-off per sample (a few microseconds), so this suits cheap and
    I/O-bound rewards (sleeping / waiting on a socket). Its limit: an abandoned CPU-bound reward keeps
    a core (and its memory) until it returns, and one stuck inside C code holds the GIL, which stalls
    the caller too.
``"process"``
    A persistent pool of worker processes (``forkserver`` start method, so it is safe next to JAX's
    threads; the server preloads ``rl.rewards`` and ``math_verify``) receives the samples in chunks
    and reports each result as it is done; a worker whose current sample passes ``timeout_s`` is
    killed and replaced, and the rest of its chunk goes to the next worker. This is the only mode that
    can stop a computation stuck inside C code (sympy / big-integer arithmetic) and free its memory,
    and it runs samples in parallel across cores. The pool starts once (about a second) and stays up;
    a worker's first import of a reward (and the reward's optional ``warmup()``) is not charged to
    any sample (bounded separately by ``LOAD_TIMEOUT_S``). Rewards must be picklable (module-level
    functions); others fall back to thread mode with a warning. ``math_verify`` uses this mode: in a
    worker's main thread math-verify's own ``signal.alarm`` timeouts work too, so most slow
    expressions end cleanly there and the kill is the backstop.
``"batch"``
    One call scores many samples: ``fn(completions, answers, **kw) -> Sequence[float]``, the per-sample
    keywords as lists (rl.rewards.batch). For a reward model or a judge behind a service that batches
    requests. ``timeout_s`` bounds the whole call; ``num_workers`` chunks of the batch are called at once.

Why not one mechanism for everything: measured on the 2-core machine, 256 digit-task samples score in
~0.7 ms inline, ~1.2 ms in a thread lane and ~4 ms through a warm process pool (plus ~1 s to start
it); a process per sample would cost several ms each. Threads cannot stop runaway sympy, and signal
timers (math-verify's own mechanism) work only in a main thread and in whole seconds, so they are used
where they work (inside pool workers, and ``math_verify`` called inline from the main thread) and
never relied on alone.

A reward function with a parameter named ``timeout_s`` receives the per-sample limit, so it can
bound its own work (``math_verify`` passes it on to math-verify). Likewise, one that names ``prompt`` receives the
sample's prompt as the dataset gave it (a string, or chat messages ``[{role, content}, ...]``) and one that names
``meta`` the prompt row's other fields (``PromptRecord.meta``: with ``source`` and ``row`` for a file's rows; only
the fields a ``meta_keys`` attribute of the function lists, where it has one), where
the caller has them (``score_specs``' ``records``): what a judge or a per-row rubric needs. They are passed by name
only, so a reward taking ``**kw`` is not sent a row it does not read (in process mode every keyword is pickled).

Layout: this module holds the registry and the batch API; rl.rewards.outcome evaluates one sample,
rl.rewards.runners runs the inline and thread modes (and dispatches), rl.rewards.pool the process pool;
the thread and process modes hand out samples and keep time with rl.schedule.ChunkQueue (as does the
vLLM pool with its rollout rows).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np

from rl.rewards.batch import batch_kwargs, run_batch
from rl.rewards.calls import BY_NAME_KEYWORDS, check_call, context_value, named_keywords
from rl.rewards.outcome import Outcome
from rl.rewards.pool import LOAD_TIMEOUT_S, shutdown_process_pool  # noqa: F401  (re-exported)
from rl.rewards.runners import run_reward

__all__ = [
    "RewardFn",
    "UnknownRewardError",
    "MODES",
    "register_reward",
    "score_specs",
    "get_reward",
    "args_problem",
    "own_args_problem",
    "list_rewards",
    "reward_mode",
    "reward_scores",
    "RewardScores",
    "score_components",
    "score_batch",
    "shutdown_process_pool",
]

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]
MODES = ("inline", "thread", "process", "batch")


@dataclasses.dataclass(frozen=True)
class _Entry:
    fn: RewardFn
    mode: str
    scores: tuple[float, float] | None  # the least and the most one sample can score; None: not declared


_REGISTRY: dict[str, _Entry] = {}


class UnknownRewardError(KeyError):
    """``get_reward`` with a name nobody registered; the message lists the registered names."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


def _ident(fn) -> tuple:
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))


def _same_function(old, new) -> bool:
    """Whether `new` is `old` again: the same object, or the same top-level definition (a module reloaded). A
    lambda or a function made by a factory shares its module and qualname with its siblings (`make(1.0)` and
    `make(100.0)`), so it is the same only with equal code and equal captured values."""
    if old is new:
        return True
    if _ident(old) != _ident(new):
        return False
    if "<" not in (getattr(new, "__qualname__", None) or "<"):  # not <lambda> nor <locals>: a module-level name
        return True
    if getattr(old, "__code__", None) != getattr(new, "__code__", None):
        return False
    cells = [tuple(c.cell_contents for c in getattr(f, "__closure__", None) or ()) for f in (old, new)]
    try:
        return bool(cells[0] == cells[1])
    except Exception:  # captured values that cannot be compared (arrays): not known to be the same
        return False


def register_reward(name: str, *, mode: str = "thread", replace: bool = False,
                    scores: tuple[float, float] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator: file ``fn`` under ``name`` and return it unchanged (stack it to give several names).

    ``mode`` is how ``score_batch`` runs it by default (``"inline"``, ``"thread"`` or ``"process"``,
    see the module docstring; ``"batch"``: one call scores many samples, rl.rewards.batch). ``scores``: (least,
    most) a sample can score, when the function knows (the built-ins: (0, 1)); a config's
    ``eval.correct_threshold`` that its weighted rewards can never reach, or never miss, is then refused at load.
    Registering a different function under a taken name raises unless ``replace=True`` (re-registering the same
    function, e.g. on module reload, is allowed; a factory's functions of other captured values are different).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if mode not in MODES:
        raise ValueError(f"reward mode must be one of {MODES}, got {mode!r}")
    if scores is not None:
        ok = isinstance(scores, (tuple, list)) and len(scores) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in scores)
        if not ok or scores[0] > scores[1]:
            raise ValueError(f"register_reward({name!r}, scores={scores!r}): expected (least, most), two finite "
                             "numbers with least <= most, or None")
        scores = (float(scores[0]), float(scores[1]))

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"register_reward({name!r}) expects a function, got {type(fn).__name__}")
        check_call(name, fn, mode)
        old = _REGISTRY.get(name)
        if old is not None and not replace and not _same_function(old.fn, fn):
            raise ValueError(
                f"reward {name!r} is already registered to {old.fn.__module__}.{old.fn.__qualname__}; "
                "pass replace=True to override it")
        _REGISTRY[name] = _Entry(fn, mode, scores)
        return fn

    return decorator


def args_problem(name: str, args: Mapping[str, Any], own: bool = True) -> str | None:
    """Why a run's call of reward `name` with config `args` (keywords added to every call) would fail, or None: a
    keyword the run passes itself, one the function does not take, a required one missing, or (own: also) what the
    function's own `check_args(args) -> str | None` attribute says (`own_args_problem`). Checked at config load, so
    that a typo fails there and not as a 0 on every sample."""
    fn = get_reward(name)
    taken = sorted(set(args) & {"truncated", *BY_NAME_KEYWORDS})
    if taken:
        return f"{', '.join(taken)} {'is' if len(taken) == 1 else 'are'} passed by the run itself, not by args"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind("completion", "answer", truncated=False, **{k: None for k in named_keywords(fn)}, **args)
    except TypeError as e:
        keywords = [k for k, p in list(sig.parameters.items())[2:]  # after completion and answer
                    if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                    and k not in ("truncated", *BY_NAME_KEYWORDS)]
        return f"{e}; its parameters for args: {', '.join(keywords) or '(none)'}"
    return own_args_problem(name, args) if own else None


def own_args_problem(name: str, args: Mapping[str, Any]) -> str | None:
    """What reward `name`'s own `check_args(args)` attribute says of `args` (rl.rewards.judge's url, template, API
    key variable), or None."""
    check = getattr(get_reward(name), "check_args", None)
    return check(dict(args)) if callable(check) else None


def _ensure_builtins() -> None:
    # The built-in rewards register themselves on import of rl.rewards; importing it here makes
    # get_reward work even when only this module was imported.
    import rl.rewards  # noqa: F401


def get_reward(name: str) -> RewardFn:
    """The function registered as ``name``; ``UnknownRewardError`` lists the known names otherwise."""
    _ensure_builtins()
    entry = _REGISTRY.get(name)
    if entry is None:
        raise UnknownRewardError(f"unknown reward {name!r}; registered rewards: {', '.join(sorted(_REGISTRY)) or '(none)'}")
    return entry.fn


def reward_scores(name: str) -> tuple[float, float] | None:
    """(least, most) one sample of reward ``name`` can score, as registered (``scores=``), or None."""
    get_reward(name)
    return _REGISTRY[name].scores


def list_rewards() -> list[str]:
    _ensure_builtins()
    return sorted(_REGISTRY)


def reward_mode(fn_or_name: str | RewardFn) -> str:
    """How ``score_batch`` runs this reward by default."""
    if isinstance(fn_or_name, str):
        get_reward(fn_or_name)
        return _REGISTRY[fn_or_name].mode
    for entry in _REGISTRY.values():
        if entry.fn is fn_or_name:
            return entry.mode
    return "thread"


# --------------------------------------------------------------------------------------------------
# Public batch API

RewardSpec = Union[str, RewardFn]


@dataclasses.dataclass
class RewardScores:
    """``total``: weighted sum per sample; ``components``: each reward's raw values (0 where failed);
    ``failures`` / ``timeouts``: failed evaluations per reward name; ``errors``: a few example reasons."""

    total: np.ndarray
    components: dict[str, np.ndarray]
    failures: dict[str, int]
    timeouts: dict[str, int]
    errors: dict[str, list[str]]

    @property
    def num_failures(self) -> int:
        return int(sum(self.failures.values()))


def _name_of(spec: RewardSpec) -> str:
    if isinstance(spec, str):
        return spec
    for name, entry in _REGISTRY.items():
        if entry.fn is spec:
            return name
    return getattr(spec, "__name__", repr(spec))


def _resolve(pairs, n_answers: int, n: int, sample_kwargs, sample_context, mode,
             timeout_s) -> list[tuple[str, RewardFn, float, str]]:
    """Check the arguments and resolve every reward to ``(name, fn, weight, mode)`` before anything
    runs, so that a typo in a name fails fast."""
    if n_answers != n:
        raise ValueError(f"{n} completions but {n_answers} answers")
    if sample_kwargs is not None and len(sample_kwargs) != n:
        raise ValueError(f"{n} completions but {len(sample_kwargs)} sample_kwargs")
    if sample_context is not None and len(sample_context) != n:
        raise ValueError(f"{n} completions but {len(sample_context)} sample_context")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} or None, got {mode!r}")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
    resolved = []
    for spec, weight in pairs:
        fn = get_reward(spec) if isinstance(spec, str) else spec
        if not callable(fn):
            raise TypeError(f"reward {spec!r} is not callable")
        registered = reward_mode(spec)
        if mode is not None and (mode == "batch") != (registered == "batch") and _registered(fn):
            # the two call forms take different arguments (one sample against lists of them)
            raise ValueError(f"reward {_name_of(spec)!r} is registered in {registered} mode and cannot run in mode "
                             f"{mode!r}; expected mode=None or one of the same call form")
        resolved.append((_name_of(spec), fn, float(weight), mode or registered))
    return resolved


def _registered(fn) -> bool:
    return any(entry.fn is fn for entry in _REGISTRY.values())


def _sample_kwargs(fn, n: int, sample_kwargs, sample_context, call_kwargs, timeout_s) -> list[dict[str, Any]]:
    """Per-sample keyword arguments for ``fn`` (a fresh dict each): ``call_kwargs`` and ``sample_kwargs``, plus
    ``timeout_s`` and those of ``sample_context`` (prompt, meta) that its signature names."""
    kws = [{**(call_kwargs or {}), **(sample_kwargs[i] if sample_kwargs is not None else {})} for i in range(n)]
    named = named_keywords(fn)
    for i, kw in enumerate(kws):
        if "timeout_s" in named and timeout_s is not None:
            kw.setdefault("timeout_s", timeout_s)
        if sample_context is not None:
            kw.update((k, context_value(fn, k, v)) for k, v in sample_context[i].items() if k in named)
    return kws


def score_components(
    reward_fns_with_weights: Sequence[tuple[RewardSpec, float]] | Mapping[RewardSpec, float],
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    timeout_s: float | None = 5.0,
    batch_timeout_s: float | None = None,
    sample_kwargs: Sequence[Mapping[str, Any]] | None = None,
    sample_context: Sequence[Mapping[str, Any]] | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
    mode: str | None = None,
    num_workers: int | None = None,
) -> RewardScores:
    """Like ``score_batch`` (same arguments) but with each reward's values, failures and example errors
    (for metrics)."""
    pairs = list(reward_fns_with_weights.items()) if isinstance(reward_fns_with_weights, Mapping) else list(reward_fns_with_weights)
    n = len(completions)
    resolved = _resolve(pairs, len(answers), n, sample_kwargs, sample_context, mode, timeout_s)

    items = [(str(c), str(a)) for c, a in zip(completions, answers)]
    deadline = None if batch_timeout_s is None else time.monotonic() + batch_timeout_s
    total = np.zeros(n, dtype=np.float64)
    scores = RewardScores(total=total, components={}, failures={}, timeouts={}, errors={})
    for name, fn, weight, how in resolved:
        out = Outcome(n)
        warmup = getattr(fn, "warmup", None)
        if n and how != "process" and callable(warmup):
            warmup()  # one-time imports, so that they do not count against the first sample's limit
        if how == "batch":
            per_sample, once = batch_kwargs(fn, n, sample_kwargs, sample_context, call_kwargs, timeout_s)
            if n:
                run_batch(fn, items, per_sample, once, timeout_s, deadline, num_workers or 1, out)
        else:
            kws = _sample_kwargs(fn, n, sample_kwargs, sample_context, call_kwargs, timeout_s)
            run_reward(fn, how, name, items, kws, timeout_s, deadline, num_workers, out)
        n_failed = int(out.failed.sum())
        if n_failed:
            logger.warning("reward %r: %d of %d evaluations failed (%d timed out), scored 0; e.g. %s",
                           name, n_failed, n, out.timeouts, "; ".join(out.errors))
        key = name if name not in scores.components else f"{name}#{len(scores.components)}"
        scores.components[key] = out.values.astype(np.float32)
        scores.failures[key] = n_failed
        scores.timeouts[key] = int(out.timeouts)
        scores.errors[key] = out.errors
        total += weight * out.values
    scores.total = total.astype(np.float32)
    return scores


def score_batch(reward_fns_with_weights, completions, answers, **options: Any) -> tuple[np.ndarray, int]:
    """Weighted rewards for a batch: ``(rewards float32 [n], failures)``; ``score_components`` with
    only the totals (it takes the same arguments and options).

    ``reward_fns_with_weights``: ``[(name_or_fn, weight), ...]`` or ``{name_or_fn: weight}``.
    ``rewards[i] = sum_k weight_k * reward_k(completions[i], answers[i], **sample_kwargs[i])``; an
    evaluation that raises, returns something that is not a finite float, or runs past ``timeout_s``
    (per sample and reward, default 5.0) contributes 0 and adds 1 to ``failures``. ``batch_timeout_s``
    bounds the whole call (unfinished evaluations then count as failures). ``mode`` overrides every
    reward's registered mode; ``num_workers``: lanes (thread mode, default 1), processes (process
    mode, default min(cores, 8)) or chunks called at once (batch mode, default 1). ``call_kwargs``: keywords of
    every call (a config entry's args), given once to a batch reward. ``sample_context``: per sample, keywords
    (``prompt``, ``meta``) given only to the rewards whose signature names them. Unknown reward names raise
    ``UnknownRewardError`` before anything runs.
    """
    s = score_components(reward_fns_with_weights, completions, answers, **options)
    return s.total, s.num_failures


def score_specs(specs, completions, answers, truncated,
                records=None) -> tuple[np.ndarray, int, dict[str, np.ndarray]]:
    """A run's configured rewards (`specs`: objects with name, weight, timeout_s and optionally workers and args,
    as `reward:` in a run config) over a batch: the weighted sum per sample (float32), the failed evaluations (scored
    0), and each reward's own values by name (unweighted). One call per reward: each has its own time limit. Each
    sample gets `truncated` (it hit the length limit) as a keyword, for rewards that read it, and the entry's `args`;
    with `records` (each sample's PromptRecord), the rewards that name them get its `prompt` and `meta`."""
    total, failures, parts = np.zeros(len(completions), np.float32), 0, {}
    context = None if records is None else [{"prompt": r.prompt, "meta": r.meta} for r in records]
    for spec in specs:
        s = score_components([(spec.name, spec.weight)], completions, answers, timeout_s=spec.timeout_s,
                             sample_kwargs=[{"truncated": bool(t)} for t in truncated], sample_context=context,
                             call_kwargs=dict(getattr(spec, "args", None) or {}),
                             num_workers=getattr(spec, "workers", 0) or None)
        total += s.total
        failures += s.num_failures
        parts[spec.name] = s.components[spec.name]
    return total, failures, parts


# score_batch takes exactly score_components' arguments; show them in help() and signature checks.
score_batch.__signature__ = inspect.signature(score_components).replace(return_annotation="tuple[np.ndarray, int]")
