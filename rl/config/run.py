"""`RunConfig`: the whole run, its sections from `rl.config.schema`, validated on construction by
`rl.config.validate` (this module sits above both, so neither imports the other back)."""

from __future__ import annotations

import dataclasses

from rl.config.errors import ConfigError
from rl.config.eval_section import EvalSection
from rl.config.grpo_section import GrpoSection
from rl.config.model_section import ModelSection
from rl.config.schema import (CheckpointSection, DataSection, GenerationSection, LoggingSection,
                              MeshSection, OptimSection, PrecisionSection, RewardSpec, RunSection,
                              _f, _Section)
from rl.config.validate import _problems


@dataclasses.dataclass(frozen=True)
class RunConfig(_Section):
    """The whole run: validated on construction (every problem at once, as ConfigError).

    run         name, out_dir, seed, total_steps, max_wall_minutes, hang_timeout_minutes, start_timeout_minutes,
                compilation_cache
    model       path | tiny (M3Config fields, or {preset: release, ...}), init_seed, remat, remat_policy,
                attention_query_chunk, attention_impl, sparse_attention, logprob_chunk_tokens, indexer_loss_coef,
                moe_capacity_factor, moe_kernel
    mesh        data, context, expert, tensor, expert_axes, fsdp_axes, fsdp_step_axes, coordinator_address,
                num_processes, process_id,
                device_memory_fraction
    precision   master, moment_dtype
    optim       lr, schedule, warmup_steps, weight_decay, b1, b2, eps, clip_norm, stop_after_skipped_steps
    grpo        prompts_per_step, group_size, micro_batch_size, updates_per_step, old_logprobs, advantage, loss,
                eps_low, eps_high, dual_clip, gspo_eps_low, gspo_eps_high, cispo_eps_low, cispo_eps_high,
                is_correction, is_level, is_cap, is_floor, is_mask_low, is_mask_high, kl, kl_coef,
                kl_log_ratio_clamp, kl_clamp, kl_on_policy, aggregation, sequence_sum_len, dynamic_sampling,
                dynamic_sampling_max_rounds, overlong_filter, overlong_buffer, overlong_penalty
    generation  backend, max_new_tokens, max_prompt_tokens, temperature, top_p, top_k, stop_token_ids,
                vllm_tensor_parallel, vllm_expert_parallel, vllm_executor, vllm_servers, vllm_gpu_memory_utilization,
                vllm_dtype, vllm_ray_address, vllm_request_timeout_s, vllm_max_restarts, weight_transport,
                weight_group_device, weight_bucket_mb, verify_probes, verify_max_abs_diff
    data        kind, task, num_digits, path, format, layout, prompt_key, answer_key, chat_template, shuffle_seed
    reward      [{name, weight, timeout_s}, ...]
    eval        every_steps, at_start, kind, task, num_digits, path, format, layout, prompt_key, answer_key, seed,
                max_prompts, samples_per_prompt, prompts_per_batch, temperature, top_p, max_new_tokens,
                max_prompt_tokens, reward, correct_threshold, best_metric
    checkpoint  every_steps, keep, keep_best, async_save, must_save_by, resume, export_hf_at_end, export_layout
    logging     tensorboard, progress_bar, plot, level
    """

    run: RunSection = _f(RunSection, "the run")
    model: ModelSection = _f(ModelSection, "the policy model")
    mesh: MeshSection = _f(MeshSection, "device mesh of the trainer")
    precision: PrecisionSection = _f(PrecisionSection, "parameter and optimizer-state precision")
    optim: OptimSection = _f(OptimSection, "optimizer")
    grpo: GrpoSection = _f(GrpoSection, "batch and loss")
    generation: GenerationSection = _f(GenerationSection, "sampling")
    data: DataSection = _f(DataSection, "prompts")
    reward: tuple[RewardSpec, ...] = _f([], "reward functions, summed with their weights", min_items=1)
    eval: EvalSection = _f(EvalSection, "held-out evaluation (rl.evaluate, python -m m3jax.eval)")
    checkpoint: CheckpointSection = _f(CheckpointSection, "checkpoints and export")
    logging: LoggingSection = _f(LoggingSection, "what to record")

    def __post_init__(self):
        super().__post_init__()
        if not _DEFER[0]:
            problems = _problems(self)
            if problems:
                raise ConfigError([p.text for p in problems])

    @property
    def micro_steps_per_update(self) -> int:
        """Forward/backward passes per optimizer update."""
        g, m = self.grpo, self.mesh
        return g.sequences_per_step // (g.updates_per_step * g.micro_batch_size * m.data * m.expert)


_DEFER = [False]  # True while from_dict builds a RunConfig, so that problems are reported with sources
