"""``judge``: a reward given by a language model behind an OpenAI-compatible chat endpoint.

The endpoint is any server of ``POST {url}/chat/completions`` (vLLM's ``vllm serve``, SGLang, TGI, OpenAI). Each
sample is one request: the template, filled with the sample's prompt, completion and reference answer, is the
user message; the judge's reply must end with a line ``Score: N``, 0 <= N <= ``max_score``, and the reward is
``N / max_score``. A reply without a score, a score out of range, an HTTP error or no reply within the reward's
``timeout_s`` is a failed evaluation (scored 0, counted in ``reward/failures``), never a silent 0.

Configured like every reward, its keywords under ``args``::

    reward:
      - {name: judge, weight: 1.0, timeout_s: 60, workers: 16,
         args: {url: "http://judge-host:8000/v1", model: Qwen/Qwen3-32B}}

The API key, where the server wants one, is read from the environment variable ``api_key_env`` names: the config
is recorded in every checkpoint and config.yaml, a key in it would be too. Thread mode: a sample waits on the
network, not on a core, so ``workers`` lanes keep that many requests in flight.
"""

from __future__ import annotations

import json
import math
import os
import re
import string
import urllib.error
import urllib.request
from typing import Any

from rl.rewards.registry import register_reward

DEFAULT_TEMPLATE = (
    "You are grading a response to a task.\n\n"
    "Task:\n{prompt}\n\n"
    "Reference answer:\n{answer}\n\n"
    "Response:\n{completion}\n\n"
    "Judge whether the response answers the task correctly, using the reference answer. Explain briefly, then end "
    "your reply with a line 'Score: N', where N is an integer from 0 (wrong) to {max_score} (fully correct).")
FIELDS = ("prompt", "completion", "answer", "max_score")
# the last "Score: N" of the reply ("**Score:** 7", "score = 7.5" too): a judge that reasons first may name
# scores on the way. The filler around ':' excludes '-' and the number takes an exponent, so that "Score: -3" and
# "Score: 1e9" are read whole and refused as out of range, not read as 3 and 1.
_SCORE = re.compile(r"score[^\w-]{0,4}[:=][^\w-]{0,4}(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", re.IGNORECASE)


def prompt_text(prompt: Any) -> str:
    """The prompt as the judge reads it: a string as it is; chat messages one ``role: content`` paragraph each."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return "\n\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                           for m in prompt)
    return str(prompt)


def reply_score(reply: str, max_score: float) -> float:
    """``N / max_score`` of the reply's last ``Score: N``; ValueError (quoting the reply's end) without one, or
    with N outside [0, max_score]."""
    found = _SCORE.findall(reply)
    if not found:
        raise ValueError(f"the judge's reply has no 'Score: N' line: ...{reply[-160:]!r}")
    score = float(found[-1])
    if not 0 <= score <= max_score:
        raise ValueError(f"the judge's score {found[-1]} is outside [0, {max_score}]")
    return score / max_score


def _check_args(args: dict) -> str | None:
    """What `args` would make fail on every sample, named at config load (called by registry.args_problem)."""
    url = args.get("url")
    if not isinstance(url, str) or not re.match(r"https?://[^/]", url):
        return f"url {url!r} is not an http(s) URL of an OpenAI-compatible API (e.g. http://host:8000/v1)"
    if not isinstance(args.get("model"), str) or not args["model"]:
        return f"model {args.get('model')!r} is not the name of the judge model the server serves"
    template = args.get("template", DEFAULT_TEMPLATE)
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except (ValueError, TypeError) as e:
        return f"template cannot be filled ({e}); write a literal brace as {{{{ or }}}}"
    unknown, missing = sorted(used - set(FIELDS)), {"prompt", "completion"} - used
    if unknown:
        return f"template names {unknown}; it may name {list(FIELDS)} (a literal brace is written {{{{ or }}}})"
    if missing:
        return f"template does not name {sorted(missing)}: the judge would not see what it grades"
    max_score = args.get("max_score", 10)
    # finite: N / inf graded every reply 0, a silent 0 and not a failure
    if isinstance(max_score, bool) or not isinstance(max_score, (int, float)) or not 0 < max_score < math.inf:
        return f"max_score {max_score!r} is not a finite number > 0"
    try:  # a format spec or conversion (`{prompt:d}`, `{answer!x}`) fails only when filled: every sample would
        template.format(prompt="", completion="", answer="", max_score=max_score)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        return f"template cannot be filled ({type(e).__name__}: {e})"
    max_tokens = args.get("max_tokens", 1024)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        return f"max_tokens {max_tokens!r} is not an integer >= 1"
    temperature = args.get("temperature", 0.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        return f"temperature {temperature!r} is not a finite number >= 0"
    env = args.get("api_key_env")
    if env is not None and not (isinstance(env, str) and env in os.environ):
        return f"api_key_env {env!r} names no variable of this environment"
    return None


@register_reward("judge")
def judge(completion: str, answer: str, prompt: Any, *, url: str, model: str, template: str = DEFAULT_TEMPLATE,
          max_score: float = 10, max_tokens: int = 1024, temperature: float = 0.0, api_key_env: str | None = None,
          truncated: bool = False, timeout_s: float | None = None) -> float:
    """One chat request per sample; see the module docstring."""
    content = template.format(prompt=prompt_text(prompt), completion=completion, answer=answer, max_score=max_score)
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": temperature}
    headers = {"Content-Type": "application/json"}
    if api_key_env is not None:
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    request = urllib.request.Request(url.rstrip("/") + "/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            reply = json.load(response)
    except urllib.error.HTTPError as e:  # the server's own reason (an unknown model, a context too long)
        raise RuntimeError(f"judge server: HTTP {e.code}: {e.read()[:300]!r}") from None
    try:
        text = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not a chat completion: {json.dumps(reply)[:300]}") from None
    return reply_score(text or "", max_score)


judge.check_args = _check_args
