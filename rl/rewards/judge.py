"""``judge``: a reward given by a language model behind an OpenAI-compatible chat endpoint.

The endpoint is any server of ``POST {url}/chat/completions`` (vLLM's ``vllm serve``, SGLang, TGI, OpenAI). Each
sample is one request: the template, filled with the sample's prompt, completion and reference answer, is the
user message; the judge's reply must end with a line ``Score: N``, 0 <= N <= ``max_score``, and the reward is
``N / max_score``. A reply without a score, a score out of range, a reply cut at ``max_tokens``, an HTTP
error (a 429 or 5xx after ``retries`` more tries) or no reply within the reward's ``timeout_s`` is a failed
evaluation (scored 0, counted in ``reward/failures``), never a silent 0.

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
import time
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
# "Score: 1e9" are read whole and refused as out of range, not read as 3 and 1; "Subscore: 2" is not the score.
_SCORE = re.compile(r"(?<![a-z])score[^\w-]{0,4}[:=][^\w-]{0,4}(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", re.IGNORECASE)


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
    retries = args.get("retries", 2)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        return f"retries {retries!r} is not an integer >= 0"
    env = args.get("api_key_env")
    if env is not None and not (isinstance(env, str) and env in os.environ):
        return (f"api_key_env {env!r} names no variable of this environment; export {env} (the endpoint's key) "
                "in the shell that starts the run")
    return None


RETRIED = frozenset({429, 500, 502, 503, 504})  # a rate limit or a busy server: the same request may pass later


def _post_json(url: str, body: dict, headers: dict, timeout_s: float | None, retries: int) -> Any:
    """POST `body` as JSON; the server's JSON reply. All of it (connecting, reading, retrying) ends within
    `timeout_s` plus at most one socket wait: urlopen's timeout bounds each socket operation only, so a server
    sending a byte at a time held the request, and a thread lane of the pool, long past the reward's limit. An HTTP
    status in RETRIED or a refused connection is retried up to `retries` times, after 0.5, 1, 2 ... s (or the
    server's numeric Retry-After) where that fits before the deadline."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    data = json.dumps(body).encode()
    for attempt in range(retries + 1):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"judge server: no reply within {timeout_s} s ({attempt} tries)")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=left) as response:
                chunks = []
                while chunk := response.read1(1 << 16):  # one socket read at a time, so the clock is checked
                    chunks.append(chunk)
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"judge server: its reply took more than {timeout_s} s")
                return json.loads(b"".join(chunks))
        except urllib.error.HTTPError as e:  # the server's own reason (an unknown model, a context too long)
            problem = RuntimeError(f"judge server: HTTP {e.code}: {e.read()[:300]!r}")
            retry, after = e.code in RETRIED, e.headers.get("Retry-After") if e.headers else None
        except urllib.error.URLError as e:
            if not isinstance(e.reason, ConnectionRefusedError):
                raise
            problem, retry, after = RuntimeError(f"judge server: {url}: connection refused"), True, None
        wait = float(after) if after and after.strip().isdigit() else 0.5 * 2 ** attempt
        if not retry or attempt == retries or (deadline is not None and time.monotonic() + wait >= deadline):
            raise problem from None
        time.sleep(wait)
    raise AssertionError("unreachable")


def reply_text(reply: Any) -> str:
    """The text of a chat completion's first choice; its content may be a string or a list of parts (the text of
    each ``{"type": "text", "text": ...}`` part, joined). A reply the server cut at max_tokens is refused."""
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not a chat completion: {json.dumps(reply)[:300]}") from None
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if reply["choices"][0].get("finish_reason") == "length":  # a thinking judge's provisional "Score: 9" is no grade
        raise ValueError("the judge's reply was cut at max_tokens (finish_reason 'length') before its final score: "
                         f"raise the judge reward's max_tokens: {json.dumps(reply)[-300:]}")
    if not isinstance(content, str) or not content:
        raise ValueError(f"the judge's reply holds no text (a refusal or a tool call?): {json.dumps(reply)[:300]}")
    return content


@register_reward("judge", scores=(0, 1))
def judge(completion: str, answer: str, prompt: Any, *, url: str, model: str, template: str = DEFAULT_TEMPLATE,
          max_score: float = 10, max_tokens: int = 1024, temperature: float = 0.0, api_key_env: str | None = None,
          retries: int = 2, truncated: bool = False, timeout_s: float | None = None) -> float:
    """One chat request per sample; see the module docstring."""
    content = template.format(prompt=prompt_text(prompt), completion=completion, answer=answer, max_score=max_score)
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": temperature}
    headers = {"Content-Type": "application/json"}
    if api_key_env is not None:
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    reply = _post_json(url.rstrip("/") + "/chat/completions", body, headers, timeout_s, retries)
    return reply_score(reply_text(reply), max_score)


judge.check_args = _check_args
