"""The rollouts as text (`logging.rollouts_every`, rl/rollout_log.py)."""

import json

import numpy as np
import pytest

from rl.rollout_log import FILE, due


def test_due_follows_the_metrics_step_numbers():
    assert [s for s in range(1, 12) if due(s, 5)] == [1, 6, 11]
    assert not any(due(s, 0) for s in range(1, 12))


@pytest.mark.slow  # one step of the tiny trainer
def test_a_step_writes_its_first_groups_as_text(tmp_path):
    from tests.tiny_runs import tiny_trainer
    trainer = tiny_trainer(tmp_path, "r", "logging.rollouts_every=2", "logging.rollouts_groups=2")
    try:
        metrics = trainer.step(0)  # metrics.jsonl's step 1: written
        trainer.step(1)            # step 2: not written
    finally:
        trainer.engine.shutdown()
    rows = [json.loads(line) for line in open(tmp_path / "r" / FILE)]
    assert [(r["step"], r["group"], r["sample"]) for r in rows] == [(1, g, j) for g in range(2) for j in range(4)]
    for r in rows:  # the tiny task: <bos> d d d d <sep>, answered by the digits (copy_digits scores their places)
        assert r["prompt"].startswith("<bos>") and r["prompt"].endswith("<sep>") and len(r["answer"]) == 4
        assert 0.0 <= r["reward"] <= 1.0 and 1 <= r["length"] <= 5 and r["loss_weight"] == 1.0
        assert r["mean_logp_gen"] < 0 and r["weight_version"] == 0
        assert r["rewards"] == {"copy_digits": r["reward"]}  # the one reward, weight 1: its own value is the sum
    for g in range(2):  # GRPO's advantages: each group's rewards centred
        adv = [r["advantage"] for r in rows if r["group"] == g]
        rew = [r["reward"] for r in rows if r["group"] == g]
        assert np.sum(adv) == pytest.approx(0.0, abs=1e-4)
        assert np.argsort(adv, kind="stable").tolist() == np.argsort(rew, kind="stable").tolist() or np.ptp(rew) == 0
    assert metrics["reward/mean"] >= 0


@pytest.mark.slow  # one evaluation of the tiny trainer
def test_an_evaluation_writes_its_first_prompts_samples(tmp_path):
    from rl.rollout_log import EVAL_FILE
    from tests.tiny_runs import tiny_trainer
    trainer = tiny_trainer(tmp_path, "e", "logging.eval_rollouts=2", "eval.max_prompts=8",
                           "eval.majority_answer=response")
    try:
        metrics = trainer._evaluate(0)
    finally:
        trainer.engine.shutdown()
    rows = [json.loads(line) for line in open(tmp_path / "e" / EVAL_FILE)]
    n = trainer.cfg.eval.samples_per_prompt
    assert len(rows) == 2 * n and [r["sample"] for r in rows] == list(range(n)) * 2
    assert all(r["step"] == 0 and r["prompt"].startswith("<bos>") and len(r["answer"]) == 4 for r in rows)
    assert all(r["correct"] == (r["reward"] >= 1.0) and set(r["rewards"]) == {"copy_digits"} for r in rows)
    assert "val/pass@1" in metrics and "val/reward/copy_digits/mean" in metrics
    assert 0.0 <= metrics["val/maj@k"] <= metrics["val/pass@k"]  # a correct majority answer is a correct sample


@pytest.mark.parametrize("block", [7, 64, 1 << 16])  # lines across block boundaries, and one block
def test_a_resume_drops_the_lines_a_killed_run_wrote_past_its_checkpoint(tmp_path, block, monkeypatch):
    """A kill after step 3's lines, with the checkpoint at 2: the resumed run writes steps 3 and 4 again, so their
    old lines go (a partial last line with them); each step's lines are then written once."""
    import rl.rollout_log as rollout_log

    monkeypatch.setattr(rollout_log, "_lines_backwards",
                        lambda f, size, _b=rollout_log._lines_backwards: _b(f, size, block))
    rows = [{"step": s, "sample": i, "response": "é" * 5} for s in (1, 2, 3) for i in range(2)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / FILE).write_text(text + '{"step": 4, "samp', encoding="utf-8")
    (tmp_path / "eval_rollouts.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 2, 4)))
    assert rollout_log.drop_rows_past(str(tmp_path), 2) == {FILE: 2, "eval_rollouts.jsonl": 1}
    kept = (tmp_path / FILE).read_text(encoding="utf-8")
    assert kept == "".join(json.dumps(r) + "\n" for r in rows[:4])
    assert [json.loads(x)["step"] for x in (tmp_path / "eval_rollouts.jsonl").read_text().splitlines()] == [0, 2]
    assert rollout_log.drop_rows_past(str(tmp_path), 2) == {}  # nothing past 2 is left
    assert rollout_log.drop_rows_past(str(tmp_path), -1) == {FILE: 4, "eval_rollouts.jsonl": 2}  # from scratch
    assert (tmp_path / FILE).read_text() == "" and rollout_log.drop_rows_past(str(tmp_path / "none"), 0) == {}


def test_a_line_that_is_not_a_row_stops_the_cut(tmp_path):
    from rl.rollout_log import drop_rows_past

    (tmp_path / FILE).write_text('{"step": 1}\nnot json\n{"step": 5}\n')
    assert drop_rows_past(str(tmp_path), 2) == {FILE: 1}
    assert (tmp_path / FILE).read_text() == '{"step": 1}\nnot json\n'
