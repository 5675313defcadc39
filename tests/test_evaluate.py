"""Held-out evaluation alone (rl.evaluate): pass@k by hand, the disjoint split, the eval config section,
evaluate() with a fake generator, and the best value a run's checkpoints remember."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from rl import evaluate as ev
from rl.config import ConfigError, load_config
from rl.generation.base import Rollout
from rl.tasks import make_task

TINY = "configs/tiny.yaml"
A_MODEL_PATH = ("model.tiny=null", "model.path=m3")  # a prompt file is read with a model directory's tokenizer


# ------------------------------------------------------------------------------------------- pass@k
@pytest.mark.parametrize("n, c, k, want", [
    (5, 2, 1, 2 / 5),               # c / n
    (5, 2, 2, 1 - 3 / 10),          # 1 - C(3,2)/C(5,2)
    (5, 2, 3, 1 - 1 / 10),          # 1 - C(3,3)/C(5,3)
    (5, 2, 4, 1.0),                 # n - c = 3 < k: any 4 of the 5 hold a correct one
    (5, 0, 3, 0.0),
    (4, 4, 4, 1.0),
    (4, 1, 4, 1.0),                 # pass@n = 1[c > 0]
    (10, 3, 5, 1 - 21 / 252),       # 1 - C(7,5)/C(10,5)
    (200, 1, 100, 0.5),             # 1 - C(199,100)/C(200,100) = 1 - 100/200; no overflow
])
def test_pass_at_k_by_hand(n, c, k, want):
    assert math.isclose(ev.pass_at_k(n, c, k), want, rel_tol=1e-12, abs_tol=1e-15)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError):
            ev.pass_at_k(n, c, k)


def test_mean_pass_at_k_averages_prompts():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]], bool)
    assert math.isclose(ev.mean_pass_at_k(correct, 1), (1 / 4 + 0 + 3 / 4) / 3)
    assert math.isclose(ev.mean_pass_at_k(correct, 2), ((1 - 3 / 6) + 0 + 1) / 3)  # C(3,2)/C(4,2) = 3/6
    assert math.isclose(ev.mean_pass_at_k(correct, 4), 2 / 3)


def test_summarize_counts_only_full_rewards_as_correct():
    reward = np.array([1.0, 0.75, 0.75, 0.75, 1.0, 1.0], np.float32)  # 2 prompts x 3 samples
    m = ev.summarize(reward, np.array([5, 5, 5, 4, 5, 6]), np.array([0, 0, 0, 0, 0, 1], bool), 3, 1.0, failures=2)
    assert math.isclose(m["val/pass@1"], (1 / 3 + 2 / 3) / 2)
    assert m["val/pass@k"] == 1.0 and math.isclose(m["val/reward_mean"], 5.25 / 6)
    assert m["val/response_length_mean"] == 5.0 and math.isclose(m["val/truncated_frac"], 1 / 6)
    assert (m["val/reward_failures"], m["val/prompts"], m["val/samples_per_prompt"]) == (2, 2, 3)
    assert ev.summarize(reward, np.full(6, 5), np.zeros(6, bool), 3, 0.7)["val/pass@1"] == 1.0
    # eval.pass_k: prompt 0 has c = 1 of 3 (pass@2 = 1 - C(2,2)/C(3,2) = 2/3), prompt 1 c = 2 (pass@2 = 1)
    m = ev.summarize(reward, np.full(6, 5), np.zeros(6, bool), 3, 1.0, pass_k=(1, 2))
    assert math.isclose(m["val/pass@2"], (2 / 3 + 1) / 2) and "val/pass@1" in m


def test_pass_k_values_are_checked_against_the_samples():
    from rl.config import ConfigError, load_config
    cfg = load_config("configs/tiny.yaml", ["eval.pass_k=[2, 4]"])
    assert cfg.eval.pass_k == (2, 4)
    with pytest.raises(ConfigError, match=r"eval.pass_k.*\[8\] above eval.samples_per_prompt = 4"):
        load_config("configs/tiny.yaml", ["eval.pass_k=[2, 8]"])


# ------------------------------------------------------------------------------------- the split
def test_held_out_prompts_are_disjoint_from_the_training_prompts():
    from rl.prompt_loader import build_data
    cfg = load_config(TINY)
    _, loader, _ = build_data(cfg)
    held = ev.eval_records(cfg, loader.records)
    assert len(held) == cfg.eval.max_prompts == 64 and len({r.prompt for r in held}) == 64  # distinct
    assert ev.overlap(loader.records, held) == 0
    assert not {r.prompt for r in held} & {r.prompt for r in loader.records}
    assert all(r.answer == r.prompt and len(r.prompt) == 4 for r in held)  # the copy task, 4 digits
    assert [r.prompt for r in ev.eval_records(cfg, loader.records)] == [r.prompt for r in held]  # deterministic
    other = ev.eval_records(load_config(TINY, ["eval.seed=1"]), loader.records)
    assert [r.prompt for r in other] != [r.prompt for r in held]


def test_held_out_runs_out_with_short_strings():
    task = make_task("copy", num_digits=2, seed=0)
    train = [r.prompt for r in task.dataset(60)]
    rest = task.held_out(1000, train)  # more than remain: each remaining string once
    assert sorted(r.prompt for r in rest) == sorted({f"{i:02d}" for i in range(100)} - set(train))
    add = make_task("addmod", seed=0)
    assert add.held_out(8, ["1+2"])[0].prompt != "1+2"
    assert add.held_out(8, [r.prompt for r in add.dataset(4096)]) == []  # 4,096 draws cover the 100 pairs
    # an audit: 4096 three-digit draws leave 13 strings; the random rounds stopped at 12
    three = make_task("copy", num_digits=3, seed=0)
    train = {r.prompt for r in three.dataset(4096)}
    left = {f"{i:03d}" for i in range(1000)} - train
    assert sorted(r.prompt for r in three.held_out(64, train)) == sorted(left)
    assert three.held_out(64, train) == three.held_out(64, train)  # the same stream: the same prompts
    with pytest.raises(ConfigError, match="data.num_digits = 1: the training prompts cover every"):
        ev.eval_records(load_config(TINY, ["data.num_digits=1", "generation.max_new_tokens=2"]),
                        make_task("copy", num_digits=1).dataset(4096))


def test_eval_file_subset_is_seeded(tmp_path):
    path = tmp_path / "held.jsonl"
    path.write_text("".join(f'{{"prompt": "{i:04d}", "answer": "{i:04d}"}}\n' for i in range(100)))
    cfg = load_config(TINY, ["eval.kind=file", f"eval.path={path}", "eval.max_prompts=10"])
    recs = ev.eval_records(cfg)
    assert len(recs) == 10 and [r.prompt for r in recs] == sorted(r.prompt for r in recs)  # file order
    assert [r.prompt for r in recs] == [r.prompt for r in ev.eval_records(cfg)]
    whole = load_config(TINY, ["eval.kind=file", f"eval.path={path}", "eval.max_prompts=null"])
    assert len(ev.eval_records(whole)) == 100


def test_an_eval_files_subset_is_drawn_from_the_prompts_that_fit(tmp_path):
    """An audit: 64 asked of a file whose odd rows are too long evaluated 31 prompts (the subset was drawn first,
    then its overlong half dropped), although 100 fit."""
    path = tmp_path / "held.jsonl"  # odd rows: 12 digits, past the 8-token prompt width
    path.write_text("".join(f'{{"prompt": "{i:04d}{"12345678" * (i % 2)}", "answer": "0"}}\n' for i in range(200)))
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1234", "answer": "1234"}\n')
    cfg = load_config(TINY, ["eval.kind=file", f"eval.path={path}", "eval.max_prompts=64", "data.kind=file",
                             f"data.path={train}", "data.overlong_prompts=drop", *A_MODEL_PATH], check_paths=False)
    es = ev.build_eval_set(cfg, make_task("copy", num_digits=4).tokenizer, (12,))
    assert len(es.records) == len(es.prompt_ids) == 64 and all(len(r.prompt) == 4 for r in es.records)
    assert [r.prompt for r in es.records] == sorted(r.prompt for r in es.records)  # file order
    assert all(len(ids) <= es.prompt_width for ids in es.prompt_ids)


# ------------------------------------------------------------------------------------ the config
def test_eval_section_defaults_off_and_tiny_on():
    tiny = load_config(TINY)
    assert tiny.eval.enabled and (tiny.eval.every_steps, tiny.eval.at_start) == (20, True)
    assert (tiny.eval.max_prompts, tiny.eval.samples_per_prompt, tiny.eval.temperature) == (64, 4, 1.0)
    off = load_config(TINY, ["eval.every_steps=0", "eval.at_start=false"])
    assert not off.eval.enabled
    from rl.config import eval_section
    assert eval_section.EVAL_METRICS == ev.METRICS
    assert not eval_section.EvalSection().enabled  # base.yaml restates these defaults (test_run_config)


@pytest.mark.parametrize("overrides, key", [
    (["eval.kind=file"], "eval.path"),
    (["eval.path=x.jsonl"], "eval.path"),
    (["eval.temperature=0"], "eval.samples_per_prompt"),
    (["eval.max_new_tokens=3"], "eval.max_new_tokens"),
    (["eval.num_digits=9"], "eval.max_prompt_tokens"),
    (["eval.reward=[{name: copy_digitz}]"], "eval.reward[0].name"),
    (["eval.kind=file", "eval.path=x.jsonl", "eval.task=copy"], "eval.task"),
    (["data.kind=file", "data.path=train.jsonl", "model.tiny=null", "model.path=m3"], "eval.kind"),
    (["eval.samples_per_prompt=0"], "eval.samples_per_prompt"),
    (["eval.max_prompts=null"], "eval.max_prompts"),
    (["eval.best_metric=pass@2"], "eval.best_metric"),
    (["eval.evry_steps=3"], "eval.evry_steps"),
])
def test_eval_section_problems_are_named(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides, check_paths=False)
    assert f"{key} = " in str(e.value) or f"{key}: " in str(e.value), str(e.value)


def test_eval_checks_apply_only_when_training_evaluates():
    # a run on a prompt file with the default (synthetic, off) eval section is valid
    cfg = load_config(TINY, ["data.kind=file", "data.path=train.jsonl", "eval.every_steps=0", "eval.at_start=false",
                             *A_MODEL_PATH], check_paths=False)
    from rl.config.validate_eval import eval_problems
    assert eval_problems(cfg) == [] and [p.key for p in eval_problems(cfg, enabled=True)] == ["eval.kind"]
    vllm = ["generation.backend=vllm", "eval.max_new_tokens=9"]  # the engines hold 8 + 5 positions
    with pytest.raises(ConfigError, match="longer than the vLLM engines"):
        load_config(TINY, vllm, check_paths=False)


# ----------------------------------------------------------------------------- evaluate() alone
class FakeEngine:
    """Right answers (the copy task) for rows whose sample index is below the prompt's first digit mod
    (n + 1), one wrong digit otherwise: the counts of correct samples per prompt are known."""
    resent_rows = restarts = 0

    def __init__(self, n):
        self.n, self.calls = n, []

    def generate(self, prompts, params, key, prompt_width=None):
        self.calls.append((len(prompts), prompt_width, params, jax.random.key_data(key).tolist()))
        tokens = np.full((len(prompts), params.max_new_tokens), 13, np.int32)
        lengths = np.zeros(len(prompts), np.int32)
        for i, p in enumerate(prompts):
            digits = list(p[1:-1])
            if i % self.n >= correct_samples(p, self.n):
                digits[-1] = (digits[-1] + 1) % 10
            answer = digits + [12]
            tokens[i, :len(answer)] = answer
            lengths[i] = len(answer)
        return Rollout([list(p) for p in prompts], tokens, np.zeros(tokens.shape, np.float32), lengths,
                       np.zeros(len(prompts), bool))


def correct_samples(prompt_ids, n):
    return prompt_ids[1] % (n + 1)


def test_evaluate_with_a_fake_engine():
    cfg = load_config(TINY, ["eval.max_prompts=10", "eval.prompts_per_batch=4"])
    task = make_task("copy", num_digits=4)
    es = ev.build_eval_set(cfg, task.tokenizer, (12,))
    assert (es.samples_per_prompt, es.prompt_width, es.sampling.temperature, es.sampling.max_new_tokens) == \
        (4, 8, 1.0, 5)
    engine = FakeEngine(4)
    m = ev.evaluate(engine, es, task.tokenizer)
    counts = np.array([correct_samples(p, 4) for p in es.prompt_ids])
    assert [c[0] for c in engine.calls] == [16, 16, 8]  # 4 + 4 + 2 prompts, 4 samples each
    assert all(c[1] == 8 for c in engine.calls)
    assert len({str(c[3]) for c in engine.calls}) == 3  # a key per batch
    assert math.isclose(m["val/pass@1"], np.mean(counts / 4))
    assert math.isclose(m["val/pass@k"], np.mean(counts > 0))
    assert math.isclose(m["val/reward_mean"], np.mean((counts + (4 - counts) * 0.75) / 4), rel_tol=1e-6)
    assert m["val/response_length_mean"] == 5.0 and m["val/prompts"] == 10
    again = FakeEngine(4)
    assert ev.evaluate(again, es, task.tokenizer) == m and [c[3] for c in again.calls] == \
        [c[3] for c in engine.calls]  # the same keys every time: comparable evaluations


def test_eval_rewards_and_threshold_come_from_the_section():
    cfg = load_config(TINY, ["eval.max_prompts=6", "eval.reward=[{name: exact_digits, weight: 2.0}]",
                             "eval.correct_threshold=2.0"])
    task = make_task("copy", num_digits=4)
    es = ev.build_eval_set(cfg, task.tokenizer, (12,))
    m = ev.evaluate(FakeEngine(4), es, task.tokenizer)
    counts = np.array([correct_samples(p, 4) for p in es.prompt_ids])
    assert math.isclose(m["val/reward_mean"], 2 * np.mean(counts / 4), rel_tol=1e-6)
    assert math.isclose(m["val/pass@1"], np.mean(counts / 4))



def test_eval_rewards_that_name_the_prompt_get_each_samples_own():
    from rl.rewards import registry

    def copies_its_prompt(completion, answer, prompt, meta, **kw):
        return float(completion == prompt == answer and meta["prompt_ids"][1:-1] == [int(c) for c in prompt])

    try:
        registry.register_reward("_test_eval_prompt", mode="inline")(copies_its_prompt)
        m, counts, _ = _evaluate_with("{name: _test_eval_prompt, weight: 1.0}")
        assert math.isclose(m["val/pass@1"], np.mean(counts / 4)) and m["val/reward_failures"] == 0
    finally:
        registry._REGISTRY.pop("_test_eval_prompt", None)


def _evaluate_with(reward_entry: str):
    """(metrics, correct samples per prompt, the eval set) of the copy task's held-out set scored by `reward_entry`
    (one eval.reward item, YAML) on FakeEngine(4)."""
    cfg = load_config(TINY, ["eval.max_prompts=6", f"eval.reward=[{reward_entry}]"])
    task = make_task("copy", num_digits=4)
    es = ev.build_eval_set(cfg, task.tokenizer, (12,))
    m = ev.evaluate(FakeEngine(4), es, task.tokenizer)
    return m, np.array([correct_samples(p, 4) for p in es.prompt_ids]), es


def test_eval_scores_a_batch_reward_in_chunks_with_each_samples_prompt():
    from rl.rewards import registry
    calls = []

    def copies_its_prompt(completions, answers, *, prompt, meta, truncated):
        calls.append(len(completions))
        return [float(c == p == a and m["prompt_ids"][1:-1] == [int(x) for x in p] and not t)
                for c, a, p, m, t in zip(completions, answers, prompt, meta, truncated)]

    try:
        registry.register_reward("_test_eval_rm", mode="batch")(copies_its_prompt)
        m, counts, es = _evaluate_with("{name: _test_eval_rm, weight: 1.0, workers: 2}")
        assert math.isclose(m["val/pass@1"], np.mean(counts / 4)) and m["val/reward_failures"] == 0
        assert len(calls) == 2 and sum(calls) == 4 * len(es.prompt_ids)
    finally:
        registry._REGISTRY.pop("_test_eval_rm", None)


def test_due_every_n_and_after_the_last_step():
    assert [s for s in range(1, 206) if ev.due(s, 205, 20)] == list(range(20, 201, 20)) + [205]
    assert not any(ev.due(s, 200, 0) for s in range(1, 201))


# --------------------------------------------------------------------------------------- the best
def test_update_best_keeps_the_highest_and_the_earliest_tie():
    best = None
    for step, v in ((0, 0.0), (20, 0.5), (40, 0.9), (60, 0.9), (80, 0.7), (100, float("nan"))):
        best = ev.update_best(best, {"val/pass@1": v}, "pass@1", step)
    assert best == {"metric": "val/pass@1", "value": 0.9, "step": 40}
    assert ev.update_best(best, {"reward/mean": 1.0}, "pass@1", 120) is best  # no evaluation this step
    switched = ev.update_best(best, {"val/reward_mean": 0.1}, "reward_mean", 140)  # another metric: restart
    assert switched == {"metric": "val/reward_mean", "value": 0.1, "step": 140}


def test_update_kept_keeps_the_k_highest_earliest_first_on_ties():
    kept = []
    for step, v in ((0, 1.0), (20, 0.5), (40, 0.9), (60, 0.7), (80, 0.9), (100, float("nan")), (120, 0.9)):
        kept = ev.update_kept(kept, {"val/pass@1": v}, "pass@1", step, 2)
    # step 0 (the initial policy) has no checkpoint of the run; of the three 0.9s the earlier two; nan ranks nothing
    assert kept == [{"metric": "val/pass@1", "value": 0.9, "step": 40},
                    {"metric": "val/pass@1", "value": 0.9, "step": 80}]
    assert [e["step"] for e in ev.update_kept(kept, {"val/pass@1": 0.95}, "pass@1", 140, 2)] == [140, 40]
    assert [e["step"] for e in ev.update_kept(kept, {"val/pass@1": 0.8}, "pass@1", 140, 3)] == [40, 80, 140]
    assert ev.update_kept(kept, {"reward/mean": 1.0}, "pass@1", 160, 2) is kept  # no evaluation this step
    assert ev.update_kept([], {"val/pass@1": 1.0}, "pass@1", 20, 0) == []  # keep_best 0: nothing ranked
    switched = ev.update_kept(kept, {"val/reward_mean": 0.1}, "reward_mean", 180, 2)  # another metric: restart
    assert switched == [{"metric": "val/reward_mean", "value": 0.1, "step": 180}]
    # a step evaluated again (a resume that repeats it) replaces its entry
    assert [(e["step"], e["value"]) for e in ev.update_kept(kept, {"val/pass@1": 0.1}, "pass@1", 40, 2)] == [
        (80, 0.9), (40, 0.1)]


def test_checkpoints_remember_the_best_and_resume_keeps_it():
    from rl.resume_checks import trained_under
    from rl.skipped_updates import SkippedUpdates
    from rl.trainer import GRPOTrainer

    saved = {}

    class Checkpointer:
        directory = "ckpt"
        kept = None  # the steps checkpoint.keep_best keeps (rl.checkpoint_keep)

        def keep_best_steps(self, steps):
            self.kept = sorted(steps)

        def save(self, step, state, meta, reference=None):
            assert reference is None  # no KL reference reset in this run
            saved[step] = meta

        def restore_latest(self, like):
            step = max(saved)
            return "state", saved[step]

    @dataclasses.dataclass
    class Loader:
        pos: dict = dataclasses.field(default_factory=lambda: {"epoch": 0, "index": 3})

        def state_dict(self):
            return dict(self.pos)

        def load_state_dict(self, d):
            self.pos = dict(d)

    class Engine:
        def set_weights(self, params, version, rest=None):
            self.version = version

    class Policy:
        state = type("S", (), {"params": "p", "rest": "r"})()

        def place(self, state):
            return self.state

    def trainer(*overrides):
        t = GRPOTrainer.__new__(GRPOTrainer)  # the loop's bookkeeping only: no model, no engine
        t.cfg = load_config(TINY, ["checkpoint.keep_best=2", *overrides])
        t.checkpointer, t.loader, t.engine, t.policy, t.best = Checkpointer(), Loader(), Engine(), Policy(), None
        t.kept = []
        t.ahead = None  # on-policy: no draw in flight (rl.ahead)
        t.reference, t.reference_step = None, 0  # no KL reference
        t.skipped_updates = SkippedUpdates(0, 1)  # its count of skipped steps goes with the checkpoint
        t.probe = None  # the JAX engine's: no probe check of the restored weights' push
        t.trained_under = trained_under(t.cfg)  # what each checkpoint records of the config (rl.resume_checks)
        return t

    first = trainer()
    first.best = ev.update_best(None, {"val/pass@1": 0.75}, "pass@1", 20)
    for step, value in ((20, 0.75), (40, 0.5), (60, 0.25)):
        first.kept = ev.update_kept(first.kept, {"val/pass@1": value}, "pass@1", step, 2)
    first.save(60)
    assert saved[60]["best"] == {"metric": "val/pass@1", "value": 0.75, "step": 20}
    assert [e["step"] for e in saved[60]["kept_best"]] == [20, 40] and first.checkpointer.kept == [20, 40]
    second = trainer()
    assert second.resume() == 60 and second.best == saved[60]["best"] and second.kept == saved[60]["kept_best"]
    assert second.checkpointer.kept == [20, 40]
    # resumed with fewer kept, or ranked by another metric: the checkpoints no longer asked for go at the next save
    fewer = trainer("checkpoint.keep_best=1")
    assert fewer.resume() == 60
    assert [e["step"] for e in fewer.kept] == [20] and fewer.checkpointer.kept == [20]
    other = trainer("eval.best_metric=reward_mean")
    other.resume()
    assert other.kept == [] and other.checkpointer.kept == []


def test_majority_voting():
    # 2 prompts x 4 samples. Prompt 0: answers 7, 7, 3, None -> 7 (right on sample 0); prompt 1: 5, 6, 6, 5 -> a tie
    # of 5 and 6 goes to 5, given first (wrong)
    keys = ["7", "7", "3", None, "5", "6", "6", "5"]
    correct = np.array([1, 1, 0, 0, 0, 1, 1, 0], bool)
    assert ev.majority_accuracy(keys, correct, 4) == 0.5
    assert ev.majority_accuracy([None] * 4, np.ones(4, bool), 4) == 0.0  # no vote: wrong
    # the majority's first sample scored 0 (a failed or timed-out scoring), two of its others correct: it was wrong
    assert ev.majority_accuracy(["5", "5", "5", "7"], np.array([0, 1, 1, 0], bool), 4) == 1.0
    assert ev.majority_key("so \\boxed{42}. Answer: 41", "boxed") == "42"
    assert ev.majority_key("no final answer", "boxed") is None and ev.majority_key(" 12 \n", "response") == "12"
    # '$' and a final '.' in either order: 'Answer: $5$.' voted for '5$', apart from 'Answer: 5'
    assert len({ev.majority_key(t, "boxed") for t in ("Answer: $5$.", "Answer: 5.", "Answer: $5$", "Answer: 5")}) == 1
    # equal numbers are one vote (1/2, \frac{1}{2} and 0.5 split it, and lost to a wrong answer given twice)
    halves = ["\\boxed{1/2}", "\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{3}", "\\boxed{3}"]
    keys = [ev.majority_key(t, "boxed") for t in halves]
    assert len(set(keys[:3])) == 1 and ev.majority_accuracy(keys, np.array([1, 1, 1, 0, 0], bool), 5) == 1.0
    assert len({ev.majority_key(f"\\boxed{{{t}}}", "boxed") for t in ("1,000", "1{,}000", "1000", "01000")}) == 1
    assert ev.majority_key("\\boxed{x+1}", "boxed") == "x+1" and ev.majority_key("\\boxed{1/0}", "boxed") == "1/0"
    # only what math_verify also takes as equal is one vote: '1 5' and '0,500' (0.5 to it) voted as 15 and 500, and
    # a group that math_verify scored wrong took its majority from them (an audit, 2026-12-08)
    keys = [ev.majority_key(f"\\boxed{{{t}}}", "boxed") for t in ("7", "1 5", "7", "1 5", "15")]
    assert keys == ["7", "1 5", "7", "1 5", "15"] and ev.majority_accuracy(keys, np.array([0, 0, 0, 0, 1], bool), 5) == 0
    assert ev.majority_key("\\boxed{0,500}", "boxed") == "0,500" and ev.majority_key("\\boxed{- 5}", "boxed") == "-5"
    assert [ev.majority_key(f"\\boxed{{{t}}}", "boxed") for t in ("+1,000", "-1,000", "- 1{,}000")] == ["1000", "-1000",
                                                                                                   "-1000"]


def test_another_eval_task_needs_its_own_reward():
    """eval.task = addmod scored by the run's copy_digits: an answer followed by any digits counted as right."""
    from rl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"eval.reward = \[\] with eval.task = \"addmod\": the evaluation would score "
                                          r"it with the run's reward \(copy_digits\), not the task's own exact_digits"):
        load_config("configs/tiny.yaml", ["eval.task=addmod"], check_paths=False)
    assert load_config("configs/tiny.yaml", ["eval.task=addmod", "eval.reward=[{name: exact_digits}]"],
                       check_paths=False).eval.task == "addmod"


def test_majority_config_rules():
    cfg = load_config(TINY, ["eval.majority_answer=response", "eval.best_metric=maj@k"])
    assert cfg.eval.majority_answer == "response"
    with pytest.raises(ConfigError, match="eval.majority_answer.*a vote of one sample"):
        load_config(TINY, ["eval.majority_answer=boxed", "eval.samples_per_prompt=1", "eval.temperature=0"])
    with pytest.raises(ConfigError, match='eval.best_metric = "maj@k" with eval.majority_answer = "none"'):
        load_config(TINY, ["eval.best_metric=maj@k"])


def test_a_synthetic_evaluation_smaller_than_asked_is_warned_of(caplog):
    """With 3 digits the copy task has 1,000 prompts; when training takes all but 12, eval.max_prompts 64 used to
    give 12 without a word (a helper's audit)."""
    cfg = load_config(TINY, ["data.num_digits=3", "generation.max_new_tokens=4"], check_paths=False)
    train = make_task("copy", num_digits=3, seed=1).held_out(988, [])
    with caplog.at_level("WARNING", logger="rl.evaluate"):
        records = ev.eval_records(cfg, train)
    assert len(records) == 12 and not {r.prompt for r in records} & {r.prompt for r in train}
    assert [r.getMessage() for r in caplog.records] == [
        "eval.max_prompts = 64, but copy of 3 digit(s) leaves only 12 prompts that are not training prompts: the "
        "evaluation uses those"]
    caplog.clear()
    assert len(ev.eval_records(cfg, train[:900])) == 64 and not caplog.records


def test_the_eval_command_reads_prompts_with_the_tokenizer_training_used(tmp_path):
    """A digit run evaluated on a file of digit prompts: the command chose the tokenizer by eval.kind, found no HF
    directory and said "error: no tokenizer in", naming nothing."""
    from rl.config import load_config
    from rl.eval_checkpoint import tokenizer_for
    from rl.tasks import DigitTokenizer
    rows = tmp_path / "digits.jsonl"
    rows.write_text('{"prompt": "1234", "answer": "1234"}\n')
    cfg = load_config("configs/tiny.yaml", ["eval.kind=file", f"eval.path={rows}", "eval.max_prompts=null"])
    assert isinstance(tokenizer_for(cfg), DigitTokenizer)
    text = load_config("configs/tiny.yaml", ["eval.kind=file", f"eval.path={rows}", "eval.max_prompts=null",
                                             "data.kind=file", f"data.path={rows}", "model.tiny=null",
                                             f"model.path={tmp_path / 'm3'}"], check_paths=False)
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in {tmp_path} \\(--hf\\) or {tmp_path / 'm3'} "
                                                "\\(model.path\\); expected the tokenizer"):
        tokenizer_for(text, str(tmp_path))


def test_addmod_says_what_can_give_it_held_out_prompts():
    """Its 100 prompts are two digits whatever eval.num_digits says: the error told the user to raise eval.num_digits,
    which the load also took without a word."""
    from rl.config import ConfigError, load_config
    from rl.prompt_loader import build_data
    addmod = ["data.task=addmod", "reward=[{name: exact_digits, weight: 1.0}]", "generation.max_new_tokens=2"]
    with pytest.raises(ConfigError, match=r"eval.num_digits = 6 with the addmod task, whose prompts are always two"):
        load_config("configs/tiny.yaml", [*addmod, "eval.num_digits=6"])
    cfg = load_config("configs/tiny.yaml", addmod)
    with pytest.raises(ConfigError, match=r"eval.task = 'addmod': the training prompts cover all 100 addmod prompts"
                                          r".*expected another eval.task"):
        ev.eval_records(cfg, build_data(cfg)[1].records)
