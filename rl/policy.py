"""The policy being trained: the model on the run's layout, its optimizer and train state, and the two
jitted passes over it (the GRPO update and the logprob pass; and the indexer-recall diagnostic). No data,
no engines: exporting a checkpoint builds only this.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import m3jax
from m3jax.model.expert_tuning import RECORD_FILE, expert_work, needs_timing, tune_moe_kernel
from m3jax.model.specs import weight_decay_mask
from rl import checkpoint as ckpt_lib
from rl.checkpoint_keep import chosen_step
from rl.config import ConfigError, RunConfig, checkpoint_dir
from rl.generation.backends import model_end_tokens, sampling_of
from rl.generation.base import SamplingParams
from rl.grpo.loss import LossConfig, aggregate, grpo_loss, normalizer
from rl.grpo.mismatch import ID_MISMATCH_METRICS, MISMATCH_SUMS, generation_mismatch_metrics, id_mismatch_sums
from rl.logprobs import make_logprob_pass, policy_logprobs
from rl.resume_checks import check_model, restore_naming_changes, trained_under
from sharding import optim_step
from sharding.host_values import place_host_value
from sharding.layout import Layout
from sharding.mesh import build_mesh, row_positions, sequence_multiple
from sharding.train_step import (TrainState, abstract_state, batch_sharding, init_state, make_train_step,
                                 state_shardings)
from sharding.widths import check_widths

log = logging.getLogger(__name__)


def learning_rate(cfg: RunConfig):
    """optim.lr after `warmup_steps` of linear warm-up, then constant, linear or cosine decay to 0 at
    run.total_steps."""
    o = cfg.optim
    if o.schedule == "constant":
        after = optax.constant_schedule(o.lr)
    else:
        decay = max(cfg.run.total_steps - o.warmup_steps, 1)
        after = (optax.linear_schedule(o.lr, 0.0, decay) if o.schedule == "linear"
                 else optax.cosine_decay_schedule(o.lr, decay))
    if not o.warmup_steps:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, o.lr, o.warmup_steps), after], [o.warmup_steps])


def update_learning_rate(cfg: RunConfig):
    """`learning_rate` as the optimizer counts: its schedule's count is optimizer updates applied,
    `grpo.updates_per_step` of them per step, so update c runs at learning_rate(c // updates_per_step). (Counting
    updates as steps ran warm-up and decay updates_per_step times too fast: at 2, the run's second half at lr 0.)
    A skipped update (non-finite gradient) does not count, as in Megatron: the schedule waits for it; nor does one
    held for want of a learning signal (no loss token, or a gradient of exactly 0: `sharding.train_step`)."""
    per_step = cfg.grpo.updates_per_step
    steps = learning_rate(cfg)
    return steps if per_step == 1 else (lambda count: steps(count // per_step))


def applied_learning_rate(cfg: RunConfig, state) -> float:
    """The learning rate of the next update of `state` (a TrainState: `step` counts updates run, `skipped` those
    skipped): what a step that starts from `state` trains with, as the optimizer's schedule computes it."""
    run, skipped = (int(x) for x in jax.device_get((state.step, state.skipped)))
    return float(update_learning_rate(cfg)(run - skipped))


def sequence_width(cfg: RunConfig, model_cfg: m3jax.M3Config) -> int:
    """Token slots of every training row: its positions (`training_positions`) + 1 for the last target."""
    return training_positions(cfg, model_cfg) + 1


def training_positions(cfg: RunConfig, model_cfg: m3jax.M3Config) -> int:
    """Input positions of every training row, P = ceil((max_prompt_tokens + max_new_tokens - 1) / m) x m.

    Position t predicts token t + 1, so prompt + response need one position fewer than their slots. With
    context parallelism (mesh.context = c > 1) each shard must hold whole indexer blocks, m = c x
    `model_cfg.context_block_size()` (else m = 1): 4096 slots on context 2 with blocks of 128 give P = 4096,
    not 4095, which no such mesh could split. The rounded-up tail is padding (attention and loss masks 0)."""
    return row_positions(cfg.generation.max_seq_len, cfg.mesh, model_cfg)


@dataclasses.dataclass
class Policy:
    cfg: RunConfig
    layout: Layout
    graphdef: Any
    state: TrainState
    optimizer: optax.GradientTransformation
    shardings: TrainState | None  # None on one device
    sampling: SamplingParams
    model_cfg: m3jax.M3Config
    # cfg.model's M3ForCausalLM options as the model was built with them (moe_kernel resolved: `model_options`)
    model_options: dict = dataclasses.field(default_factory=dict)

    def model(self) -> m3jax.M3ForCausalLM:
        """The model with the current parameters (a view: nothing is copied)."""
        return nnx.merge(self.graphdef, self.state.params, self.state.rest)

    def place(self, state: TrainState) -> TrainState:
        """`state` on the run's shardings (a restored checkpoint arrives wherever orbax put it); on one device,
        committed to it (`one_device`)."""
        return one_device(state) if self.shardings is None else jax.device_put(state, self.shardings)

    def export(self, path: str) -> str:
        """The policy as a HF directory in checkpoint.export_layout; a released export carries the vision tower of
        the checkpoint the run started from (model.path), so it serves as the multimodal model it came from."""
        return m3jax.save_pretrained(self.model(), path, layout=self.cfg.checkpoint.export_layout,
                                     carry_from=self.cfg.model.path or None)


def model_options(cfg: RunConfig, m3_cfg: m3jax.M3Config, layout: Layout, kernel_timing: str = "record",
                  kernel_headroom: int | None = None) -> dict:
    """cfg.model's M3ForCausalLM options, with `moe_kernel` "tune" (and "auto" off a CPU) replaced by the kernel
    timed fastest on this device for the train step's widest micro-batch (`m3jax.model.expert_tuning`).
    kernel_timing: "record" (the trainer's: read the choice from the run directory's record when it was measured
    for this device kind and these shapes, else time it and write the record), "read" (the same without
    writing: an evaluation must not change the choice a resumed run reads), "off" (a model that will not run,
    an export: the model's static rule). kernel_headroom: the device memory the run's plan leaves free with the tiled
    kernel (`m3jax.train` asks the planner), which a timed kernel's extra temporaries may not exceed."""
    if kernel_timing not in ("record", "read", "off"):
        raise ValueError(f"kernel_timing {kernel_timing!r}: expected record, read or off")
    options = cfg.model.model_options()
    if "sparse" not in m3_cfg.mlp_layer_types or not needs_timing(options["moe_kernel"], layout.backend):
        return options
    if kernel_timing == "off":
        return {**options, "moe_kernel": "auto"}
    work = expert_work(m3_cfg, layout, cfg.grpo.micro_batch_size, training_positions(cfg, m3_cfg),
                       cfg.precision.param_dtype, capacity_factor=cfg.model.moe_capacity_factor)
    kernel = tune_moe_kernel(m3_cfg, work, os.path.join(cfg.run.out_dir, RECORD_FILE),
                             save=kernel_timing == "record", headroom=kernel_headroom)
    return {**options, "moe_kernel": kernel}


def one_device(state):
    """`state` committed to jax's first device, where a restore puts it (`sharding.train_step.abstract_state`). A fresh
    state's arrays were uncommitted and a restored one's committed, so the programs they went into differed (the
    parameters' sharding propagation) and the first resume of a one-device run missed the persistent compilation
    cache: every program compiled again (a soak run: 85 cache entries, 129 after it)."""
    return jax.device_put(state, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def build_policy(cfg: RunConfig, kernel_timing: str = "record", kernel_headroom: int | None = None,
                 abstract: bool = False) -> Policy:
    """Layout (mesh + rules, experts on mesh.expert_axes), model (from model.path or freshly initialised
    on that layout, its expert kernel resolved by `model_options`), optimizer and train state placed on the
    layout's shardings. kernel_timing, kernel_headroom: as `model_options`'s.
    abstract: the train state as shapes, dtypes and shardings only (`jax.ShapeDtypeStruct` leaves), for a caller that
    restores a checkpoint into it (an export, an evaluation): nothing is read from model.path nor initialised. Built
    in full, the state was held twice at the restore: an export of a 0.95 GB model peaked at 5x its parameters on the
    host (BENCHMARKS.md, host memory audit)."""
    dtype = jnp.dtype(cfg.precision.param_dtype)
    m = cfg.mesh
    m3_cfg = cfg.model.m3_config()
    try:  # the multiple needs the model's block size: known here, not when the config loads
        check_widths(cfg.grpo.micro_batch_widths, sequence_multiple(m, m3_cfg), "grpo.micro_batch_widths")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    layout = Layout() if m.num_devices == 1 else build_mesh(m.to_mesh_config(), m3_cfg,
                                                            seq_len=training_positions(cfg, m3_cfg))
    options = model_options(cfg, m3_cfg, layout, kernel_timing, kernel_headroom)
    if abstract:
        model = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(m3_cfg, dtype=dtype, rngs=nnx.Rngs(0), layout=layout,
                                                           **options))
    elif cfg.model.path:
        model = m3jax.from_pretrained(cfg.model.path, dtype=dtype, mesh=layout, **options)
    else:
        model = m3jax.M3ForCausalLM(m3_cfg, dtype=dtype, rngs=nnx.Rngs(cfg.model.init_seed), layout=layout, **options)
    o = cfg.optim
    lm_gradient = weight_decay_mask(model.cfg, nnx.state(model, nnx.Param))
    optimizer = optim_step.adamw(update_learning_rate(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                                 clip_norm=o.clip_norm, moment_dtype=jnp.dtype(cfg.precision.moment_dtype),
                                 master=cfg.precision.master,
                                 # parameters without an LM gradient (the indexer): never decayed, and
                                 # clipped by their own norm so the alignment loss cannot shrink the policy's step
                                 decay_mask=lm_gradient, clip_mask=lm_gradient)
    if abstract:
        graphdef, state = abstract_state(model, optimizer, layout)
    else:
        graphdef, state = init_state(model, optimizer)
    shardings = None
    if layout.mesh is not None:
        shardings = state_shardings(layout, state)
        state = state if abstract else jax.tree.map(place_host_value, state, shardings)
    elif not abstract:
        state = one_device(state)
    return Policy(cfg, layout, graphdef, state, optimizer, shardings,
                  sampling_of(cfg, model_end_tokens(cfg.model, model.cfg.eos_token_id)),
                  model.cfg, options)


def grpo_loss_fn(sampling: SamplingParams, loss_cfg: LossConfig, chunk_tokens: int = 0,
                 replay: bool = False, indexer_replay: bool = False, indexer_loss_coef: float = 0.0,
                 log_entropy: bool = False) -> Callable:
    """loss_fn(model, micro_batch) -> (summed GRPO loss, metric sums) for `sharding.train_step`.
    chunk_tokens: positions per logits block (`rl.logprobs.policy_logprobs`; 0 = full logits).
    replay: routing replay of the micro-batch's "routes" (the generator's MoE expert ids), when it has them.
    indexer_replay: indexer selection replay of its "block_ids" (the generator's key blocks), when it has them.
    indexer_loss_coef > 0: adds coef x the indexer alignment KL of each response position (`aggregate`d as
    the GRPO loss is, so the step's normaliser applies to both) and its sum as "indexer_kl_sum"; its
    gradient reaches only the indexer (`m3jax.model.indexer_align`). The exact entropy of the sampling
    distribution at each position comes with logp when the loss reads it (`LossConfig.needs_entropy`: the
    bonus, the high-entropy token selection) or log_entropy; its sum is "entropy_sum"."""
    align = indexer_loss_coef > 0
    with_entropy = loss_cfg.needs_entropy or log_entropy

    def loss_fn(model, mb):
        # without a logprob pass (grpo.old_logprobs: update) logp_old is this update's own log-probs, and the update
        # compares its own expert / key-block choices with the generator's, where the batch carries them
        own = "logp_old" not in mb
        compared = [f for f in ID_MISMATCH_METRICS if own and f in mb]
        out = policy_logprobs(model, mb, sampling, chunk_tokens, replay=replay and "routes" in mb,
                              return_routes="routes" in compared, replay_blocks=indexer_replay and "block_ids" in mb,
                              return_block_ids="block_ids" in compared, return_indexer_kl=align,
                              return_entropy=with_entropy)
        logp, *extra = out if isinstance(out, tuple) else (out,)
        entropy = extra.pop(0) if with_entropy else None
        indexer_kl = extra.pop() if align else None
        logp_old = jax.lax.stop_gradient(logp) if own else mb["logp_old"]
        loss_sum, stats = grpo_loss(logp, logp_old, mb["logp_gen"], mb["advantages"], mb["loss_mask"],
                                    loss_cfg, mb.get("logp_ref"), entropy)
        if own:  # the generator-mismatch sums the step's metrics would have read from the pass's logp_old
            mism = generation_mismatch_metrics(mb["logp_gen"], logp_old, mb["loss_mask"] > 0)
            stats = {**stats, **{f"mismatch/{k}": mism[k] for k in MISMATCH_SUMS}}
        for field, trainer_ids in zip(compared, extra):  # over the real input tokens, as `phases.route_metrics`
            differ, entries = id_mismatch_sums(trainer_ids, mb[field], mb["attention_mask"])
            name = ID_MISMATCH_METRICS[field]
            stats = {**stats, f"{name}/differ": differ, f"{name}/entries": entries}
        if align:
            m = mb["loss_mask"].astype(jnp.float32)
            loss_sum = loss_sum + indexer_loss_coef * aggregate(indexer_kl, m, loss_cfg.aggregation)
            stats = {**stats, "indexer_kl_sum": jnp.sum(m * jax.lax.stop_gradient(indexer_kl))}
        return loss_sum, stats

    return loss_fn


def make_update(policy: Policy, loss_cfg: LossConfig) -> Callable:
    """update(state, micro_batches) -> (state, metrics): the jitted GRPO train step on the run's layout,
    normalised by the step's token count as `loss_cfg.aggregation` says."""
    return make_train_step(
        policy.graphdef, policy.optimizer,
        grpo_loss_fn(policy.sampling, loss_cfg, policy.cfg.model.logprob_chunk_tokens,
                     policy.cfg.grpo.routing_replay == "rollout", policy.cfg.grpo.indexer_replay == "rollout",
                     policy.cfg.model.indexer_loss_coef, policy.cfg.logging.entropy),
        mesh=policy.layout,
        shardings=policy.shardings,
        widths=policy.cfg.grpo.micro_batch_widths,
        normalizer=lambda b: normalizer(b["loss_mask"].reshape(-1, b["loss_mask"].shape[-1]), loss_cfg))


def make_logprobs(policy: Policy, sampling=None) -> Callable:
    """logprobs(params, rest, micro_batches) -> logp: the same forward and sampling transform as the loss (`sampling`:
    another transform instead of the run's)."""
    sampling = policy.sampling if sampling is None else sampling
    return make_logprob_pass(policy.graphdef, sampling, policy.layout, policy.cfg.model.logprob_chunk_tokens,
                             replay=policy.cfg.grpo.routing_replay == "rollout",
                             indexer_replay=policy.cfg.grpo.indexer_replay == "rollout",
                             widths=policy.cfg.grpo.micro_batch_widths)


def make_indexer_recall(policy: Policy) -> Callable:
    """recall(params, rest, sample) -> [n_sparse_layers] fp32 (a jax array): each sparse layer's indexer recall
    (`M3ForCausalLM.indexer_recall`) over the real tokens of sample {"input_ids", "attention_mask"} [rows, seq].
    A jitted program of its own, run outside the train step and the logprob pass (whose programs it leaves
    as they are). On a mesh the sample is placed as the logprob pass places a micro-batch (rows padded to
    the batch axes with attention_mask 0, which the recall does not count); the result is replicated."""
    return _sample_pass(policy, "indexer_recall")


def make_moe_counts(policy: Policy) -> Callable:
    """counts(params, rest, sample) -> [n_moe_layers, 2] int32 (a jax array): per MoE layer, (kept, real) of
    the (token, expert) assignments of sample {"input_ids", "attention_mask"} [rows, seq]'s real tokens
    (`M3ForCausalLM.moe_assignment_counts`): real - kept are those model.moe_capacity_factor dropped; with
    sample["routes"] [rows, seq, n_moe_layers, k] (routing replay) of those expert ids. Placed and run as
    `make_indexer_recall`'s pass (the padding rows it adds on a mesh are not real tokens)."""
    return _sample_pass(policy, "moe_assignment_counts")


def _sample_pass(policy: Policy, method: str) -> Callable:
    """fn(params, rest, sample) -> the model's `method`(input_ids, attention_mask=...) of the sample, jitted."""
    graphdef, layout = policy.graphdef, policy.layout

    @jax.jit
    def run(params, rest, input_ids, attention_mask, *routes):
        model = nnx.merge(graphdef, params, rest)
        return getattr(model, method)(input_ids, attention_mask=attention_mask, **dict(zip(("routes",), routes)))

    def sample_pass(params, rest, sample: dict):
        arrays = [np.asarray(sample[k]) for k in ("input_ids", "attention_mask", "routes") if k in sample]
        if layout.mesh is None:
            return run(params, rest, *arrays)
        extra = -arrays[0].shape[0] % layout.size("act_batch")
        if extra:
            arrays = [np.pad(a, ((0, extra),) + ((0, 0),) * (a.ndim - 1)) for a in arrays]
        where = NamedSharding(layout.mesh, P(*batch_sharding(layout).spec[1:3]))
        with jax.set_mesh(layout.mesh):
            return run(params, rest, *(place_host_value(a, where) for a in arrays))

    sample_pass.jitted = run
    return sample_pass


def build_or_restore_policy(cfg: RunConfig, checkpointer: ckpt_lib.Checkpointer, kl: str,
                            kernel_headroom: int | None = None) -> tuple[Policy, tuple | None]:
    """The policy, and the (state, meta) of the checkpoint restored into it (None: not restored here). A run that
    resumes builds its state by shape and restores the checkpoint into it before the engine and the reference are
    made from it: built in full, the state was held twice at the restore (a 0.95 GB model's resume peaked at 4.9x
    its parameters on the host). A KL reference of the starting weights (kl not "none", no grpo.reference_path)
    needs them built: such a run builds them, and the trainer restores in its `resume`."""
    abstract = bool(checkpointer.job_steps()) and (kl == "none" or bool(cfg.grpo.reference_path))
    policy = build_policy(cfg, kernel_headroom=kernel_headroom, abstract=abstract)
    if not abstract:
        return policy, None
    got = restore_naming_changes(lambda: checkpointer.restore_latest(policy.state), checkpointer, trained_under(cfg))
    if got is None:
        raise checkpointer.none_reads()
    policy.state = policy.place(got[0])
    return policy, (policy.state, got[1])


def checkpointer_for(cfg: RunConfig) -> ckpt_lib.Checkpointer:
    return ckpt_lib.Checkpointer(checkpoint_dir(cfg), keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save,
                                 keep_best=cfg.checkpoint.keep_best)


def export_latest(cfg: RunConfig, path: str | None = None, step: int | str | None = None) -> tuple[int, str]:
    """Write the newest checkpoint's policy (or checkpoint `step`'s; "best": the best evaluation's, which
    checkpoint.keep_best kept: rl.checkpoint_keep.chosen_step) as a HF directory (default `<run.out_dir>/export`),
    building only the model and its checkpoint reader: no data, no generation engines. Returns (step, path). A
    destination that holds anything but an earlier export (the run directory itself, say), or a step without a
    checkpoint, is refused before the model is built."""
    from m3jax.hf.save import check_destination
    path = check_destination(path or os.path.join(cfg.run.out_dir, "export"), [cfg.run.out_dir, cfg.model.path])
    checkpoints = os.path.abspath(checkpoint_dir(cfg))
    if os.path.commonpath([path, checkpoints]) == checkpoints:  # a resume took it for a damaged step, set aside
        raise FileExistsError(f"destination {path} is inside the run's checkpoints directory {checkpoints}, where "
                              "the next resume would take it for a damaged checkpoint: choose another directory")
    # a reader: nothing in the run directory is created, moved or deleted (it may be read-only)
    checkpointer = ckpt_lib.Checkpointer(checkpoint_dir(cfg), async_save=False, read_only=True)
    try:
        step = chosen_step(checkpointer, step, " to export")
        policy = build_policy(cfg, kernel_timing="off", abstract=True)
        got = (checkpointer.restore_latest(policy.state, params_only=True) if step is None
               else checkpointer.restore_step(step, policy.state, params_only=True))
    finally:
        checkpointer.close()
    if got is None:
        raise FileNotFoundError(f"no checkpoint to export in {checkpointer.directory}")
    policy.state, meta = got  # placed by the restore (the target's shardings); the optimizer state by shape only
    check_model(meta, cfg, f"checkpoint step {meta['step']} in {checkpointer.directory}", "export")
    return int(meta["step"]), policy.export(path)


def reference_params(cfg: RunConfig, policy: Policy):
    """The KL reference's params: the starting weights (the policy's own, before any update), or the HF checkpoint
    `grpo.reference_path` (a teacher: on-policy distillation with grpo.kl k2 and the task reward at weight 0),
    loaded on the policy's layout in its dtype. A checkpoint whose params differ from the policy's in names, shapes
    or dtypes is refused, naming the first difference."""
    path = cfg.grpo.reference_path
    if not path:
        return policy.state.params
    model = m3jax.from_pretrained(path, dtype=jnp.dtype(cfg.precision.param_dtype), mesh=policy.layout,
                                  **policy.model_options)
    teacher = nnx.state(model, nnx.Param)
    want = dict(nnx.to_flat_state(policy.state.params))
    got = dict(nnx.to_flat_state(teacher))
    for key in sorted(set(want) | set(got), key=str):
        a, b = want.get(key), got.get(key)
        name = "/".join(map(str, key))
        if a is None or b is None:
            raise ValueError(f"grpo.reference_path = {path!r}: parameter {name} is "
                             f"{'only in the reference' if a is None else 'missing from it'}; the reference must "
                             "have the policy's architecture (model config)")
        a, b = a.get_value(), b.get_value()
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"grpo.reference_path = {path!r}: parameter {name} is {b.dtype}{list(b.shape)}, the "
                             f"policy's {a.dtype}{list(a.shape)}; the reference must have the policy's shapes")
    return teacher if policy.shardings is None else jax.device_put(teacher, policy.shardings.params)
