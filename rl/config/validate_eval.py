"""The cross-field rules of the `eval` section (`rl.config.validate` runs them with the others).

They apply when training evaluates (`eval.every_steps > 0` or `eval.at_start`), so that a run with a file
dataset and the default (synthetic) eval section stays valid; `python -m m3jax.eval` asks for them
with `enabled=True`.
"""

from __future__ import annotations

import dataclasses

from rl.config.errors import _Problem
from rl.config.reward_checks import reward_problems, threshold_problems
from rl.config.fields import _show
from rl.config.schema import TASK_REWARDS

# Checks take the whole `rl.config.run.RunConfig` (named in annotations only: that module imports this one).


def synthetic_lengths(task: str, num_digits: int) -> tuple[int, int]:
    """(prompt tokens, answer tokens with <eos>) of a digit task: <bos> digits [+] <sep> / answer <eos>."""
    digits = 2 if task == "addmod" else num_digits
    prompt = digits + 2 + (1 if task == "addmod" else 0)
    answer = (1 if task == "addmod" else num_digits) + 1
    return prompt, answer


def eval_lengths(cfg) -> tuple[int, int]:
    """(prompt pad width, response limit) of the evaluation: its own, else the run's generation limits."""
    e, g = cfg.eval, cfg.generation
    return e.max_prompt_tokens or g.max_prompt_tokens, e.max_new_tokens or g.max_new_tokens


def eval_problems(cfg, enabled: bool | None = None) -> list[_Problem]:
    """Problems of the eval section in the context of the run (none when evaluation is off)."""
    e, d = cfg.eval, cfg.data
    if not (e.enabled if enabled is None else enabled):
        return []
    out: list[_Problem] = []
    if e.kind == "file" and e.path is None:
        out.append(_Problem("eval.path", "eval.path = null: eval.kind = \"file\" needs a prompt file; allowed: a "
                                         "path to a .jsonl, .json or .parquet file", ("eval.kind",)))
    if e.kind == "synthetic":
        out += file_only_problems(e, "eval")
        if e.path is not None:
            out.append(_Problem("eval.path", f"eval.path = {_show(e.path)}: eval.kind = \"synthetic\" reads no file; "
                                             "allowed: null, or set eval.kind = \"file\"", ("eval.kind",)))
        if e.max_prompts is None:
            out.append(_Problem("eval.max_prompts", "eval.max_prompts = null: a synthetic task has no \"all\" "
                                                    "(null means the whole file of eval.kind = \"file\"); "
                                                    "allowed: an integer >= 1", ("eval.kind",)))
        if d.kind != "synthetic":  # the digit tasks bring their own tokenizer; the model's cannot read them
            out.append(_Problem("eval.kind", (
                f"eval.kind = \"synthetic\" with data.kind = {_show(d.kind)}: the digit tasks use their own "
                "16-token vocabulary, not the model's tokenizer; allowed: eval.kind = \"file\" with eval.path "
                "(a held-out prompt file), or eval.every_steps = 0 and eval.at_start = false"), ("data.kind",)))
        else:
            task = e.task or d.task
            own = TASK_REWARDS[task]
            if not e.reward and e.task not in (None, d.task) and own not in {r.name for r in cfg.reward}:
                # the run's reward is another task's: copy_digits scored an addmod answer followed by any digits
                # as right, and pass@k counted it
                out.append(_Problem("eval.reward", (
                    f"eval.reward = [] with eval.task = {_show(task)}: the evaluation would score it with the run's "
                    f"reward ({', '.join(r.name for r in cfg.reward)}), not the task's own {own}; allowed: "
                    f"eval.reward = [{{name: {own}}}]"), ("eval.task", "reward")))
            if task == "addmod" and e.num_digits is not None:  # its prompts are two digits whatever the setting
                out.append(_Problem("eval.num_digits", (
                    f"eval.num_digits = {_show(e.num_digits)} with the addmod task, whose prompts are always two "
                    "digits (100 of them); allowed: null"), ("eval.task", "data.task")))
            prompt_len, answer_len = synthetic_lengths(task, e.num_digits or d.num_digits)
            width, new = eval_lengths(cfg)
            if width < prompt_len:
                out.append(_Problem("eval.max_prompt_tokens", (
                    f"eval.max_prompt_tokens = {_show(e.max_prompt_tokens)} (then {width} tokens): the evaluation "
                    f"task's prompts are {prompt_len} tokens; allowed: an integer >= {prompt_len}"),
                    ("eval.task", "eval.num_digits", "generation.max_prompt_tokens")))
            if new < answer_len:
                out.append(_Problem("eval.max_new_tokens", (
                    f"eval.max_new_tokens = {_show(e.max_new_tokens)} (then {new} tokens): the evaluation task's "
                    f"answers need {answer_len} tokens (with <eos>); allowed: an integer >= {answer_len}"),
                    ("eval.task", "eval.num_digits", "generation.max_new_tokens")))
    else:
        for key in ("task", "num_digits"):
            if getattr(e, key) is not None:
                out.append(_Problem(f"eval.{key}", f"eval.{key} = {_show(getattr(e, key))}: eval.kind = \"file\" "
                                                   "generates no prompts; allowed: null", ("eval.kind",)))
    if e.temperature == 0 and e.samples_per_prompt > 1:
        out.append(_Problem("eval.samples_per_prompt", (
            f"eval.samples_per_prompt = {e.samples_per_prompt} with eval.temperature = 0: greedy decoding gives "
            "the same sample every time; allowed: 1, or eval.temperature > 0"), ("eval.temperature",)))
    if e.majority_answer != "none" and e.samples_per_prompt < 2:
        out.append(_Problem("eval.majority_answer", f"eval.majority_answer = {_show(e.majority_answer)} with "
                                                    "eval.samples_per_prompt = 1: a vote of one sample is pass@1; "
                                                    "allowed: \"none\", or samples_per_prompt >= 2",
                            ("eval.samples_per_prompt",)))
    if e.best_metric == "maj@k" and e.majority_answer == "none":
        out.append(_Problem("eval.best_metric", "eval.best_metric = \"maj@k\" with eval.majority_answer = \"none\": "
                                                "maj@k is not logged; allowed: another metric, or a majority_answer",
                            ("eval.majority_answer",)))
    over = [k for k in e.pass_k if k > e.samples_per_prompt]
    if over:
        out.append(_Problem("eval.pass_k", f"eval.pass_k = {_show(list(e.pass_k))}: {_show(over)} above "
                                           f"eval.samples_per_prompt = {e.samples_per_prompt} (pass@k needs k of the "
                                           "n samples); allowed: values in [1, samples_per_prompt]",
                            ("eval.samples_per_prompt",)))
    if cfg.generation.backend == "vllm":
        width, new = eval_lengths(cfg)
        if width + new > cfg.generation.max_seq_len:  # the engines are built for the run's longest sequence
            out.append(_Problem("eval.max_new_tokens", (
                f"eval.max_prompt_tokens + eval.max_new_tokens = {width} + {new}: longer than the vLLM engines' "
                f"sequences (generation.max_prompt_tokens + max_new_tokens = {cfg.generation.max_seq_len}); "
                "allowed: at most that in total"), ("eval.max_prompt_tokens", "generation.max_new_tokens")))
    out += reward_problems(e.reward, "eval.reward")
    out += threshold_problems(e.reward or cfg.reward, e.correct_threshold, "eval.reward" if e.reward else "reward")
    return out


# how a prompt file is read: a synthetic task reads none, so a value other than the default is set for nothing
_FILE_ONLY = ("format", "layout", "prompt_key", "answer_key", "chat_template", "overlong_prompts")


def file_only_problems(section, where: str) -> list[_Problem]:
    """The file-reading settings of a synthetic `section` (data or eval) given values other than their defaults:
    each would be ignored (a `data.prompt_key` meant for a file the config forgot to name, say)."""
    out = []
    for f in dataclasses.fields(section):
        if f.name in _FILE_ONLY and getattr(section, f.name) != f.default:
            key = f"{where}.{f.name}"
            out.append(_Problem(key, f"{key} = {_show(getattr(section, f.name))}: {where}.kind = \"synthetic\" reads "
                                     f"no file; allowed: {_show(f.default)}, or set {where}.kind = \"file\"",
                                (f"{where}.kind",)))
    return out
