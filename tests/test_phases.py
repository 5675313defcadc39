"""Each phase of a GRPO step, alone, with a fake generator and a fake train step (no model, no jit)."""

import dataclasses

import jax
import numpy as np
import pytest

from rl import phases, weight_sync
from rl.config import load_config
from rl.generation.base import Rollout, SamplingParams
from rl.tasks import make_task

CFG = load_config("configs/tiny.yaml", ["grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.micro_batch_size=4"])


class FakeEngine:
    """Answers every prompt with its own digits (the copy task's right answer) for even rows, and with one
    wrong digit for odd rows; records what it was asked."""
    resent_rows, restarts = 3, 1

    def __init__(self, tokenizer):
        self.tokenizer, self.calls, self.weights = tokenizer, [], []

    def generate(self, prompts, params, key, prompt_width=None):
        self.calls.append((len(prompts), prompt_width))
        width = params.max_new_tokens
        tokens = np.zeros((len(prompts), width), np.int32)
        lengths = np.zeros(len(prompts), np.int32)
        for i, p in enumerate(prompts):
            digits = list(p[1:-1]) if i % 2 == 0 else list(p[1:-2]) + [p[1]]
            answer = digits + [self.tokenizer.eos_token_id]
            tokens[i, :len(answer)] = answer
            lengths[i] = len(answer)
        return Rollout([list(p) for p in prompts], tokens, np.full(tokens.shape, -0.5, np.float32), lengths,
                       np.zeros(len(prompts), bool))

    def set_weights(self, params, version, rest=None):
        self.weights.append(version)
        return Stats()

    def score(self, prompts, responses, params):
        return [[np.full(len(r), -1.0, np.float32) for r in responses]] * 2  # two engines

    def shutdown(self):
        pass


@dataclasses.dataclass
class Stats:
    gb_per_s: float = 1.0
    convert_s: float = 0.1
    send_s: float = 0.2
    apply_s: float = 0.3
    senders: int = 1


@pytest.fixture(scope="module")
def samples():
    task = make_task("copy", num_digits=4, seed=0)
    engine = FakeEngine(task.tokenizer)
    sp = SamplingParams(max_new_tokens=6, stop_token_ids=(task.tokenizer.eos_token_id,))
    got = phases.rollout(engine, task.dataset(2), task.tokenizer, CFG, sp, step=0)
    assert engine.calls == [(8, CFG.generation.max_prompt_tokens)]  # 2 prompts x G = 4, fixed width
    return got


def test_rollout_repeats_prompts_and_decodes_without_stop_tokens(samples):
    assert len(samples.completions) == 8 and samples.answers[0] == samples.answers[3] != samples.answers[4]
    assert samples.completions[0] == samples.answers[0]  # the eos was dropped, the digits kept


def test_rewards_and_advantages(samples):
    reward, failures, _ = phases.rewards(CFG.reward, samples)
    assert failures == 0 and np.all(reward[0::2] == 1.0) and np.all(reward[1::2] < 1.0)
    adv = phases.advantages(reward, samples.rollout.truncated, CFG.grpo)
    assert adv.advantages.shape == (8,) and np.all(adv.advantages[0::2] > 0) and np.all(adv.advantages[1::2] < 0)
    assert np.allclose(adv.advantages.reshape(2, 4).sum(1), 0, atol=1e-5) and not adv.zero_variance.any()
    flat = phases.advantages(np.ones(8, np.float32), samples.rollout.truncated,
                             dataclasses.replace(CFG.grpo, dynamic_sampling=True))
    assert flat.zero_variance.all() and not flat.weight.any()  # equal rewards: both groups dropped


def test_each_rewards_own_values_come_back_unweighted(samples):
    from rl.config.schema import RewardSpec
    specs = (RewardSpec("copy_digits", 1.0, 5.0), RewardSpec("exact_digits", 0.5, 5.0))
    total, failures, parts = phases.rewards(specs, samples)
    assert sorted(parts) == ["copy_digits", "exact_digits"] and failures == 0
    np.testing.assert_allclose(total, parts["copy_digits"] + 0.5 * parts["exact_digits"], rtol=1e-6)
    assert np.all(parts["exact_digits"][0::2] == 1.0)  # the rows answered right: 1 before the weight


def test_train_batch_logprobs_update_and_metrics(samples):
    reward, failures, _ = phases.rewards(CFG.reward, samples)
    adv = phases.advantages(reward, samples.rollout.truncated, CFG.grpo)
    micro = phases.train_batch(samples, adv, width=16, pad_id=13, num_micro=2)
    assert micro["input_ids"].shape == (2, 4, 15) and micro["loss_mask"].sum() == samples.rollout.lengths.sum()

    state = type("S", (), {"params": "P", "rest": "R"})()
    seen = []

    def logprob_pass(params, rest, mb):
        seen.append(params)
        return np.full(mb["input_ids"].shape, -0.5, np.float32)

    micro = phases.logprobs(logprob_pass, state, micro, ref_params="REF")
    assert seen == ["P", "REF"] and "logp_old" in micro and "logp_ref" in micro

    def train_step(state, part):
        return state + 1, {"loss": 0.5, "grad_norm": 2.0, "skipped": False, "empty": part["loss_mask"].sum() == 0,
                           "sums": {"tokens": float(part["loss_mask"].sum()), "clipped_tokens": 1.0,
                                    "is_inf_tokens": 1.0, "is_truncated_tokens": 1.5, "is_floored_tokens": 0.5,
                                    "trainer_inf_tokens": 1.0}}

    new, stats = phases.update(train_step, 0, micro, updates=2)  # one micro-batch per update
    assert new == 2 and stats.sums["tokens"] == micro["loss_mask"].sum() and stats.sums["clipped_tokens"] == 2.0
    m = phases.step_metrics(samples, reward, failures, adv, micro, stats, 1e-3, {"generate": 1.0}, 2.0)
    assert m["clip_frac"] == 2.0 / stats.sums["tokens"] and m["gen_kl_error"] == pytest.approx(0.0, abs=1e-7)
    assert stats.empty == 0 and m["empty_updates"] == 0
    assert m["is/inf_frac"] == 2.0 / stats.sums["tokens"]
    # the shares is_correction=truncate changed (w above is_cap, below is_floor), not only the mask band's
    assert m["is/truncated_frac"] == 3.0 / stats.sums["tokens"] and m["is/floored_frac"] == 1.0 / stats.sums["tokens"]
    assert m["time/generate"] == 1.0 and m["throughput/tokens_per_s"] == samples.rollout.lengths.sum() / 2.0
    # the loss's `tokens` leave out the trainer's -inf tokens (below): their share is of the tokens before that
    assert m["is/trainer_inf_frac"] == 2.0 / (stats.sums["tokens"] + 2.0)


def test_a_step_without_loss_tokens_logs_its_per_token_figures_as_nan(samples):
    """Every row at loss weight 0 (overlong_filter with every response cut, dynamic sampling's fill of equal-reward
    groups): `entropy_approx`, `kl` and `clip_frac` read 0.0 (an entropy collapse on the curves) beside the NaN of
    the mismatch diagnostics (an audit). Each per-token figure is NaN there; the step's own figures stay."""
    reward, failures, _ = phases.rewards(CFG.reward, samples)
    adv = phases.advantages(reward, samples.rollout.truncated, CFG.grpo)
    micro = phases.train_batch(samples, adv, width=16, pad_id=13, num_micro=2)
    micro["loss_mask"] = np.zeros_like(micro["loss_mask"])  # every row at loss weight 0
    micro["logp_old"] = micro["logp_gen"]
    zero = {"tokens": 0.0, "clipped_tokens": 0.0, "kl_sum": 0.0, "neg_logp_sum": 0.0, "trainer_inf_tokens": 0.0,
            "ref_inf_tokens": 0.0, "entropy_sum": 0.0}
    stats = phases.UpdateStats(0.0, 0.0, 0, zero)
    m = phases.step_metrics(samples, reward, failures, adv, micro, stats, 1e-3, {"generate": 1.0}, 2.0)
    for key in ("clip_frac", "kl", "entropy_approx", "entropy", "is/inf_frac", "is/trainer_inf_frac",
                "kl/ref_inf_frac", "gen_kl_error"):
        assert np.isnan(m[key]), (key, m[key])
    assert m["loss"] == 0.0 and m["reward/mean"] == float(reward.mean())


def test_the_trainers_inf_tokens_are_a_share_of_the_loss_tokens_they_were():
    """One of 4 loss tokens at -inf read 1/3 (the count it was divided by had left it out); all of them read n/1."""
    import jax.numpy as jnp
    from rl.grpo.loss import LossConfig, grpo_loss
    lp = jnp.array([[-1.0, -1.0, -jnp.inf, -1.0]])
    _, sums = grpo_loss(lp, lp, lp, jnp.array([1.0]), jnp.ones((1, 4)), LossConfig())
    assert float(sums["tokens"]) == 3.0 and float(sums["trainer_inf_tokens"]) == 1.0


def test_sync_weights_reports_the_transfer_and_checks_the_probes(samples):
    engine = FakeEngine(None)
    state = type("S", (), {"params": "P", "rest": "R"})()
    sp = SamplingParams(max_new_tokens=2)
    agree = weight_sync.ProbeCheck([[1, 2]], [[3, 4]], sp, lambda p, r: np.full((1, 3), -1.0, np.float32), limit=1e-4)
    out = weight_sync.sync_weights(engine, state, 5, agree)
    assert engine.weights == [5] and out["pool/resent_rows"] == 3 and out["transfer/probe_engines"] == 2
    assert out["transfer/probe_max_abs_logprob_diff"] == 0.0
    differ = dataclasses.replace(agree, trainer_logprobs=lambda p, r: np.full((1, 3), -1.5, np.float32))
    with pytest.raises(RuntimeError, match="differ from the trainer's by 0.5"):
        weight_sync.sync_weights(engine, state, 6, differ)


def test_the_rollout_key_derives_from_seed_and_step():
    keys = []

    class Recorder(FakeEngine):
        def generate(self, prompts, params, key, prompt_width=None):
            keys.append(np.asarray(jax.random.key_data(key)))
            return super().generate(prompts, params, key, prompt_width)

    task = make_task("copy", num_digits=4, seed=0)
    sp = SamplingParams(max_new_tokens=6)
    for step in (0, 1, 0):
        phases.rollout(Recorder(task.tokenizer), task.dataset(2), task.tokenizer, CFG, sp, step)
    assert np.array_equal(keys[0], keys[2]) and not np.array_equal(keys[0], keys[1])


def test_rows_sort_longest_first_within_each_update_and_the_widths_are_reported():
    lengths = np.array([3, 9, 5, 12, 2, 7, 12, 4])
    mask = (np.arange(12) < lengths[:, None]).astype(np.int32)
    batch = {"attention_mask": mask, "advantages": np.arange(8, dtype=np.float32),
             "input_ids": np.arange(8)[:, None] * 100 + np.arange(12)}
    got = phases.sorted_by_length(batch, updates=2)
    # each update keeps its own rows (0-3, then 4-7): only their order changes, every field alike
    assert got["advantages"].tolist() == [3, 1, 2, 0, 6, 5, 7, 4]
    assert np.array_equal(got["input_ids"][:, 0], got["advantages"] * 100)
    assert got["attention_mask"].sum(-1).tolist() == [12, 9, 5, 3, 12, 7, 4, 2]

    micro = {"attention_mask": got["attention_mask"].reshape(4, 2, 12)}  # 4 micro-batches of 2 rows
    m = phases.width_metrics(micro, (4, 8))
    assert m["batch/real_frac"] == lengths.sum() / 96
    assert m["batch/computed_frac"] == (12 + 8 + 12 + 4) / 48  # widths 12 (none fits), 8, 12, 4
    assert phases.width_metrics(micro, ())["batch/computed_frac"] == 1.0


def test_a_micro_batch_is_cut_to_its_width_and_its_outputs_padded_back():
    from sharding.widths import cut_micro_batch, micro_widths, padded_to

    lengths = np.array([[3, 5], [9, 12]])  # 2 micro-batches of 2 rows, 12 positions
    batch = {"attention_mask": (np.arange(12) < lengths[..., None]).astype(np.int32),
             "routes": np.arange(2 * 2 * 12 * 3).reshape(2, 2, 12, 3), "advantages": np.array([[1.0, 2.0], [3.0, 4.0]])}
    assert micro_widths(batch["attention_mask"], (4, 8)) == [8, 12]  # 5 needs 8; 12 fits no listed width
    assert micro_widths(batch["attention_mask"], (16,)) == [12, 12]  # wider than the batch: the batch's width
    mb = cut_micro_batch(batch, 0, 8)
    assert mb["routes"].shape == (2, 8, 3) and mb["advantages"].tolist() == [1.0, 2.0]
    assert np.array_equal(mb["routes"], batch["routes"][0, :, :8])
    back = padded_to(mb["routes"][None], 12)
    assert back.shape == (1, 2, 12, 3) and np.array_equal(back[0, :, :8], mb["routes"]) and not back[0, :, 8:].any()


def test_widths_must_split_into_the_context_shards_blocks():
    from sharding.widths import check_widths

    check_widths((256, 512), multiple=256)
    for widths, match in (((256, 300), r"\[300\] not a multiple of 256"), ((512, 256), "strictly increasing"),
                          ((0,), "positive integer")):
        with pytest.raises(ValueError, match=match):
            check_widths(widths, multiple=256, what="grpo.micro_batch_widths")
    cfg = load_config("configs/tiny.yaml", ["mesh.data=4", "mesh.context=2", "mesh.expert_axes=[data]",
                                            "grpo.micro_batch_size=1", "grpo.micro_batch_widths=[4]"])
    from rl.config import ConfigError
    from rl.input_errors import input_errors
    from rl.policy import build_policy
    with pytest.raises(ConfigError, match=r"grpo.micro_batch_widths = \[4\]: \[4\] not a multiple of 8") as e:
        build_policy(cfg)  # context 2 x 4-token blocks
    assert isinstance(e.value, input_errors())  # `python -m m3jax.train` prints it as one error line
    with pytest.raises(ConfigError, match=r"grpo.micro_batch_widths = \[8, 4\]: allowed: positive widths in strictly"):
        load_config("configs/tiny.yaml", ["grpo.micro_batch_widths=[8, 4]"])  # at load, where no model is needed


def test_the_reward_panel_draws_each_reward_when_there_are_several():
    from rl.observe import PLOTS, panels
    one = [{"step": 1, "reward/mean": 0.5, "reward/copy_digits/mean": 0.5}]
    assert panels(one)["reward"] == PLOTS["reward"]  # one reward: its mean is the panel's reward/mean already
    two = [{"step": 1, "reward/mean": 0.5, "reward/b/mean": 0.2, "reward/a/mean": 0.9, "val/reward/a/mean": 1.0}]
    assert panels(two)["reward"] == (*PLOTS["reward"], "reward/a/mean", "reward/b/mean")


def test_the_reward_panel_draws_the_drawn_reward_under_dynamic_sampling():
    """With grpo.dynamic_sampling reward/mean is over the kept groups, which lean to informative ones; the
    policy's own reward is dapo/reward_mean_drawn (over every drawn sample), so the panel draws it beside."""
    from rl.observe import PLOTS, panels
    assert panels([{"step": 1, "reward/mean": 0.5}])["reward"] == PLOTS["reward"]
    rows = [{"step": 1, "reward/mean": 0.5, "dapo/reward_mean_drawn": 0.25}]
    assert panels(rows)["reward"] == (*PLOTS["reward"], "dapo/reward_mean_drawn")


def test_rewards_that_name_prompt_and_meta_get_each_rows_own_also_after_a_refill_reorders_rows(samples):
    """Row i answers prompt i // G; its prompt and meta must follow it through dynamic sampling's picks."""
    from rl.config.schema import RewardSpec
    from rl.rewards import registry

    def prompt_is_row_prompt(completion, answer, prompt, meta, **kw):
        return float(prompt == answer and meta["prompt_ids"][1:-1] == [int(c) for c in answer])  # the copy task

    assert samples.records is not None and len(samples.records) == 8
    try:
        registry.register_reward("_test_row_phase", mode="inline")(prompt_is_row_prompt)
        specs = (RewardSpec("_test_row_phase", 1.0, 5.0),)
        reward, failures, _ = phases.rewards(specs, samples)
        assert failures == 0 and reward.tolist() == [1.0] * 8
        swapped = phases._take([samples], np.array([[0, 1], [0, 0]]), 4)
        assert [r.answer for r in swapped.records] == swapped.answers == samples.answers[4:] + samples.answers[:4]
        assert phases.rewards(specs, swapped)[0].tolist() == [1.0] * 8
    finally:
        registry._REGISTRY.pop("_test_row_phase", None)


def test_the_reference_pass_scores_with_its_own_routes_and_blocks():
    """Replaying the generator's expert ids and key blocks in the reference pass scored a teacher
    (grpo.reference_path) on the student's experts, not as itself; logp_old still replays them."""
    seen = []

    def logprob_pass(params, rest, micro):
        seen.append((params, sorted(k for k in micro if k in ("routes", "block_ids"))))
        return np.zeros((1, 2, 3), np.float32), {"routes": np.zeros(1), "block_ids": np.zeros(1)}

    state = dataclasses.make_dataclass("State", ["params", "rest"])("policy", None)
    micro = {"input_ids": np.zeros((1, 2, 3)), "routes": np.ones(1), "block_ids": np.ones(1)}
    out = phases.logprobs(logprob_pass, state, micro, ref_params="reference")
    assert seen == [("policy", ["block_ids", "routes"]), ("reference", [])]
    assert "logp_ref" in out and "trainer_routes" in out and "routes" in out  # the update still replays them
