"""The vLLM pool's typed configuration (`PoolConfig`, built from `generation.*` by
`rl.generation.backends.make_generator`) and its error (`PoolError`): what the pool, its engine actors and the
weight transports read, with no Ray, vLLM or torch import."""

from __future__ import annotations

import dataclasses


# vLLM's SamplingParams raises any temperature in (0, 0.01) to 0.01 with only a log warning (vllm 0.32
# sampling_params._MAX_TEMP): it would sample, and return logprobs, at another temperature than the trainer's
VLLM_MIN_TEMPERATURE = 1e-2


def check_temperature(temperature: float) -> None:
    """Raise ValueError for a temperature vLLM would silently change (see VLLM_MIN_TEMPERATURE)."""
    if 0 < temperature < VLLM_MIN_TEMPERATURE:
        raise ValueError(f"temperature={temperature}: vLLM samples at {VLLM_MIN_TEMPERATURE} or more (it raises "
                         f"smaller ones to {VLLM_MIN_TEMPERATURE}), so its logprobs would not be the trainer's; "
                         f"expected 0 (greedy) or >= {VLLM_MIN_TEMPERATURE}")


# the weight version of an engine started from a directory of shapes alone (m3jax.hf.shapes: vLLM's dummy weights),
# before its first update; an engine started from a checkpoint holds version 0
NO_WEIGHTS = -1


class PoolError(RuntimeError):
    """The pool cannot serve a request (e.g. no healthy engine is left)."""


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    model_dir: str  # the checkpoint every engine starts from (released HF layout), or its shapes (m3jax.hf.shapes)
    servers: int = 2
    tensor_parallel: int = 1
    expert_parallel: int = 1
    gpu_memory_utilization: float = 0.8
    max_model_len: int = 2048
    # refuse a request with a token id outside [0, vocab_size) before an engine sees it (vLLM would raise, and
    # the pool take the error for a dead engine); None: not checked here
    vocab_size: int | None = None
    dtype: str = "float32"
    ray_address: str | None = None  # None: start a local Ray
    bucket_bytes: int = 256 << 20
    transport: str = "ray"  # a key of rl.generation.transfer.TRANSPORTS (generation.weight_transport)
    # the collective transport's buffers: "cpu" (gloo) or "cuda" (NCCL); generation.weight_group_device resolved
    # by rl.generation.bucket_sender.resolve_group_device
    group_device: str = "cpu"
    weight_apply: str = "auto"  # VLLMEngine's weight_apply: auto (in-place where it covers the model) / reload
    request_timeout_s: float = 600.0
    max_restarts: int = 4
    chunks_per_engine: int = 2
    seed: int = 0
    # generation.vllm_executor: auto | mp | ray (rl.generation.vllm_ray.EXECUTORS); the pool's own copy of
    # the config holds what "auto" resolved to (uni / mp / ray), which each engine actor uses
    executor: str = "auto"
    # engines return each row's MoE routes (grpo.routing_replay: rollout): GPU vLLM only (vllm_results.CPU_REASON)
    return_routes: bool = False
    # CPU engine processes start with glibc malloc settings that keep their memory between weight updates
    # (rl.generation.host_memory; generation.vllm_malloc_tuning)
    malloc_tuning: bool = True
    # a local Ray started by the pool gets its object store filled once while the engines start
    # (rl.generation.local_ray; generation.vllm_object_store_warmup)
    warm_object_store: bool = True
