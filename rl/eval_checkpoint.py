"""Scoring a saved policy without training (what `python -m m3jax.eval` runs): a run's checkpoint (the
latest or a given step) or a Hugging Face directory, evaluated on the config's `eval` section.

Only the model and its checkpoint reader are built (as `rl.policy.export_latest` does), the reader is
read-only, and generation is the JAX engine over the restored parameters whatever `generation.backend`
says: a checkpoint of a JAX-backend run scores exactly as the run's own evaluation of the same step did
(same parameters, prompts, sampling key and compiled program).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rl import evaluate as held_out
from rl.config import ConfigError, RunConfig, checkpoint_dir
from rl.generation.backends import model_end_tokens, sampling_of
from rl.generation.jax_engine import JaxEngine


@dataclasses.dataclass
class LoadedPolicy:
    graphdef: Any
    params: Any
    rest: Any
    eos_token_id: Any  # the model's end tokens (`model_end_tokens`): the stops when generation.stop_token_ids is empty
    step: int | None  # the checkpoint's step (None for a HF directory)
    meta: dict  # the checkpoint's meta (best value, data position, ...); {} for a HF directory


def from_checkpoint(cfg: RunConfig, step: int | str | None = None) -> LoadedPolicy:
    """The policy of checkpoint `step` (None: the newest readable one; "best": rl.checkpoint_keep.chosen_step) of the
    run's directory."""
    from rl import checkpoint as ckpt_lib
    from rl.checkpoint_keep import chosen_step
    from rl.policy import build_policy
    from rl.resume_checks import check_model

    directory = checkpoint_dir(cfg)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no checkpoints in {os.path.abspath(directory)} (run.out_dir = {cfg.run.out_dir})")
    reader = ckpt_lib.Checkpointer(directory, keep=cfg.checkpoint.keep, async_save=False, read_only=True)
    try:
        # A missing step is refused before the model is built (at M3's size that is the expensive part).
        step = chosen_step(reader, step)
        if not reader.steps():
            raise FileNotFoundError(f"no readable checkpoint in {reader.directory}")
        policy = build_policy(cfg, kernel_timing="read", abstract=True)
        if step is None:
            got = reader.restore_latest(policy.state, params_only=True)
            if got is None:
                raise FileNotFoundError(f"no readable checkpoint in {reader.directory}")
        else:
            got = reader.restore_step(step, policy.state, params_only=True)
    finally:
        reader.close()
    state, meta = got  # placed by the restore (the target's shardings); the optimizer state by shape only
    check_model(meta, cfg, f"checkpoint step {meta['step']} in {reader.directory}", "evaluate")
    return LoadedPolicy(policy.graphdef, state.params, state.rest,
                        model_end_tokens(cfg.model, policy.model_cfg.eos_token_id), int(meta["step"]), meta)


def from_hf(cfg: RunConfig, path: str) -> LoadedPolicy:
    """A Hugging Face directory's model (either M3 layout), on the config's mesh and parameter dtype."""
    import jax.numpy as jnp
    from flax import nnx

    import m3jax
    from m3jax.hf.end_tokens import end_token_ids
    from rl.policy import model_options, training_positions
    from sharding.layout import Layout
    from sharding.mesh import build_mesh

    m = cfg.mesh
    m3_cfg = m3jax.M3Config.from_pretrained(path)
    end_tokens = end_token_ids(path, m3_cfg.eos_token_id)
    outside = [t for t in (cfg.generation.stop_token_ids or end_tokens) if t >= m3_cfg.vocab_size]
    if outside:  # what the config check says of model.path's, for --hf's model
        raise ConfigError(f"{path}: the evaluation's stop token {outside[0]} is not below the model's vocab_size = "
                          f"{m3_cfg.vocab_size}, so no response would stop; allowed: generation.stop_token_ids (or "
                          "the checkpoint's eos_token_id) in [0, vocab_size)")
    from rl.config.validate_eval import eval_lengths
    prompt, new = eval_lengths(cfg)
    if prompt + new > m3_cfg.max_position_embeddings:  # what the config check says of model.path, for --hf's model
        raise ConfigError(f"{path}: the evaluation's prompt + response limits are {prompt} + {new} = {prompt + new} "
                          f"positions, more than the model has (max_position_embeddings = "
                          f"{m3_cfg.max_position_embeddings}); allowed: eval.max_prompt_tokens + eval.max_new_tokens "
                          f"of at most {m3_cfg.max_position_embeddings}")
    layout = Layout() if m.num_devices == 1 else build_mesh(m.to_mesh_config(), m3_cfg,
                                                            seq_len=training_positions(cfg, m3_cfg))
    model = m3jax.from_pretrained(path, dtype=jnp.dtype(cfg.precision.param_dtype), mesh=layout,
                                  **model_options(cfg, m3_cfg, layout, kernel_timing="read"))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return LoadedPolicy(graphdef, params, rest, end_tokens, None, {})


def tokenizer_for(cfg: RunConfig, hf_dir: str | None = None):
    """The run's tokenizer, as training chose it (rl.prompt_loader.build_data): the digit tasks' own for synthetic
    training data (whatever eval.kind: a file of digit prompts evaluates a digit run too), else the HF directory's
    (falling back to model.path's, where training read it)."""
    if cfg.data.kind == "synthetic":
        from rl.tasks import DigitTokenizer
        return DigitTokenizer()
    from transformers import AutoTokenizer
    for source in (hf_dir, cfg.model.path):
        if source is None:
            continue
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):  # an export without tokenizer files: try model.path
            continue
    tried = [f"{hf_dir} (--hf)"] * (hf_dir is not None) + [f"{cfg.model.path} (model.path)"] * bool(cfg.model.path)
    raise FileNotFoundError(f"no tokenizer in {' or '.join(tried) or 'any directory: model.path is null'}; expected "
                            "the tokenizer files Hugging Face saves beside a model's config.json")


def score(cfg: RunConfig, policy: LoadedPolicy, tokenizer) -> dict:
    """The val/* metrics of `policy` on the config's evaluation (rl.evaluate)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine = JaxEngine(policy.graphdef, policy.params, policy.rest, pad_id=pad_id)
    es = held_out.build_eval_set(cfg, tokenizer, sampling_of(cfg, policy.eos_token_id).stop_token_ids,
                                 training_records(cfg))
    return held_out.evaluate(engine, es, tokenizer)


def training_records(cfg: RunConfig) -> list:
    """The run's training prompts, which a synthetic evaluation excludes (as the trainer's does); a file
    evaluation excludes nothing (its file is the held-out set)."""
    if cfg.eval.kind != "synthetic":
        return []
    from rl.prompt_loader import build_data
    return build_data(cfg)[1].records
