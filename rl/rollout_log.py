"""The step's rollouts as text (`logging.rollouts_every`): run.out_dir/rollouts.jsonl, one line per response; and
the held-out samples of each evaluation (`logging.eval_rollouts`): run.out_dir/eval_rollouts.jsonl.

What RL users read first when a curve looks wrong: the prompts, what the policy answered, and what the rewards
made of it. A resumed run repeats the steps after its checkpoint: it first removes the lines a killed run wrote
past that step (`drop_rows_past`), so each step's lines are the ones the run trained on, once, as in metrics.jsonl.
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


def drop_rows_past(run_dir: str, step: int) -> dict[str, int]:
    """Remove the lines of steps after `step` from both files (a killed run's, which the resumed run writes again);
    -> lines removed per file name that had any. The files are in step order, so only their ends are read (a long
    run's rollouts.jsonl may hold gigabytes), and they are cut in place."""
    removed = {}
    for name in (FILE, EVAL_FILE):
        n = _cut_rows_past(os.path.join(run_dir, name), step)
        if n:
            removed[name] = n
    return removed


def _cut_rows_past(path: str, step: int) -> int:
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        cut, dropped = None, 0
        for offset, line in _lines_backwards(f, size):
            if not line.strip():
                continue
            try:
                at = json.loads(line)["step"]
            except (ValueError, TypeError, KeyError):
                if offset + len(line) == size:  # the last line, cut short by a crash while writing it
                    cut = offset
                    continue
                break  # not a row: kept, with everything before it
            if not isinstance(at, (int, float)) or at <= step:
                break
            cut, dropped = offset, dropped + 1
        if cut is not None:
            f.truncate(cut)
    return dropped


def _lines_backwards(f, size: int, block: int = 1 << 16):
    """(byte offset, line without its newline) of a binary file's lines, the last first."""
    pos, head = size, b""
    while pos > 0:
        n = min(block, pos)
        pos -= n
        f.seek(pos)
        lines = (f.read(n) + head).split(b"\n")
        head = lines[0]  # may begin in the block before
        offset = pos + len(head) + 1
        found = []
        for line in lines[1:]:
            found.append((offset, line))
            offset += len(line) + 1
        yield from reversed(found)
    yield 0, head
