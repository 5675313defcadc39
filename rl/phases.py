"""The phases of one GRPO step, each a function of plain values that can be tested alone:

    rollout -> rewards -> advantages (+ train batch) -> logprobs -> update -> weight sync -> metrics

`rl.trainer.GRPOTrainer.step` calls them in this order; nothing here knows the order or holds state.
`draw` is rollout + rewards, repeated while DAPO dynamic sampling asks for more groups. The weight sync is
`rl.weight_sync`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rl.config import RunConfig
from rl.data import prompt_ids
from rl.generation.base import Generator, Rollout, SamplingParams
from rl.grpo import advantages as adv_lib
from rl.grpo import dapo
from rl.grpo.batch import build_train_batch, split_micro
from rl.grpo.loss import generation_mismatch_metrics
from rl.grpo.mismatch import (ID_MISMATCH_METRICS, id_mismatch_from_sums, id_mismatch_sums, mismatch_fraction,
                              mismatch_from_sums)
from rl.score_once import score_once
from sharding.host_values import place_host_value
from sharding.widths import micro_widths


@dataclasses.dataclass
class Samples:
    """G responses per prompt, flattened (row i answers prompt i // G)."""
    rollout: Rollout
    answers: list  # the reference answer of each row's prompt
    completions: list[str]  # decoded responses (stop tokens dropped, other special tokens kept)
    records: list | None = None  # each row's PromptRecord: its prompt and meta, for the rewards that name them


def rollout(engine: Generator, records, tokenizer, cfg: RunConfig, sampling: SamplingParams, step: int,
            round: int = 0) -> Samples:
    """Sample `group_size` responses for every prompt of the batch; the key derives from (run.seed, step)
    and, for dynamic sampling's refills, the round (`rl.grpo.dapo.round_key`)."""
    group = cfg.grpo.group_size
    prompts = [prompt_ids(r, tokenizer, chat_template=cfg.data.chat_template) for r in records]
    rows = [p for p in prompts for _ in range(group)]
    key = dapo.round_key(cfg.run.seed, step, round)
    out = engine.generate(rows, sampling, key, prompt_width=cfg.generation.max_prompt_tokens)
    return samples_of(out, [r for r in records for _ in range(group)], tokenizer, sampling)


def samples_of(out: Rollout, records: list, tokenizer, sampling: SamplingParams) -> Samples:
    """The rollout `out` of `records` (one per row) with its decoded completions (stop tokens dropped)."""
    stops = set(sampling.stop_token_ids)
    # Special tokens stay in the text: dropping a sampled <sep> would shift the digits after it.
    completions = [tokenizer.decode([int(x) for x in out.tokens[i, :out.lengths[i]] if int(x) not in stops],
                                    skip_special_tokens=False) for i in range(len(records))]
    return Samples(out, [r.answer for r in records], completions, list(records))


def rewards(reward_specs, samples: Samples, *, max_new_tokens: int = 0, overlong_buffer: int = 0,
            overlong_penalty: float = 1.0, scorer: Callable = score_once) -> tuple[np.ndarray, int, dict]:
    """Sum of each configured reward times its weight, per row, how many scorings failed (scored 0), and each
    reward's own values per row (unweighted, by name). One call per reward: each has its own time limit. With
    `overlong_buffer` > 0, DAPO's soft overlong punishment (`rl.grpo.dapo.overlong_penalty`) is added, before
    advantages see the reward."""
    total, failures, parts = scorer(reward_specs, samples.completions, samples.answers, samples.rollout.truncated,
                                    samples.records)  # score_once: process 0 scores, every process gets its values
    if overlong_buffer:
        total += dapo.overlong_penalty(samples.rollout.lengths, max_new_tokens, overlong_buffer, overlong_penalty)
    return total, failures, parts


@dataclasses.dataclass
class Drawn:
    """The groups a step trains on, their rewards, and what it took to get them."""
    samples: Samples
    reward: np.ndarray  # [N], overlong punishment included
    failures: int  # failed scorings over every drawn row
    metrics: dict  # dapo/* (with dynamic sampling), reward/overlong_penalty_mean (with overlong_buffer)
    generate_s: float  # time in the generator over all rounds (the rest of the call was scoring)
    parts: dict = dataclasses.field(default_factory=dict)  # each reward's own values per row [N], by name
    rounds: int = 1  # batches drawn from the loader
    picked: np.ndarray | None = None  # [groups, 2] the (round, group) pairs kept, when rounds > 1
    draw_s: float = 0.0  # the whole call: generation and scoring of every round


def _take(samples: list[Samples], picked: np.ndarray, group: int) -> Samples:
    """The rows of the picked (round, group) pairs, in that order, as one Samples."""
    rows = [(r, g * group + j) for r, g in picked for j in range(group)]
    width = max(s.rollout.tokens.shape[1] for s in samples)  # equal for every engine today; pad if not

    def stack(field):
        out = [getattr(samples[r].rollout, field)[i] for r, i in rows]
        return np.stack([np.pad(x, (0, width - len(x))) for x in out]) if np.ndim(out[0]) else np.asarray(out)

    ro = samples[0].rollout
    def per_token(field):  # [W + T, layers, ...] per row: the same width from every round of one engine
        if all(getattr(s.rollout, field) is not None for s in samples):
            return np.stack([getattr(samples[r].rollout, field)[i] for r, i in rows])
        return None

    rollout_ = dataclasses.replace(ro, prompt_ids=[samples[r].rollout.prompt_ids[i] for r, i in rows],
                                   tokens=stack("tokens"), logprobs=stack("logprobs"), lengths=stack("lengths"),
                                   truncated=stack("truncated"), routes=per_token("routes"),
                                   block_ids=per_token("block_ids"))
    records = None if any(s.records is None for s in samples) else [samples[r].records[i] for r, i in rows]
    return Samples(rollout_, [samples[r].answers[i] for r, i in rows], [samples[r].completions[i] for r, i in rows],
                   records)


def draw(engine: Generator, loader, tokenizer, cfg: RunConfig, sampling: SamplingParams, step: int,
         scorer: Callable = score_once) -> Drawn:
    """Rollout + rewards of one step: one batch of `prompts_per_step` prompts from `loader`, or with
    grpo.dynamic_sampling (DAPO, `rl.grpo.dapo`) further batches, round r sampled with
    round_key(run.seed, step, r), until `prompts_per_step` groups have unequal rewards or
    `dynamic_sampling_max_rounds` batches were drawn. The step keeps the first informative groups in draw
    order; when the rounds run out, the earliest zero-variance groups fill it (`advantages` gives them
    loss weight 0). Every drawn prompt is consumed, so the loader's position after the call (what a
    checkpoint saves) replays exactly. `scorer`: how the rewards are scored (`rl.score_once.score_once`: process 0
    scores, every process receives; a draw on process 0 alone scores there: `rl.shared_draw`)."""
    g = cfg.grpo
    shaping = dict(max_new_tokens=cfg.generation.max_new_tokens, overlong_buffer=g.overlong_buffer,
                   overlong_penalty=g.overlong_penalty, scorer=scorer)
    drawn, rewards_, parts, zero, failures, informative, generate_s = [], [], [], [], 0, 0, 0.0
    t_call = time.perf_counter()
    for r in range(g.dynamic_sampling_max_rounds if g.dynamic_sampling else 1):
        t0 = time.perf_counter()
        drawn.append(rollout(engine, loader.next_batch(), tokenizer, cfg, sampling, step, round=r))
        generate_s += time.perf_counter() - t0
        reward, f, part = rewards(cfg.reward, drawn[-1], **shaping)
        rewards_.append(reward)
        parts.append(part)
        failures += f
        zero.append(np.asarray(adv_lib.zero_variance_groups(jnp.asarray(reward), g.group_size)))
        informative += int((~zero[-1]).sum())
        if informative >= g.prompts_per_step:
            break
    picked = None
    if len(drawn) == 1:  # every group of the one batch, as drawn
        samples, reward, part, kept = drawn[0], rewards_[0], parts[0], int((~zero[0]).sum())
    else:
        picked, kept = dapo.select_groups(zero, g.prompts_per_step)
        samples = _take(drawn, picked, g.group_size)
        rows = lambda per_round: np.concatenate([per_round[r][i * g.group_size:(i + 1) * g.group_size]  # noqa: E731
                                                 for r, i in picked])
        reward = rows(rewards_)
        part = {name: rows([p[name] for p in parts]) for name in parts[0]}
    # each reward's own mean over the step's samples (unweighted; TRL's rewards/<name>/mean)
    metrics = {f"reward/{name}/mean": float(values.mean()) for name, values in part.items()}
    if g.dynamic_sampling:
        every = np.concatenate(rewards_)
        metrics.update({"dapo/rounds": len(drawn), "dapo/prompts_drawn": len(drawn) * g.prompts_per_step,
                        "dapo/kept_groups": kept, "dapo/filled_groups": g.prompts_per_step - kept,
                        # the trained batch leans to informative groups; this is the policy's reward
                        "dapo/reward_mean_drawn": float(every.mean()),
                        "dapo/zero_variance_frac_drawn": float(np.concatenate(zero).mean())})
    if g.overlong_buffer:
        metrics["reward/overlong_penalty_mean"] = float(dapo.overlong_penalty(
            samples.rollout.lengths, cfg.generation.max_new_tokens, g.overlong_buffer, g.overlong_penalty).mean())
    return Drawn(samples, reward, failures, metrics, generate_s, part, len(drawn),
                 None if picked is None else np.asarray(picked, np.int64).reshape(-1, 2), time.perf_counter() - t_call)


@dataclasses.dataclass
class Advantages:
    advantages: np.ndarray  # [N] per row
    weight: np.ndarray  # [N] loss weight: 0 for dropped groups (dynamic sampling) and filtered overlong rows
    zero_variance: np.ndarray  # [groups] groups whose rewards are all equal


def advantages(reward: np.ndarray, truncated: np.ndarray, gcfg) -> Advantages:
    """The configured estimator per group of `group_size` rows, and the rows' loss weights."""
    group = gcfg.group_size
    estimator = adv_lib.get_advantage_estimator(gcfg.advantage)
    adv = np.asarray(estimator(jnp.asarray(reward), group))
    weight = np.ones(len(reward), np.float32)
    dropped = np.asarray(adv_lib.zero_variance_groups(jnp.asarray(reward), group))
    if gcfg.dynamic_sampling:
        weight *= np.repeat(~dropped, group)
    if gcfg.overlong_filter:
        weight *= np.asarray(adv_lib.overlong_mask(jnp.asarray(truncated)))
    return Advantages(adv, weight, dropped)


def train_batch(samples: Samples, adv: Advantages, *, width: int, pad_id: int, num_micro: int,
                updates: int = 1, by_length: bool = False) -> dict:
    """[micro-batches, rows, width - 1] arrays of the step (see `rl.grpo.batch.build_train_batch`); with
    the generator's routes also "routes" [micro-batches, rows, width - 1, n_moe_layers, k] int16, the
    expert ids of each input token (the rollout lays them out as prompt + response, like input_ids), and
    with its key blocks "block_ids" [micro-batches, rows, width - 1, n_sparse_layers, Hi, K] int16 likewise
    (zeros where the width runs past what the rollout covers: only padding sits there).
    by_length: the rows of each of the `updates` mini-batches sorted longest first (`sorted_by_length`), so that
    micro-batches cut to their rows' width (grpo.micro_batch_widths) hold rows of similar lengths."""
    batch = build_train_batch(samples.rollout, adv.advantages, adv.weight, width=width, pad_id=pad_id)
    for field in ("routes", "block_ids"):
        ids = getattr(samples.rollout, field)
        if ids is not None:
            covered = ids.shape[1]
            if covered < width - 1 and batch["attention_mask"][:, covered:].any():
                raise ValueError(f"rollout {field} cover {covered} positions, but tokens sit at up to "
                                 f"{int(batch['attention_mask'].sum(1).max())} of the {width - 1} training positions")
            # past every row's tokens (the tail a context-parallel width is rounded up by) nothing reads them
            ids = np.asarray(ids[:, :width - 1])
            batch[field] = np.pad(ids, [(0, 0), (0, width - 1 - ids.shape[1])] + [(0, 0)] * (ids.ndim - 2))
    if by_length:
        batch = sorted_by_length(batch, updates)
    return split_micro(batch, num_micro)


def width_metrics(micro: dict, widths) -> dict:
    """batch/real_frac: the share of the step's row positions that hold real tokens; batch/computed_frac: the
    share the passes compute, with micro-batches cut to `widths` (grpo.micro_batch_widths; 1 without)."""
    mask = np.asarray(micro["attention_mask"])
    computed = sum(micro_widths(mask, widths)) / (mask.shape[0] * mask.shape[-1]) if widths else 1.0
    return {"batch/real_frac": float(mask.sum() / mask.size), "batch/computed_frac": float(computed)}


def sorted_by_length(batch: dict, updates: int) -> dict:
    """Rows [N, ...] reordered longest first (real positions: attention_mask) within each of `updates` equal
    consecutive slices, which stay the updates' mini-batches. Which rows share a micro-batch changes only the
    order of the step's sums (the loss and its normaliser are sums over rows and tokens), except for the terms that
    pick tokens per micro-batch: grpo.high_entropy_fraction's entropy quantile and kl_cov's / clip_cov's token
    shares then choose among rows of similar length, so those runs train otherwise than without widths."""
    lengths = np.asarray(batch["attention_mask"]).sum(-1)
    per = len(lengths) // updates
    order = np.concatenate([u * per + np.argsort(-lengths[u * per:(u + 1) * per], kind="stable")
                            for u in range(updates)])
    return {k: np.asarray(v)[order] for k, v in batch.items()}


REPLAYED = ("routes", "block_ids")  # the generator's choices a pass may replay (grpo.routing / indexer_replay)


def logprobs(logprob_pass: Callable, state, micro: dict, ref_params=None, old: bool = True,
             ref_pass: Callable | None = None) -> dict:
    """`micro` with logp_old under the current weights (and logp_ref under the reference, for a KL, with the
    reference's own expert routes and key blocks, through `ref_pass`: by default `logprob_pass`).
    When `micro` has the generator's "routes" / "block_ids", the pass also gives the trainer's own top-k
    expert ids / key blocks, kept under "trainer_routes" / "trainer_block_ids" for `route_metrics`.
    old=False (grpo.old_logprobs: update): no logp_old pass; the update is its own logp_old."""
    micro = dict(micro)
    if old:
        out = logprob_pass(state.params, state.rest, micro)
        if isinstance(out, tuple):
            out, own = out
            micro.update({f"trainer_{k}": v for k, v in own.items()})
        micro["logp_old"] = out
    if ref_params is not None:
        # the reference scores with its own router and indexer: replaying the generator's choices would score a
        # teacher (grpo.reference_path) on the student's experts and key blocks, not as itself
        ref = (ref_pass or logprob_pass)(ref_params, state.rest, {k: v for k, v in micro.items() if k not in REPLAYED})
        micro["logp_ref"] = ref[0] if isinstance(ref, tuple) else ref
    jax.block_until_ready([micro[k] for k in ("logp_old", "logp_ref") if k in micro])
    return micro


def _on_host(x):
    """x as a numpy array on every process: a multi-host run's global array is gathered (a collective every
    process calls, as every process runs the step)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def route_metrics(micro: dict, replay: bool, indexer_replay: bool = False, in_update: bool = False
                  ) -> tuple[dict, dict]:
    """(micro-batches for the update, metrics): moe/route_mismatch_frac (`rl.grpo.mismatch`) of the
    trainer's own top-k vs the generator's routes, and indexer/selection_mismatch_frac of the trainer's
    indexer's own top-K key blocks vs the generator's, over the real input tokens, each when both are
    there. The update keeps "routes" / "block_ids" only when it replays them (`replay` / `indexer_replay`),
    so without replay it is today's program. in_update (grpo.old_logprobs: update, no pass gave the trainer's
    own ids): the update keeps them all and compares them itself (`rl.policy.grpo_loss_fn`; metrics from its sums,
    `step_metrics`)."""
    if in_update:
        return dict(micro), {}
    micro, metrics = dict(micro), {}
    for field, keep, what in (("routes", replay, "[B, S, L, k]"), ("block_ids", indexer_replay, "[B, S, L, Hi, K]")):
        name = ID_MISMATCH_METRICS[field]
        trainer = micro.pop(f"trainer_{field}", None)
        generator = micro[field] if keep and field in micro else micro.pop(field, None)
        if trainer is None or generator is None or not np.size(generator):  # no MoE / sparse layer: nothing to compare
            continue
        if np.ndim(generator) != what.count(",") + 2:  # micro-batches of `what`
            raise ValueError(f"trainer {field} {np.shape(trainer)} and generator {field} {np.shape(generator)}: "
                             f"expected micro-batches of {what}")
        sums = _micro_mismatch_sums(trainer, _beside(trainer, generator), _beside(trainer, micro["attention_mask"]))
        metrics[name] = float(mismatch_fraction(*sums))
    return micro, metrics


@jax.jit
def _micro_mismatch_sums(trainer, generator, mask):
    """`id_mismatch_sums` of each micro-batch [M, B, S, ...], summed: computed where the trainer's ids are, so only
    the two sums leave the devices (the ids gathered onto every host were 3.8 GB of routes and, with the JAX engine,
    61 GB of key blocks per device at the 32-node recipe's batch)."""
    differ, entries = jax.vmap(id_mismatch_sums)(trainer, generator, mask)
    return differ.sum(), entries.sum()


def _beside(trainer, value):
    """A host value of the micro-batches (the generator's ids, the mask) on the trainer's ids' devices: each process
    places its own rows (`place_host_value`); on one device, as it is."""
    sharding = getattr(trainer, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return value
    return place_host_value(np.asarray(value), NamedSharding(sharding.mesh, P(*sharding.spec[:np.ndim(value)])))


def indexer_recall(recall_pass: Callable, state, micro: dict) -> dict:
    """indexer/recall (the mean over sparse layers) and indexer/recall/layer_{j} (sparse layer j) on a sample:
    the step's first micro-batch (its rows' real tokens: attention_mask), under the weights the step
    starts from. Each layer's figure is the share of its full attention's probability mass (no indexer
    mask) in the key blocks its own indexer selects (`m3jax.model.recall`). Empty without sparse layers."""
    sample = {k: np.asarray(micro[k][0]) for k in ("input_ids", "attention_mask")}
    recall = np.asarray(_on_host(recall_pass(state.params, state.rest, sample)), np.float64).reshape(-1)
    if not recall.size:
        return {}
    per_layer = {f"indexer/recall/layer_{j}": float(r) for j, r in enumerate(recall)}
    return {"indexer/recall": float(recall.mean()), **per_layer}


def moe_drops(counts_pass: Callable, state, micro: dict, replay: bool) -> dict:
    """moe/dropped_frac (over every MoE layer) and moe/dropped_frac/layer_{j} (MoE layer j) on the step's first
    micro-batch, under the weights the step starts from: the share of its real tokens' (token, expert)
    assignments that model.moe_capacity_factor dropped, 1 - kept / real (`M3ForCausalLM.moe_assignment_counts`),
    as that micro-batch's logprob pass and update drop them (the same buffers and padding; replay: of the
    generator's routes, which the update replays). Empty without MoE layers."""
    keys = ("input_ids", "attention_mask") + (("routes",) if replay and "routes" in micro else ())
    sample = {k: np.asarray(micro[k][0]) for k in keys}
    counts = np.asarray(_on_host(counts_pass(state.params, state.rest, sample)), np.int64).reshape(-1, 2)
    if not counts.size:
        return {}
    share = lambda kept, real: float(1.0 - kept / real) if real else 0.0  # noqa: E731
    per_layer = {f"moe/dropped_frac/layer_{j}": share(*c) for j, c in enumerate(counts)}
    return {"moe/dropped_frac": share(*counts.sum(0)), **per_layer}


@dataclasses.dataclass
class UpdateStats:
    loss: float
    grad_norm: float  # the policy's: what the optimizer clips it by
    skipped: int  # updates skipped for a non-finite gradient
    sums: dict  # the loss's metric sums (tokens, clipped tokens, ...) over the step
    grad_norm_apart: float | None = None  # the parameters clipped on their own (the indexer), when there are any
    empty: int = 0  # updates held for want of a learning signal (no loss token, or a gradient of exactly 0)


def update(train_step: Callable, state, micro: dict, updates: int):
    """`updates` optimizer steps over consecutive slices of the micro-batches -> (state, UpdateStats)."""
    num_micro = next(iter(micro.values())).shape[0]
    sums, losses, norms, apart, skipped, empty = {}, [], [], [], 0, 0
    for u in range(updates):
        part = jax.tree.map(lambda x: x[u * num_micro // updates:(u + 1) * num_micro // updates], micro)
        state, m = train_step(state, part)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        if "grad_norm_apart" in m:
            apart.append(float(m["grad_norm_apart"]))
        skipped += int(m["skipped"])
        empty += int(m["empty"])
        sums = {k: sums.get(k, 0.0) + float(v) for k, v in m["sums"].items()}
    return state, UpdateStats(float(np.mean(losses)), float(np.mean(norms)), skipped, sums,
                              float(np.mean(apart)) if apart else None, empty)


def step_metrics(samples: Samples, reward: np.ndarray, failures: int, adv: Advantages, micro: dict,
                 stats: UpdateStats, lr: float, phases: dict, elapsed: float) -> dict:
    """What one step logs: reward, groups, lengths, loss diagnostics, generator mismatch, throughput."""
    n = len(samples.completions)
    out = samples.rollout
    sums = stats.sums
    ids = {}  # the route / selection mismatch, here only when the update compared them (else `route_metrics`)
    if "logp_old" in micro:
        mism = generation_mismatch_metrics(micro["logp_gen"].reshape(n, -1), micro["logp_old"].reshape(n, -1),
                                           micro["loss_mask"].reshape(n, -1) > 0)
    else:  # the update was its own logp_old (grpo.old_logprobs: update) and summed the mismatch itself
        mism, ids = mismatch_from_sums(sums), id_mismatch_from_sums(sums)
    # the per-loss-token figures of a step with no loss token (every row at weight 0) are NaN, as the mismatch
    # diagnostics are: a 0 read as an entropy collapse or a policy that stopped clipping
    tokens = sums.get("tokens", 0.0) or float("nan")
    return {
        "reward/mean": float(reward.mean()), "reward/std": float(reward.std()), "reward/failures": failures,
        "groups/zero_variance_frac": float(adv.zero_variance.mean()),
        "response/length_mean": float(out.lengths.mean()), "response/truncated_frac": float(out.truncated.mean()),
        "loss": stats.loss, "grad_norm": stats.grad_norm, "skipped_updates": stats.skipped,
        "empty_updates": stats.empty,  # held: no learning signal (no loss token, or a gradient of 0: train_step)
        "clip_frac": sums.get("clipped_tokens", 0.0) / tokens,
        "dual_clip_frac": sums.get("dual_clipped_tokens", 0.0) / tokens,
        # w outside [is_mask_low, is_mask_high], in every mode: what "mask" zeroes ("truncate" acts at is_cap / floor)
        "is_out_of_band_frac": sums.get("is_out_of_band_tokens", 0.0) / tokens,
        "is/truncated_frac": sums.get("is_truncated_tokens", 0.0) / tokens,  # w > is_cap, lowered to it
        "is/floored_frac": sums.get("is_floored_tokens", 0.0) / tokens,  # w < is_floor, raised to it
        "is/inf_frac": sums.get("is_inf_tokens", 0.0) / tokens,  # non-finite logp_gen: weight 0 (rl.grpo.importance)
        # outside the trainer's own top-k / top-p (logp or logp_old -inf): no loss (rl.grpo.loss); a share of the loss
        # tokens they were before being left out (`tokens` counts those that kept theirs)
        "is/trainer_inf_frac": sums.get("trainer_inf_tokens", 0.0) / (
            sums.get("tokens", 0.0) + sums.get("trainer_inf_tokens", 0.0) or float("nan")),
        "kl": sums.get("kl_sum", 0.0) / tokens, "entropy_approx": sums.get("neg_logp_sum", 0.0) / tokens,
        **({"entropy": sums["entropy_sum"] / tokens} if "entropy_sum" in sums else {}),  # exact (logging.entropy)
        **({"low_entropy_frac": sums["low_entropy_tokens"] / tokens} if "low_entropy_tokens" in sums else {}),
        # outside the reference's own top-k / top-p (logp_ref -inf): no KL term (rl.grpo.loss)
        **({"kl/ref_inf_frac": sums["ref_inf_tokens"] / tokens} if "ref_inf_tokens" in sums else {}),
        **({"indexer/align_kl": sums["indexer_kl_sum"] / tokens} if "indexer_kl_sum" in sums else {}),
        # the indexer's gradient (alignment loss only), clipped by its own norm (sharding.optim_step.clip_by_group_norms)
        **({"indexer/grad_norm": stats.grad_norm_apart} if stats.grad_norm_apart is not None else {}),
        "gen_kl_error": float(mism["gen_kl_error"]), "token_mult_prob_error": float(mism["token_mult_prob_error"]),
        **ids,
        "lr": lr,
        "throughput/tokens_per_s": int(out.lengths.sum()) / max(elapsed, 1e-9),
        **{f"time/{p}": v for p, v in phases.items()},
    }
