"""DAPO sampling: dynamic sampling that refills (rl.phases.draw + rl.grpo.dapo.select_groups) and the soft
overlong punishment, with a fake generator whose groups are informative or not by construction."""

import dataclasses

import jax
import numpy as np
import pytest

from rl import phases
from rl.config import ConfigError, load_config
from rl.prompt_loader import PromptLoader
from rl.generation.base import Rollout, SamplingParams
from rl.grpo import dapo
from rl.grpo.advantages import zero_variance_groups
from rl.tasks import make_task

P, G, ROUNDS = 4, 4, 5
CFG = load_config("configs/tiny.yaml", [f"grpo.prompts_per_step={P}", f"grpo.group_size={G}",
                                        "grpo.micro_batch_size=4", "grpo.dynamic_sampling=true",
                                        f"grpo.dynamic_sampling_max_rounds={ROUNDS}", "run.seed=7"])
TASK = make_task("copy", num_digits=4, seed=0)
SAMPLING = SamplingParams(max_new_tokens=5, stop_token_ids=(TASK.tokenizer.eos_token_id,))


def hard(prompt) -> bool:
    """Prompts the fake policy answers alike in every sample (a zero-variance group): first digit < 5."""
    return prompt[1] < 5


class FakeEngine:
    """Copies the prompt's digits; for prompts that are not `hard`, odd samples get the first digit wrong,
    so the group's rewards differ. Records every call's prompts and key."""
    resent_rows, restarts = 0, 0

    def __init__(self, all_alike=False):
        self.calls, self.all_alike = [], all_alike

    def generate(self, prompts, params, key, prompt_width=None):
        self.calls.append((prompts, np.asarray(jax.random.key_data(key))))
        tokens = np.zeros((len(prompts), params.max_new_tokens), np.int32)
        for i, p in enumerate(prompts):
            digits = list(p[1:-1])
            if not (self.all_alike or hard(p)) and i % 2:
                digits[0] = (digits[0] + 1) % 10
            tokens[i] = digits + [TASK.tokenizer.eos_token_id]
        n = len(prompts)
        return Rollout([list(p) for p in prompts], tokens, np.full(tokens.shape, -0.5, np.float32),
                       np.full(n, params.max_new_tokens, np.int32), np.zeros(n, bool))


def loader():
    return PromptLoader(TASK.dataset(64), P, seed=0)


def informative_groups(reward):
    return int((~np.asarray(zero_variance_groups(reward, G))).sum())


# ----------------------------------------------------------------------------------- pure functions
def test_overlong_penalty_by_hand():
    # L_max = 10, L_cache = 4: free up to 6 tokens, then -1/4 per token, -1 at 10 and beyond
    got = dapo.overlong_penalty([3, 6, 7, 8, 9, 10, 12], max_len=10, buffer=4)
    np.testing.assert_allclose(got, [0, 0, -0.25, -0.5, -0.75, -1.0, -1.0])
    np.testing.assert_allclose(dapo.overlong_penalty([7, 10], 10, 4, penalty=0.5), [-0.125, -0.5])
    assert not dapo.overlong_penalty([10, 10], 10, 0).any()  # buffer 0: off
    assert dapo.overlong_penalty([1], 10, 4).dtype == np.float32


def test_select_groups_takes_informative_groups_in_draw_order_then_fills():
    z = [np.array([True, False, True]), np.array([False, True, False]), np.array([False, False, False])]
    picked, good = dapo.select_groups(z, 3)
    assert good == 3 and picked.tolist() == [[0, 1], [1, 0], [1, 2]]  # round 2's surplus is not taken
    picked, good = dapo.select_groups([np.array([True, True, False]), np.array([True, False, True])], 3)
    assert good == 2 and picked.tolist() == [[0, 0], [0, 2], [1, 1]]  # earliest zero-variance group fills
    picked, good = dapo.select_groups([np.array([True, True])], 2)
    assert good == 0 and picked.tolist() == [[0, 0], [0, 1]]
    with pytest.raises(ValueError, match="only 2 groups"):
        dapo.select_groups([np.array([False, False])], 3)


def test_round_key_derives_from_seed_step_and_round():
    data = lambda *a: np.asarray(jax.random.key_data(dapo.round_key(*a)))  # noqa: E731
    plain = np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(7), 3)))
    assert np.array_equal(data(7, 3, 0), plain)  # round 0 is the key of a step without dynamic sampling
    keys = {data(s, t, r).tobytes() for s in (0, 7) for t in (0, 3) for r in range(4)}
    assert len(keys) == 16 and np.array_equal(data(7, 3, 2), data(7, 3, 2))


# ----------------------------------------------------------------------------------- the draw phase
def test_every_trained_batch_holds_exactly_prompts_per_step_informative_groups():
    engine, data = FakeEngine(), loader()
    for step in range(6):
        before = data.state_dict()
        got = phases.draw(engine, data, TASK.tokenizer, CFG, SAMPLING, step)
        rounds = got.metrics["dapo/rounds"]
        assert len(got.reward) == len(got.samples.completions) == P * G
        assert informative_groups(got.reward) == P == got.metrics["dapo/kept_groups"]
        assert got.metrics["dapo/filled_groups"] == 0 and got.metrics["dapo/prompts_drawn"] == rounds * P
        # the loader moved by exactly the prompts drawn; each round's key is round_key(seed, step, r)
        drawn = (data.state_dict()["epoch"] - before["epoch"]) * 64 + data.index - before["index"]
        assert drawn == rounds * P
        for r, (_, key) in enumerate(engine.calls[-rounds:]):
            assert np.array_equal(key, np.asarray(jax.random.key_data(dapo.round_key(7, step, r))))
        # the kept rows are the drawn rows of informative prompts, each group whole, in draw order
        prompts = [tuple(p) for p in got.samples.rollout.prompt_ids]
        asked = [tuple(p) for call, _ in engine.calls[-rounds:] for p in call]
        assert all(not hard(p) for p in prompts[::G]) and all(len(set(prompts[i:i + G])) == 1 for i in range(0, P * G, G))
        assert [asked.index(p) for p in prompts[::G]] == sorted(asked.index(p) for p in prompts[::G])
        assert got.samples.completions[1] != got.samples.answers[1] == got.samples.answers[0]
        adv = phases.advantages(got.reward, got.samples.rollout.truncated, CFG.grpo)
        assert adv.weight.all() and not adv.zero_variance.any()
    assert max(len(c) for c, _ in engine.calls) == P * G  # every round generates one fixed-shape batch


def test_the_rounds_bound_is_honoured_and_the_rest_filled_at_weight_zero():
    engine, data = FakeEngine(all_alike=True), loader()
    got = phases.draw(engine, data, TASK.tokenizer, CFG, SAMPLING, 0)
    assert len(engine.calls) == ROUNDS == got.metrics["dapo/rounds"] and data.index == ROUNDS * P
    assert got.metrics["dapo/kept_groups"] == 0 and got.metrics["dapo/filled_groups"] == P
    assert [tuple(p) for p in got.samples.rollout.prompt_ids] == [tuple(p) for p in engine.calls[0][0]]
    adv = phases.advantages(got.reward, got.samples.rollout.truncated, CFG.grpo)
    assert not adv.weight.any()  # as without refill: zero-variance groups carry no loss

    one = dataclasses.replace(CFG, grpo=dataclasses.replace(CFG.grpo, dynamic_sampling_max_rounds=1))
    engine = FakeEngine()
    got = phases.draw(engine, loader(), TASK.tokenizer, one, SAMPLING, 0)
    assert len(engine.calls) == 1 and got.metrics["dapo/rounds"] == 1
    assert got.metrics["dapo/kept_groups"] + got.metrics["dapo/filled_groups"] == P


def test_without_dynamic_sampling_one_batch_is_trained_as_drawn():
    off = dataclasses.replace(CFG, grpo=dataclasses.replace(CFG.grpo, dynamic_sampling=False))
    engine, data = FakeEngine(all_alike=True), loader()
    got = phases.draw(engine, data, TASK.tokenizer, off, SAMPLING, 0)
    assert len(engine.calls) == 1 and data.index == P and got.metrics == {"reward/copy_digits/mean": 1.0}
    assert np.all(got.reward == 1.0) and len(got.reward) == P * G


def test_a_resumed_loader_replays_the_same_steps():
    """The loader's state after a step is what the checkpoint saves: restoring it into a fresh loader and
    drawing the next steps gives exactly the prompts, samples and rewards of the uninterrupted run."""
    def run(data, steps):
        engine = FakeEngine()
        out = [phases.draw(engine, data, TASK.tokenizer, CFG, SAMPLING, s) for s in steps]
        for d in out:  # the reward's own values follow the rows the refills kept (one reward, weight 1)
            assert d.metrics["reward/copy_digits/mean"] == pytest.approx(float(d.reward.mean()))
        return [([tuple(p) for p in d.samples.rollout.prompt_ids], d.samples.completions, d.reward.tolist(),
                 d.metrics["dapo/rounds"]) for d in out], engine.calls

    straight = loader()
    first, _ = run(straight, range(3))
    saved = straight.state_dict()
    rest, calls = run(straight, range(3, 8))
    assert sum(r for *_, r in first + rest) > 8  # refills happened (else this tests nothing)

    resumed = loader()
    resumed.load_state_dict(dict(saved))
    again, calls_again = run(resumed, range(3, 8))
    assert again == rest and resumed.state_dict() == straight.state_dict()
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(calls, calls_again))


def test_overlong_punishment_is_in_the_reward_the_advantages_see():
    cfg = load_config("configs/tiny.yaml", [f"grpo.prompts_per_step={P}", f"grpo.group_size={G}",
                                            "grpo.micro_batch_size=4", "grpo.overlong_buffer=2",
                                            "grpo.overlong_penalty=0.5", "generation.max_new_tokens=6"])
    got = phases.draw(FakeEngine(), loader(), TASK.tokenizer, cfg, SAMPLING, 0)
    # 5-token responses, L_max 6, L_cache 2: (6 - 2 - 5) / 2 x 0.5 = -0.25 on top of the copy reward
    rows = np.arange(P * G)
    right = np.array([hard(p) or i % 2 == 0 for i, p in zip(rows, got.samples.rollout.prompt_ids)])
    np.testing.assert_allclose(got.reward, np.where(right, 1.0, 0.75) - 0.25)
    assert got.metrics == {"reward/overlong_penalty_mean": -0.25,  # the copy reward's own mean: before the penalty
                           "reward/copy_digits/mean": pytest.approx(float(np.where(right, 1.0, 0.75).mean()))}


def test_config_rules():
    for bad, what in ((["grpo.dynamic_sampling_max_rounds=0"], "grpo.dynamic_sampling_max_rounds"),
                      (["grpo.overlong_buffer=5"], "not below generation.max_new_tokens = 5"),
                      (["grpo.overlong_buffer=-1"], "grpo.overlong_buffer"),
                      (["grpo.overlong_penalty=0"], "grpo.overlong_penalty")):
        with pytest.raises(ConfigError, match=what):
            load_config("configs/tiny.yaml", bad)
    ok = load_config("configs/tiny.yaml", ["grpo.overlong_buffer=4", "grpo.dynamic_sampling_max_rounds=1"])
    assert (ok.grpo.overlong_buffer, ok.grpo.dynamic_sampling_max_rounds) == (4, 1)


def test_a_short_step_is_a_warning_once_then_debug(caplog):
    """Dynamic sampling that ran out of rounds: the first such step is a warning, the rest go to run.log (near
    convergence it is every step)."""
    notes = dapo.ShortSteps()
    full = {"dapo/filled_groups": 0, "dapo/kept_groups": 8, "dapo/rounds": 1}
    short = {"dapo/filled_groups": 3, "dapo/kept_groups": 5, "dapo/rounds": 4}
    with caplog.at_level("DEBUG", logger="rl.grpo.dapo"):
        for step, metrics in enumerate((full, short, full, short), start=1):
            notes.after(step, metrics, 8)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "step 2: dynamic sampling found 5 of 8 informative groups in 4 round(s) "
                    "(grpo.dynamic_sampling_max_rounds); 3 zero-variance groups fill the step at loss weight 0"),
        ("DEBUG", "step 4: dynamic sampling found 5 of 8 informative groups in 4 round(s) "
                  "(grpo.dynamic_sampling_max_rounds); 3 zero-variance groups fill the step at loss weight 0")]
    assert notes.count == 2


# ------------------------------------------------------------- pinned by a mutation audit (session 54)
def test_a_fully_informative_first_round_ends_the_draw(monkeypatch):
    """`>=`, not `>`: a second round drew (and consumed, never training on) another P prompts, doubling generation."""
    monkeypatch.setitem(globals(), "hard", lambda prompt: False)  # every group's rewards differ
    engine, data = FakeEngine(), loader()
    got = phases.draw(engine, data, TASK.tokenizer, CFG, SAMPLING, 0)
    assert len(engine.calls) == 1 == got.metrics["dapo/rounds"] and data.index == P
    assert got.metrics["dapo/kept_groups"] == P and got.metrics["dapo/prompts_drawn"] == P


def test_the_weights_zero_exactly_the_rows_of_the_zero_variance_groups():
    """Each group's G rows in a row (np.repeat); np.tile laid them out across groups and zeroed other rows."""
    reward = np.array([1.0] * G + [0.0, 1.0] * (G // 2) + [0.5] * G + [1.0, 0.0] * (G // 2), np.float32)
    adv = phases.advantages(reward, np.zeros(len(reward), bool), CFG.grpo)
    assert list(adv.zero_variance) == [True, False, True, False]
    assert adv.weight.tolist() == [0.0] * G + [1.0] * G + [0.0] * G + [1.0] * G


def test_a_row_at_loss_weight_zero_gets_no_loss_token_and_the_others_their_weight():
    """build_train_batch's loss_mask carries the row's weight (overlong filtering and dynamic sampling rest on it)."""
    from rl.grpo.batch import build_train_batch
    rollout = Rollout([[5, 6], [5, 6], [7]], np.array([[1, 2, 3], [1, 2, 0], [4, 0, 0]]), np.full((3, 3), -0.5),
                      np.array([3, 2, 1]), np.zeros(3, bool))
    batch = build_train_batch(rollout, np.ones(3), np.array([1.0, 0.0, 0.5], np.float32), width=6, pad_id=0)
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 0], [0, 0, 0, 0, 0], [0.5, 0, 0, 0, 0]]
    # the inputs up to the last one whose prediction is trained: the last response token predicts nothing and is
    # padding, which takes no expert capacity (a mutation audit: marking it real passed every test)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
