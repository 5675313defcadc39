"""The step's rollouts as text (`logging.rollouts_every`): run.out_dir/rollouts.jsonl, one line per response; and
the held-out samples of each evaluation (`logging.eval_rollouts`): run.out_dir/eval_rollouts.jsonl.

What RL users read first when a curve looks wrong: the prompts, what the policy answered, and what the rewards
made of it. A resumed run repeats the steps after its checkpoint, so a step can appear twice; the later lines are
the ones the run trained on, as in metrics.jsonl.
"""

from __future__ import annotations

import json
import os

import numpy as np

FILE = "rollouts.jsonl"
EVAL_FILE = "eval_rollouts.jsonl"  # the held-out samples of each evaluation (`logging.eval_rollouts`)


def due(step: int, every: int) -> bool:
    """Whether the step numbered `step` (steps done, as in metrics.jsonl) is written: 1, 1 + every, 1 + 2 every, ..."""
    return every > 0 and (step - 1) % every == 0


def rollout_rows(samples, reward: np.ndarray, adv, tokenizer, step: int, group_size: int, groups: int,
                 parts: dict | None = None) -> list[dict]:
    """One dict per response of the step's first `groups` groups (prompts): the prompt and response as text
    (special tokens kept), the reference answer, the summed reward and each reward's own value (`parts`: name ->
    values per row), the advantage and loss weight, the response length, whether it was cut at max_new_tokens,
    its mean generator log-prob and the weight version that generated it."""
    ro = samples.rollout
    rows = []
    for i in range(min(groups * group_size, len(samples.completions))):
        n = int(ro.lengths[i])
        rows.append({
            "step": step, "group": i // group_size, "sample": i % group_size,
            "prompt": tokenizer.decode([int(t) for t in ro.prompt_ids[i]], skip_special_tokens=False),
            "response": samples.completions[i], "answer": _plain(samples.answers[i]),
            "reward": float(reward[i]), "rewards": {k: float(v[i]) for k, v in (parts or {}).items()},
            "advantage": float(adv.advantages[i]), "loss_weight": float(adv.weight[i]),
            "length": n, "truncated": bool(ro.truncated[i]),
            "mean_logp_gen": float(np.mean(ro.logprobs[i, :n])) if n else None,
            "weight_version": int(ro.weight_version),
        })
    return rows


def append(run_dir: str, rows: list[dict], name: str = FILE) -> None:
    with open(os.path.join(run_dir, name), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _plain(x):
    """A reference answer as JSON can hold it (numbers and strings as they are, anything else as its text)."""
    return x if isinstance(x, (str, int, float, bool, type(None), list, dict)) else str(x)
