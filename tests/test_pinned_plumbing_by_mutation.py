"""What a run writes, reads and reports around its steps that a mutation audit changed without any test failing
(session 55): rollout files, the prompt loader at an epoch's edge, process 0's held write failure, the job's start
agreement, the prompt ids' vocabulary bound, the progress bar after a resume, the start-up phases' times, metrics read
back. Each test names the slip it catches."""

import io
import json
import logging
import types

import numpy as np
import pytest

from rl.tasks import make_task
from tests.test_job_agreement import Store


def test_rollout_files_gather_every_write_in_order(tmp_path):
    """Each step's rows are appended: opened for writing, rollouts.jsonl held the last step's alone."""
    from rl import rollout_log
    for step in (1, 3, 5):
        rollout_log.append(str(tmp_path), [{"step": step, "group": 0}, {"step": step, "group": 1}])
    rows = [json.loads(line) for line in open(tmp_path / rollout_log.FILE)]
    assert [r["step"] for r in rows] == [1, 1, 3, 3, 5, 5]


def test_a_rollout_rows_mean_logprob_is_over_its_own_tokens():
    """A 2-token response padded to 4 with logprob 0: -2, not -1 (the padding averaged in)."""
    from rl.rollout_log import rollout_rows

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    ro = types.SimpleNamespace(lengths=np.array([2]), prompt_ids=[[1, 2]], truncated=np.array([False]),
                               weight_version=0, logprobs=np.array([[-1.0, -3.0, 0.0, 0.0]]))
    samples = types.SimpleNamespace(rollout=ro, completions=["ab"], answers=["ab"])
    adv = types.SimpleNamespace(advantages=np.array([0.0]), weight=np.array([1.0]))
    (row,) = rollout_rows(samples, np.array([1.0]), adv, Tok(), 1, 1, 1)
    assert row["mean_logp_gen"] == pytest.approx(-2.0)


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_of_every_record_across_an_epoch_edge_repeats_none(seed):
    """A resume with grpo.prompts_per_step = the record count, part-way into an epoch: the batch crossing into the
    next epoch holds each prompt once (`>=` for `>` repeated a prompt for 15 seeds of 20)."""
    from rl.prompt_loader import PromptLoader
    records = make_task("copy", num_digits=3).dataset(8)
    before = PromptLoader(records, 3, seed=seed)
    for _ in range(3):  # 9 of 8: into epoch 1
        before.next_indices()
    resumed = PromptLoader(records, 8, seed=seed)
    resumed.load_state_dict(before.state_dict())
    batch = resumed.next_indices()
    assert len(set(batch)) == len(batch) == 8


@pytest.mark.parametrize("seed", range(6))
def test_a_used_loader_restored_continues_as_a_fresh_one(seed):
    """load_state_dict forgets the epoch order a used loader cached (latent today: a resume builds a fresh one)."""
    from rl.prompt_loader import PromptLoader
    records = make_task("copy", num_digits=3).dataset(10)
    saved = PromptLoader(records, 4, seed=seed)
    for _ in range(3):
        saved.next_indices()
    used = PromptLoader(records, 3, seed=seed)
    for _ in range(4):
        used.next_indices()
    used.load_state_dict(saved.state_dict())
    fresh = PromptLoader(records, 3, seed=seed)
    fresh.load_state_dict(saved.state_dict())
    assert [used.next_indices() for _ in range(3)] == [fresh.next_indices() for _ in range(3)]


def test_process_zero_holds_its_first_failed_write_and_skips_the_rest(tmp_path, caplog):
    """In a multi-host job the step's later writes are skipped and the error reported is the first (the disk full),
    not a later one's; on one process a write raises at once."""
    from rl.process_zero_writes import ProcessZeroWrites
    full, denied = OSError(28, "No space left on device"), PermissionError(13, "Permission denied")

    def fail(e):
        raise e

    def row():
        (tmp_path / "rollouts.jsonl").write_text('{"step": 3}\n')

    writes = ProcessZeroWrites(2, str(tmp_path))
    with caplog.at_level(logging.CRITICAL, logger="rl.process_zero_writes"):
        assert writes.run(fail, full) is None and writes.run(row) is None and writes.run(fail, denied) is None
    assert writes.error is full and not (tmp_path / "rollouts.jsonl").exists()
    with pytest.raises(OSError, match="No space left"):
        writes.stop_if(False, 3)
    with pytest.raises(OSError, match="No space left"):
        ProcessZeroWrites(1, str(tmp_path)).run(fail, full)


def test_the_job_agreement_names_process_zeros_failure_a_lone_setting_and_a_store_error():
    """Process 1 names the cause of process 0's failed start; a setting process 0 lacks is named; a store that is
    down is its own error, not a hang of process 0."""
    from rl import job_agreement as ja
    store = Store()
    ja.report_failure("start", FileNotFoundError("/data/train.jsonl: file not found"), process_index=0,
                      process_count=2, client=store)
    with pytest.raises(ja.JobDisagrees, match=r"process 0 of this job failed at its start \(FileNotFoundError: "):
        ja.agree("start", {"code": "abc"}, process_index=1, process_count=2, client=store)
    assert ja.disagreements([{"config": {"a": 1}}, {"config": {"a": 1, "grpo.new": 2}}]) == [
        "grpo.new: process 0 '(absent)', process 1 2"]

    class Down(Store):
        def blocking_key_value_get(self, key, timeout_ms):
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordinator")

    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        ja.agree("start", {"code": "abc"}, process_index=1, process_count=2, client=Down(), timeout_s=1)


def test_a_prompt_id_at_the_vocab_size_is_refused():
    """An id == vocab_size is one past the embedding table."""
    from rl.prompt_lengths import fit_prompt_lengths
    task = make_task("copy", num_digits=2)
    records = task.dataset(2)
    top = max(max(task.tokenizer.encode(r.prompt)) for r in records)
    with pytest.raises(Exception, match=f"token id {top}, past the model's vocab_size {top}"):
        fit_prompt_lengths(records, task.tokenizer, 10**6, chat_template=False, vocab_size=top)
    fit_prompt_lengths(records, task.tokenizer, 10**6, chat_template=False, vocab_size=top + 1)


def test_a_resumed_runs_bar_starts_at_its_step():
    """At step 150 of 200 the bar read 0% 1/200 (and its time left was wrong)."""
    from rl.progress import Bar
    out = io.StringIO()
    bar = Bar(200, 150, out)
    bar.step(151, 0.5, 100.0, None)
    bar.close()
    assert "151/200" in out.getvalue() and "76%" in out.getvalue()


def test_each_start_up_phase_shows_its_own_seconds(caplog):
    from rl.startup import PhaseClock
    now = [0.0]
    clock = PhaseClock(clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="rl.startup"):
        for t, phase in ((5.0, "tokenizer"), (7.0, "prompts"), (8.0, "policy")):
            now[0] = t
            clock.done(phase)
    assert [r.getMessage() for r in caplog.records] == ["tokenizer (5.0 s)", "prompts (2.0 s)", "policy (1.0 s)"]


def test_metrics_read_back_keep_a_steps_last_row(tmp_path):
    """A file holding step 1 twice (an older version's resume, files put together): the later row is drawn."""
    from rl.observe import read_metrics
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 1, "reward/mean": 0.9}\n')
    assert read_metrics(str(tmp_path)) == [{"step": 1, "reward/mean": 0.9}]
