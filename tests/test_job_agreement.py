"""A multi-host job whose processes read different configs, code, tokenizers or prompt files from their hosts is
refused on every process with the same line, before its policy is built (rl.job_agreement). It used to train:
each host's devices took their share of the same programs over rows drawn from different files."""

import json
import os

import pytest

from rl.config import load_config
from rl.data import load_prompts
from rl.job_agreement import (JobDisagrees, agree, code_digest, config_settings, records_digest, start_facts,
                              tokenizer_digest)
from rl.tasks import DigitTokenizer
from tests.test_run_config import TINY


class Store:
    """jax's key-value store as two processes of one job share it: a key read before it is set times out."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value):
        assert key not in self.values, f"{key} written twice"
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.values:
            raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key} and duration: "
                               f"{timeout_ms}ms")
        return self.values[key]


def both_agree(facts: list[dict]) -> list[str | None]:
    """Each process's `agree` on one store (process 1 publishes first, as it would have by then): its error or None."""
    store, said = Store(), [None, None]
    store.key_value_set("m3jax:agree:start:1", json.dumps(facts[1]))
    for i in (0, 1):
        if i == 1:
            del store.values["m3jax:agree:start:1"]
        try:
            agree("start", facts[i], process_index=i, process_count=2, client=store, timeout_s=0.01)
        except JobDisagrees as e:
            said[i] = str(e)
    return said


def facts_of(overrides=(), records=None, tokenizer=None):
    cfg = load_config(TINY, list(overrides))
    return json.loads(json.dumps(start_facts(cfg, tokenizer or DigitTokenizer(), records or []), default=str))


def test_the_same_facts_agree_and_a_process_id_may_differ():
    assert both_agree([facts_of(["mesh.process_id=0"]), facts_of(["mesh.process_id=1"])]) == [None, None]


def test_a_setting_that_differs_is_named_with_both_values_on_both_processes():
    said = both_agree([facts_of(), facts_of(["optim.lr=3e-4", "grpo.group_size=16"])])
    assert said[0] == said[1]
    assert "optim.lr: process 0 0.001, process 1 0.0003" in said[0], said[0]
    assert "grpo.group_size: process 0 8, process 1 16" in said[0], said[0]
    assert said[0].count(":") == 3  # the two settings and the line's own; nothing else differs


def test_prompt_files_at_one_path_compared_by_their_content(tmp_path):
    """A prompt file rewritten on one host: the same path, other rows."""
    a, b, c = (tmp_path / n for n in ("a", "b", "c"))
    for folder, answer in ((a, "4"), (b, "4"), (c, "5")):
        folder.mkdir()
        (folder / "p.jsonl").write_text(json.dumps({"prompt": "2+2", "answer": answer}) + "\n")
    same, other = (load_prompts(f / "p.jsonl") for f in (a, b)), load_prompts(c / "p.jsonl")
    first, second = same
    assert records_digest(first) == records_digest(second)  # another folder, the same rows
    said = both_agree([facts_of(records=first), facts_of(records=other)])
    assert said[0] == said[1] and "the training prompts (data.*): process 1 differ from process 0's" in said[0]
    said = both_agree([facts_of(records=first), facts_of(records=first + other)])
    assert "the training prompts (data.*): process 0 holds 1, process 1 2" in said[0], said[0]


def test_prompts_rendered_otherwise_at_load_are_named():
    """The same prompt file, rendered to other ids (a chat template that writes the date, loaded on another day):
    each host's draws generate from its own load's ids (PromptRecord.ids), so they must agree too (a review)."""
    import dataclasses

    import numpy as np

    from rl.data import PromptRecord
    one = [PromptRecord("Solve 2+2", "4", {"row": 1}, ids=np.array([1, 5, 9, 2024], np.int32))]
    other = [dataclasses.replace(one[0], ids=np.array([1, 5, 9, 2025], np.int32))]
    assert records_digest(one) != records_digest(other)
    said = both_agree([facts_of(records=one), facts_of(records=other)])
    assert "the training prompts (data.*): process 1 differ from process 0's" in said[0], said


def test_a_tokenizer_that_differs_is_named(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def saved(vocab):
        tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>")

    one, same = (saved({"<pad>": 0, "<unk>": 1, "what": 2}) for _ in range(2))
    other = saved({"<pad>": 0, "<unk>": 1, "who": 2})
    assert tokenizer_digest(one) == tokenizer_digest(same) != tokenizer_digest(other)
    said = both_agree([facts_of(tokenizer=one), facts_of(tokenizer=other)])
    assert "the tokenizer (model.path's, or the synthetic task's): process 1 differ" in said[0], said[0]


def test_code_that_differs_changes_the_digest(tmp_path, monkeypatch):
    pkg = tmp_path / "agreement_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_digest(("agreement_probe_pkg",))
    assert code_digest(("agreement_probe_pkg",)) == before
    (pkg / "__init__.py").write_text("x = 2\n")
    assert code_digest(("agreement_probe_pkg",)) != before


def test_a_process_that_failed_to_read_its_prompts_is_named_at_once():
    """Its prompt file missing on one host: the others waited out the 5-minute timeout before naming it."""
    from rl.job_agreement import report_failure
    store = Store()
    report_failure("start", FileNotFoundError(2, "No such file or directory", "/data/p.jsonl"), process_index=1,
                   process_count=2, client=store)
    with pytest.raises(JobDisagrees, match=r"process 1 of this job failed at its start \(FileNotFoundError: "
                                           r"\[Errno 2\] No such file or directory: '/data/p.jsonl'\)"):
        agree("start", facts_of(), process_index=0, process_count=2, client=store, timeout_s=30)


def test_a_process_that_never_reports_is_named():
    with pytest.raises(JobDisagrees, match="process 1 of this job did not report start within 0 s"):
        agree("start", facts_of(), process_index=0, process_count=2, client=Store(), timeout_s=0.01)


def test_the_config_facts_leave_out_only_per_process_settings():
    settings = config_settings(load_config(TINY))
    assert "mesh.process_id" not in settings and "run.compilation_cache" not in settings
    assert settings["optim.lr"] == 0.001 and "data.path" in settings and "model.tiny.hidden_size" in settings


@pytest.mark.slow  # ~20 s: two processes that stop after reading their prompts
def test_two_hosts_with_different_configs_both_stop_before_the_policy(tmp_path):
    from tests.test_multihost import TWO_HOSTS, two_hosts
    from tests.test_multihost_failures import outputs_within
    run, out = tmp_path / "run", str(tmp_path / "out")
    procs = two_hosts(out, [*TWO_HOSTS, "run.total_steps=1", f"run.out_dir={run}"], ([], ["optim.lr=3e-4"]))
    logs = outputs_within(procs, 240)
    assert [p.returncode for p in procs] == [1, 1], "\n".join(logs)[-4000:]
    errors = [[line for line in log.splitlines() if line.startswith("error:")] for log in logs]
    assert len(errors[0]) == 1 and errors[0] == errors[1], errors
    assert "optim.lr: process 0 0.001, process 1 0.0003" in errors[0][0], errors
    assert not any("policy:" in log for log in logs)  # refused before the policy was built
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")


@pytest.mark.slow  # ~15 s each: two processes, one or both of which are refused their config
@pytest.mark.parametrize("refused, setting, said", [
    (0, "optim.lr=-1", "optim.lr = -1.0: out of range"),
    (1, "optim.lr=-1", "optim.lr = -1.0: out of range"),
    (1, "grpo.max_trajectory_age_steps=1", "grpo.max_trajectory_age_steps = 1 with generation.backend"),  # a review
    ("both", "optim.lr=-1", "optim.lr = -1.0: out of range"),  # the shared config's typo: both stop at once
])
def test_a_process_whose_config_is_refused_stops_the_job_at_once_naming_why(tmp_path, refused, setting, said):
    """One host's copy of the config refused: that process exited alone (status 2), and the other waited 5 minutes
    in jax.distributed.initialize before jax ended it ("another task died"). It now joins to say why it stops."""
    from tests.test_multihost import TWO_HOSTS, two_hosts
    from tests.test_multihost_failures import outputs_within
    run, out = tmp_path / "run", str(tmp_path / "out")
    own = ([setting] if refused in (0, "both") else [], [setting] if refused in (1, "both") else [])
    procs = two_hosts(out, [*TWO_HOSTS, "run.total_steps=1", f"run.out_dir={run}"], own)
    logs = outputs_within(procs, 120)
    if refused == "both":
        assert [p.returncode for p in procs] == [2, 2] and all(said in log for log in logs), logs
        return
    assert procs[refused].returncode == 2 and said in logs[refused], logs[refused][-3000:]
    other = logs[1 - refused]
    if refused == 0:  # process 1 reads it as process 0's answer at the run's lock: nothing of the run was written
        assert procs[1].returncode == 2, other[-3000:]
        assert f"config error: process 0's config was refused: {said}" in other, other[-3000:]
        assert not run.exists()
    else:  # process 0 reads it where it compares the processes' start facts, before the policy
        assert procs[0].returncode == 1, other[-3000:]
        errors = [line for line in other.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "process 1 of this job failed at its start (ConfigError: " in errors[0], other
        assert said in errors[0] and "policy:" not in other
