"""Building the configured generation backend, and the check that new weights really arrived.

The trainer only sees the `Generator` interface; this is the one place that knows how each backend
is constructed from a run config (architecture.md: the trainer never imports vLLM or Ray).
"""

from __future__ import annotations

import os

import numpy as np
from flax import nnx

from rl.generation.base import SamplingParams
from rl.generation.jax_engine import JaxEngine


def make_generator(cfg, graphdef, state, *, pad_id: int, run_dir: str):
    """The JAX engine (sharing the trainer's parameters) or a vLLM pool started from a checkpoint."""
    model = nnx.merge(graphdef, state.params, state.rest)  # a view: no parameter is copied
    if cfg.generation.backend == "jax":
        # routes: for grpo.routing_replay and moe/route_mismatch_frac (n_moe_layers * k * 2 bytes per token);
        # block_ids, when the model has sparse layers: for grpo.indexer_replay and
        # indexer/selection_mismatch_frac (n_sparse_layers * Hi * K * 2 bytes per token, M3: 7,296 B, held on
        # the device for the whole batch while it decodes, and sent to the host with the rollout)
        # one step off policy: the engine samples while the train step donates the parameters' buffers,
        # so it keeps a copy of each version it is given
        sparse = model.num_sparse_layers > 0
        return JaxEngine(graphdef, state.params, state.rest, pad_id=pad_id, return_routes=True,
                         return_block_ids=sparse, copy_weights=cfg.grpo.max_trajectory_age_steps > 0)
    import jax

    from m3jax.hf.save import save_shapes
    from rl.generation.bucket_sender import resolve_group_device
    from rl.generation.vllm_pool import PoolConfig, VLLMPool

    g = cfg.generation
    if cfg.model.path:
        model_dir = cfg.model.path  # the release is in the layout vLLM reads
        problem = pushed_dtype_problem(model, model_dir)
        if problem:  # every push would be refused (engines check dtypes against it): say so before engines start
            raise ValueError(problem)
    else:
        # A freshly initialised model: the engines start from its shapes (vLLM's dummy weights) and take its values
        # from the trainer's first push (`engines_start_empty`), so the model never goes through disk
        model_dir = os.path.join(run_dir, "vllm-initial")
    dtype = g.vllm_dtype if g.vllm_dtype != "auto" else cfg.precision.param_dtype  # "float32" | "bfloat16"
    pool_cfg = PoolConfig(model_dir=model_dir, servers=g.vllm_servers, tensor_parallel=g.vllm_tensor_parallel,
                          expert_parallel=g.vllm_expert_parallel,
                          gpu_memory_utilization=g.vllm_gpu_memory_utilization,
                          max_model_len=g.max_seq_len + 1,  # scoring a full-length sequence asks for 1 more token
                          vocab_size=model.cfg.vocab_size,
                          dtype=dtype, ray_address=g.vllm_ray_address, bucket_bytes=g.weight_bucket_mb << 20,
                          transport=g.weight_transport, request_timeout_s=g.vllm_request_timeout_s,
                          max_restarts=g.vllm_max_restarts, seed=cfg.run.seed, executor=g.vllm_executor,
                          malloc_tuning=g.vllm_malloc_tuning, warm_object_store=g.vllm_object_store_warmup,
                          group_device=resolve_group_device(g.weight_group_device),
                          # routes cost the engines a capture buffer: asked for only when replayed (GPU only)
                          return_routes=cfg.grpo.routing_replay == "rollout")
    def start(peers=None):
        if not cfg.model.path:  # the engines start from the random model's shapes, written by process 0
            save_shapes(model, model_dir, layout="released")
        return VLLMPool(pool_cfg, graphdef, pad_id=pad_id, **({"peers": peers} if peers is not None else {}))

    if jax.process_count() == 1:
        return start()
    from rl.generation.bucket_sender import RoutedSender
    from rl.generation.multihost import JaxPeers, ProcessZeroPool, started_on_zero

    zero = jax.process_index() == 0
    # On the collective transport every process sends the tensors it holds; on `ray` and `shm`, process 0 sends all.
    peers = JaxPeers() if g.weight_transport == "collective" else None
    sender = (RoutedSender(pool_cfg.bucket_bytes, timeout_s=pool_cfg.request_timeout_s, device=pool_cfg.group_device)
              if peers is not None and not zero else None)
    return ProcessZeroPool(started_on_zero(lambda: start(peers), zero), graphdef,
                           is_zero=zero, peers=peers, sender=sender, group_device=pool_cfg.group_device)


def engines_start_empty(cfg) -> bool:
    """Whether the run's generator starts without the model's weights: the vLLM engines of a model without
    `model.path` (a random one) start from its shapes alone and hold weight version 0 only once the trainer has
    pushed it (`make_generator`)."""
    return cfg.generation.backend != "jax" and not cfg.model.path


def pushed_dtype_problem(model, model_dir: str) -> str | None:
    """Why a pool started from `model_dir` would refuse every weight push of `model`, or None: each engine checks
    a pushed tensor's dtype against its checkpoint's (`VLLMEngine.check`), and the trainer sends its parameters'
    dtype (`precision.master` decides: fp32 with 'none', else bf16), which a checkpoint at `model.path` need not
    share. Found by the first push otherwise, after the first training step. Reads headers only."""
    from m3jax.hf.save import slot_dtypes
    from m3jax.hf.shapes import tensor_table

    disk = {name: dtype for name, (_, dtype) in tensor_table(model_dir).items()}
    for slot, sent in slot_dtypes(model, "released"):
        if slot.name in disk and disk[slot.name] != sent:
            return (f"generation.backend vllm: the trainer would push {slot.name} as {sent}, but the engines' "
                    f"checkpoint {model_dir} holds it as {disk[slot.name]}, and they refuse a dtype their "
                    "checkpoint does not have; give the parameters the checkpoint's dtype (precision.master 'none': "
                    "float32, 'fp32' / 'compact': bfloat16), or export the model in the trainer's dtypes "
                    "(m3jax.save_pretrained(model, path, layout='released')) and serve that")
    return None


def probe_sequences(n: int, vocab: int, prompt_len: int, response_len: int, seed: int = 1234):
    """Fixed token sequences (the same every step) whose logprobs engines and trainer must agree on."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab, (n, prompt_len)).tolist()
    responses = rng.integers(0, vocab, (n, response_len)).tolist()
    return prompts, responses


def probe_batch(prompts, responses, width: int, pad_id: int) -> dict[str, np.ndarray]:
    """The trainer-side view of the probes: next-token arrays [1, n, width - 1] (one micro-batch)."""
    n = len(prompts)
    seq = np.full((n, width), pad_id, np.int32)
    attention = np.zeros((n, width - 1), np.int32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq[i, :len(p) + len(r)] = p + r
        attention[i, :len(p) + len(r) - 1] = 1
    return {"input_ids": seq[None, :, :-1], "targets": seq[None, :, 1:], "attention_mask": attention[None]}


def probe_max_abs_diff(engine_logprobs: list[list[np.ndarray]], trainer_logprobs: np.ndarray, prompts) -> float:
    """max over engines, probes and response tokens of |logp_engine - logp_trainer|.

    trainer_logprobs[i, t] is log p(seq[t + 1] | seq[:t + 1]), so response token j of probe i sits at
    t = len(prompt_i) - 1 + j. A token both sides score -inf (outside the run's top-k / top-p) agrees; one -inf
    on one side only, or a NaN on either, is an infinite difference: |-inf - -inf| is NaN, and max(worst, NaN)
    kept `worst`, so under top-k every probe was passed over and an engine with stale or NaN weights read 0.
    """
    worst = 0.0
    for per_engine in engine_logprobs:
        for i, lp in enumerate(per_engine):
            start = len(prompts[i]) - 1
            got = np.asarray(lp, np.float64)
            ref = np.asarray(trainer_logprobs[i, start:start + len(lp)], np.float64)
            with np.errstate(invalid="ignore"):
                diff = np.where(got == ref, 0.0, np.abs(got - ref))
            worst = max(worst, float(np.max(np.where(np.isnan(diff), np.inf, diff), initial=0.0)))
    return worst


def model_end_tokens(model_section, eos_token_id) -> tuple[int, ...]:
    """The ids a response of the run's model ends at when `generation.stop_token_ids` is empty, as vLLM decides
    them: for model.path, its generation_config.json's eos_token_id where it sets one, else config.json's
    (`m3jax.hf.end_tokens`), and its tokenizer's eos token (vLLM's "primary" EOS: a chat model whose template ends
    each turn with a token its configs do not name ran every response to max_new_tokens, an audit); for
    model.tiny, its eos_token_id (`eos_token_id`: the model's M3Config's)."""
    from m3jax.hf.end_tokens import as_token_ids, end_token_ids
    if not model_section.path:
        return as_token_ids(eos_token_id)
    ids = end_token_ids(model_section.path, eos_token_id)
    primary = tokenizer_eos_id(model_section.path)
    return ids if primary is None or primary in ids else (*ids, primary)


def tokenizer_eos_id(path: str) -> int | None:
    """The eos token id of model directory `path`'s tokenizer, or None where it has no tokenizer (a run on a
    synthetic task's own vocabulary needs none) or no eos token."""
    from m3jax.hf.safetensors_io import CheckpointError
    from rl.model_tokenizer import load_tokenizer
    try:
        eos = load_tokenizer(path).eos_token_id
    except CheckpointError:
        return None
    return None if eos is None else int(eos)


def sampling_of(cfg, eos_token_id) -> SamplingParams:
    """The run's sampling parameters; an empty `generation.stop_token_ids` means the model's end tokens
    (`eos_token_id`: an id, a list of them, or None; `model_end_tokens` gives them for a run's model)."""
    from m3jax.hf.end_tokens import as_token_ids
    g = cfg.generation
    stops = tuple(g.stop_token_ids) or as_token_ids(eos_token_id)
    return SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                          stop_token_ids=stops)
