"""Held-out evaluation: n samples per prompt from the run's generator, scored by the rewards.

What an evaluation logs (`evaluate`), with n = eval.samples_per_prompt and a sample *correct* when its
summed reward is >= eval.correct_threshold (the digit rewards give partial credit; 1.0 = every digit right):

    val/pass@1                 mean over prompts of c / n (c = correct samples of the prompt)
    val/pass@k                 mean over prompts of the unbiased pass@k of Chen et al. (2021) with k = n
                               (= the fraction of prompts with at least one correct sample)
    val/pass@<k>               the same for each further k of eval.pass_k (a pass@k curve)
    val/reward_mean            mean summed reward over every sample
    val/response_length_mean   mean response tokens (stop token included); val/truncated_frac
    val/reward_failures        reward evaluations that failed or timed out (scored 0)
    val/reward/<name>/mean     each reward's own mean (unweighted)
    val/maj@k                  with eval.majority_answer: the share of prompts whose most frequent answer is correct

The prompts (`eval_records`) are a synthetic task's prompts that are not among the run's training
records (`rl.tasks.DigitTask.held_out`: never trained on) or a seeded subset of a prompt file (which
should be held out: the trainer warns about overlap); the sampling key derives from eval.seed alone, so every
evaluation of a run, and `python -m m3jax.eval` on one of its checkpoints, draws with the same key: on the
same parameters the figures are the same. The trainer passes its own generator (the JAX engine over the
current parameters, or the vLLM pool holding the weights of the last sync); nothing here holds state.
"""

from __future__ import annotations

import dataclasses
import fractions
import json
import logging
import re

import jax
import numpy as np

from rl.config import ConfigError
from rl.config.validate_eval import eval_lengths
from rl.answer_checks import check_answers
from rl.data import PromptRecord, load_prompts
from rl.prompt_lengths import fit_prompt_lengths
from rl.generation.base import Generator, SamplingParams
from rl.score_once import score_once
from rl.tasks import make_task

log = logging.getLogger(__name__)

METRICS = ("pass@1", "pass@k", "maj@k", "reward_mean")  # eval.best_metric's (rl.config.eval_section.EVAL_METRICS)
_STREAM = 0x6576616C  # "eval": folded into the key so that eval.seed = run.seed does not replay rollout keys


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k samples is correct, from n samples of
    which c are correct (Chen et al. 2021, eq. 1):

        pass@k = 1 - C(n - c, k) / C(n, k)  =  1 - prod_{i = n-c+1}^{n} (1 - k / i)

    (the product avoids large binomials); 1 when n - c < k. pass@1 = c / n; pass@n = 1[c > 0].
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): expected 0 <= c <= n and 1 <= k <= n")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(correct: np.ndarray, k: int) -> float:
    """pass@k averaged over prompts: `correct` is [prompts, n] booleans (n samples of each prompt)."""
    correct = np.asarray(correct, bool)
    n = correct.shape[1]
    return float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)]))


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Everything an evaluation needs besides the generator: prompts, sampling, scoring."""
    records: list[PromptRecord]
    prompt_ids: list[list[int]]
    sampling: SamplingParams
    samples_per_prompt: int
    prompt_width: int
    prompts_per_batch: int
    rewards: tuple  # rl.config.schema.RewardSpec
    correct_threshold: float
    seed: int
    pass_k: tuple[int, ...] = ()  # further k of val/pass@<k>
    majority_answer: str = "none"  # how val/maj@k reads a sample's answer (`majority_key`)


def eval_records(cfg, train: list[PromptRecord] = (), subset: bool = True) -> list[PromptRecord]:
    """The held-out prompts: eval.max_prompts distinct prompts of the synthetic task that are not among
    the `train` records (drawn with eval.seed), or of eval.path (a subset drawn with eval.seed, kept in
    file order, when the file has more; subset=False: all of the file's, for `build_eval_set` to draw from those
    that fit the prompt width)."""
    e, d = cfg.eval, cfg.data
    if e.kind == "synthetic":
        task = make_task(e.task or d.task, num_digits=e.num_digits or d.num_digits, seed=e.seed)
        records = task.held_out(e.max_prompts, [r.prompt for r in train])
        if not records and task.name == "addmod":  # two digits always: eval.num_digits changes nothing
            raise ConfigError(f"eval.task = {task.name!r}: the training prompts cover all 100 addmod prompts, so none "
                              "is left to evaluate on; expected another eval.task (with its eval.reward), an eval "
                              "file (eval.kind=file) or no evaluation (eval.every_steps=0, eval.at_start=false)")
        if not records:  # a config problem (train and eval print ConfigError as one line), found only here
            key = f"eval.num_digits = {e.num_digits}" if e.num_digits else f"data.num_digits = {d.num_digits}"
            raise ConfigError(f"{key}: the training prompts cover every {task.name} prompt of {task.num_digits} "
                              "digit(s), so none is left to evaluate on; expected longer strings (eval.num_digits), "
                              "an eval file (eval.kind=file) or no evaluation (eval.every_steps=0, "
                              "eval.at_start=false)")
        if len(records) < e.max_prompts:  # the task's distinct prompts ran out: a smaller evaluation than asked
            log.warning("eval.max_prompts = %d, but %s of %d digit(s) leaves only %d prompts that are not training "
                        "prompts: the evaluation uses those", e.max_prompts, task.name, task.num_digits, len(records))
        return records
    records = load_prompts(e.path, format=e.format, prompt_key=e.prompt_key, answer_key=e.answer_key,
                           layout=e.layout)
    check_answers(records, [spec.name for spec in e.reward or cfg.reward], e.path, "eval.answer_key")
    return [records[i] for i in _file_subset(len(records), e)] if subset else records


def _file_subset(n: int, e) -> list[int]:
    """Which of an eval file's n records it evaluates: eval.max_prompts of them drawn with eval.seed, in file
    order (all of them when the file holds no more)."""
    if e.max_prompts is None or n <= e.max_prompts:
        return list(range(n))
    return np.sort(np.random.default_rng(e.seed).choice(n, e.max_prompts, replace=False)).tolist()


def build_eval_set(cfg, tokenizer, stop_token_ids, train: list[PromptRecord] = ()) -> EvalSet:
    """The run's evaluation: its prompts (held out from `train`, the run's training records) rendered as
    training renders them, its sampling (eval.temperature, eval.top_p, its own length limits, the run's stop
    tokens) and its rewards (eval.reward, else the run's)."""
    e = cfg.eval
    records = eval_records(cfg, train, subset=False)  # a file's subset is drawn from the prompts that fit
    width, new_tokens = eval_lengths(cfg)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=e.temperature, top_p=e.top_p,
                              stop_token_ids=tuple(stop_token_ids))
    limit_key = "eval.max_prompt_tokens" if e.max_prompt_tokens else "generation.max_prompt_tokens"
    records, prompt_ids = fit_prompt_lengths(records, tokenizer, width, chat_template=cfg.data.chat_template,
                                             overlong=cfg.data.overlong_prompts, limit_key=limit_key)
    if e.kind != "synthetic":  # 64 asked of a file half of whose prompts were too long: 64, not 31
        keep = _file_subset(len(records), e)
        records, prompt_ids = [records[i] for i in keep], [prompt_ids[i] for i in keep]
    return EvalSet(records, prompt_ids, sampling, e.samples_per_prompt, width, e.prompts_per_batch or len(records),
                   tuple(e.reward or cfg.reward), e.correct_threshold, e.seed, tuple(e.pass_k), e.majority_answer)


def evaluate(engine: Generator, es: EvalSet, tokenizer, samples_of: int = 0) -> dict | tuple[dict, list[dict]]:
    """Sample, score and summarise (the val/* metrics of the module docstring). samples_of > 0: also the samples
    of the first that many prompts as text (`logging.eval_rollouts`), returned as (metrics, rows): one dict per
    sample with the prompt and response, the answer, the summed reward and each reward's own, whether it counts
    as correct, its length and truncation."""
    n = es.samples_per_prompt
    stops = set(es.sampling.stop_token_ids)
    base = jax.random.fold_in(jax.random.key(es.seed), _STREAM)
    completions, lengths, truncated = [], [], []
    for b, start in enumerate(range(0, len(es.prompt_ids), es.prompts_per_batch)):
        rows = [p for p in es.prompt_ids[start:start + es.prompts_per_batch] for _ in range(n)]
        out = engine.generate(rows, es.sampling, jax.random.fold_in(base, b), prompt_width=es.prompt_width)
        # decoded as the training rollout decodes: stop tokens dropped, other special tokens kept
        completions += [tokenizer.decode([int(x) for x in out.tokens[i, :out.lengths[i]] if int(x) not in stops],
                                         skip_special_tokens=False) for i in range(len(rows))]
        lengths.append(np.asarray(out.lengths))
        truncated.append(np.asarray(out.truncated))
    answers = [r.answer for r in es.records for _ in range(n)]
    lengths, truncated = np.concatenate(lengths), np.concatenate(truncated)
    reward, failures, parts = score_once(es.rewards, completions, answers, truncated,
                                         [r for r in es.records for _ in range(n)])
    metrics = {**summarize(reward, lengths, truncated, n, es.correct_threshold, failures, es.pass_k),
               **{f"val/reward/{name}/mean": float(v.mean()) for name, v in parts.items()}}
    if es.majority_answer != "none":
        keys = [majority_key(c, es.majority_answer) for c in completions]
        metrics["val/maj@k"] = majority_accuracy(keys, reward >= es.correct_threshold, n)
    if not samples_of:
        return metrics
    rows = [{"prompt": tokenizer.decode(es.prompt_ids[i // n], skip_special_tokens=False), "sample": i % n,
             "response": completions[i], "answer": answers[i], "reward": float(reward[i]),
             "rewards": {k: float(v[i]) for k, v in parts.items()}, "correct": bool(reward[i] >= es.correct_threshold),
             "length": int(lengths[i]), "truncated": bool(truncated[i])}
            for i in range(min(samples_of, len(es.prompt_ids)) * n)]
    return metrics, rows


def summarize(reward: np.ndarray, lengths: np.ndarray, truncated: np.ndarray, n: int, threshold: float,
              failures: int = 0, pass_k=()) -> dict:
    """The val/* metrics of rows grouped n per prompt (row i is a sample of prompt i // n); `pass_k`: further k
    of val/pass@<k>."""
    correct = (np.asarray(reward) >= threshold).reshape(-1, n)
    return {"val/pass@1": mean_pass_at_k(correct, 1), "val/pass@k": mean_pass_at_k(correct, n),
            **{f"val/pass@{k}": mean_pass_at_k(correct, k) for k in pass_k if k != 1},
            "val/reward_mean": float(np.mean(reward)), "val/response_length_mean": float(np.mean(lengths)),
            "val/truncated_frac": float(np.mean(truncated)), "val/reward_failures": int(failures),
            "val/prompts": correct.shape[0], "val/samples_per_prompt": n}


def due(step: int, total_steps: int, every_steps: int) -> bool:
    """Whether training evaluates after `step` steps: every `every_steps` and after the last step."""
    return every_steps > 0 and (step % every_steps == 0 or step == total_steps)


def majority_key(completion: str, how: str) -> str | None:
    """The answer a sample votes for: the last \\boxed{} or 'Answer:' line's content ("boxed"; None without one),
    or the whole response stripped ("response"). A boxed answer that is a plain number (an integer, a decimal, a/b
    or \\frac{a}{b}, signed) votes as that number (`_as_number`): 1/2, \\frac{1}{2} and 0.5 are one vote, as
    equivalent answers are in maj@k; any other answer votes as its text."""
    if how == "boxed":
        from rl.rewards.math import extract_final_answer
        key = extract_final_answer(completion)
        return None if key is None else _as_number(key) or key
    return completion.strip()


_NUMBER = re.compile(r"^([+-]?)\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\d+)\s*/\s*(\d+)|\\[dt]?frac\{(\d+)\}\{(\d+)\})$")
# Thousands groups as math_verify reads them (1,000 and 1{,}000 are 1000): a first group of 1-3 digits not led by 0,
# then groups of exactly three. '0,500' (0.5 to it, a decimal comma) and '1,5' are no thousands.
_THOUSANDS = re.compile(r"^[1-9]\d{0,2}(?:,\d{3})+$")


def _as_number(text: str) -> str | None:
    """A plain rational answer in one form ('42', '-1/2': reduced), else None. Thousands separators (1,000 or 1{,}000),
    a leading '-' in unicode and spaces around the text, after its sign and around a '/' are read too; a zero
    denominator is not a number. Only what math_verify also takes as equal is merged: '1 5' (spaces inside a number)
    and '0,500' vote as their text, where they voted as 15 and 500 (an audit: a wrong group's majority won)."""
    t = text.replace("\u2212", "-").strip()
    sign, digits = (t[0], t[1:].lstrip()) if t.startswith(("-", "+")) else ("", t)
    if _THOUSANDS.match(grouped := digits.replace("{,}", ",")):
        t = sign + grouped.replace(",", "")
    m = _NUMBER.match(t)
    if not m:
        return None
    sign, plain, num, den, fnum, fden = m.groups()
    num, den = (num, den) if num else (fnum, fden) if fnum else (plain, "1")
    if int(den) == 0:
        return None
    value = fractions.Fraction(num) / int(den) * (-1 if sign == "-" else 1)
    return str(value)


def majority_accuracy(keys: list, correct: np.ndarray, n: int) -> float:
    """maj@n: mean over prompts (rows grouped n per prompt) of whether the answer most of the prompt's samples give
    is correct. Samples without an answer (None) do not vote; a tie goes to the answer given first; a prompt with no
    vote counts as wrong. The answer is correct when any of its samples scored correct: judged by its first sample
    alone, one failed or timed-out scoring (a 0) turned a right majority wrong."""
    correct = np.asarray(correct, bool).reshape(-1, n)
    hits = []
    for p in range(correct.shape[0]):
        votes: dict = {}
        for j in range(n):
            k = keys[p * n + j]
            if k is not None:
                count, first, right = votes.get(k, (0, j, False))
                votes[k] = (count + 1, first, right or bool(correct[p, j]))
        if not votes:
            hits.append(False)
            continue
        _, _, right = max(votes.values(), key=lambda v: (v[0], -v[1]))
        hits.append(right)
    return float(np.mean(hits)) if hits else 0.0


def update_best(best: dict | None, metrics: dict, metric: str, step: int) -> dict | None:
    """The best value so far of val/<metric> (higher is better; a tie keeps the earlier step), as
    {metric, value, step}; `best` unchanged when `metrics` has no finite value of it."""
    key = f"val/{metric}"
    value = metrics.get(key)
    if value is None or not np.isfinite(value):
        return best
    if best is None or best.get("metric") != key or value > best["value"]:
        return {"metric": key, "value": float(value), "step": int(step)}
    return best


def update_kept(kept: list[dict], metrics: dict, metric: str, step: int, k: int) -> list[dict]:
    """The k best evaluations of the run's checkpoints by val/<metric>, best first ({metric, value, step} each):

        kept' = the first k of sorted(kept + [this step], by value descending, then step ascending)

    so a tie keeps the earlier step, as `update_best` does. Step 0 (the initial policy, which has no checkpoint of
    the run) never enters, an entry of another metric (eval.best_metric changed on resume) is dropped, and `kept` is
    unchanged when `metrics` has no finite value of the metric."""
    key = f"val/{metric}"
    value = metrics.get(key)
    if k <= 0 or step <= 0 or value is None or not np.isfinite(value):
        return kept
    entries = [e for e in kept if e["step"] != step] + [{"metric": key, "value": float(value), "step": int(step)}]
    return ranked(entries, metric, k)


def ranked(kept: list[dict], metric: str, k: int) -> list[dict]:
    """The first k of `kept`'s entries of val/<metric>, by value descending, then step ascending (a resumed run's
    checkpoint.keep_best and eval.best_metric applied to what its checkpoint kept)."""
    entries = [e for e in kept if e.get("metric") == f"val/{metric}"]
    return sorted(entries, key=lambda e: (-e["value"], e["step"]))[:k]


def overlap(train: list[PromptRecord], held_out: list[PromptRecord]) -> int:
    """How many held-out prompts also occur among the training prompts (compared as rendered JSON)."""
    seen = {json.dumps(r.prompt, sort_keys=True) for r in train}
    return sum(json.dumps(r.prompt, sort_keys=True) in seen for r in held_out)
